"""A hub id is checked from its config.json alone: a model qurl-verl refuses is refused before any
weight is downloaded (a Mixtral-8x7B checkpoint is ~93 GB), one it runs is checked (and its 8-bit
share reported) without its weights, and UAQ reads no tensor of a refused one."""
from __future__ import annotations

import json

import pytest

from qurl_recipes.compose import compose_ppo_config
from qurl_verl import driver
from qurl_verl.model_info import hf_config_of, hub_id
from qurl_verl.settings import DRY_RUN_ENV, QurlConfigError, dry_run

# the fields the checks read, from each model's published config.json
MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "head_dim": 128,
              "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 48, "vocab_size": 151936,
              "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
MIXTRAL_CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000,
                  "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A stand-in hub client: serves one config.json per repo, records every file asked for, and
    fails any whole-checkpoint download."""
    import huggingface_hub
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    asked: list[tuple[str, str]] = []
    configs: dict[str, dict] = {}

    def hf_hub_download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        if repo_id not in configs:
            raise OSError(f"{repo_id} is not on this hub")
        path = tmp_path / repo_id.replace("/", "--") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(configs[repo_id]))
        return str(path)

    def snapshot_download(*args, **kwargs):
        raise AssertionError("the whole checkpoint was about to be downloaded")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return configs, asked


@pytest.mark.parametrize("preset", ["int8", "tis_int8"])
def test_a_refused_moe_hub_id_is_refused_from_its_config_alone(hub, preset):
    configs, asked = hub
    configs["mistralai/Mixtral-8x7B-v0.1"] = MIXTRAL_CONFIG
    cfg = compose_ppo_config([f"+qurl={preset}", "actor_rollout_ref.model.path=mistralai/Mixtral-8x7B-v0.1"])
    with pytest.raises(QurlConfigError, match=r"cannot quantize mistralai/Mixtral-8x7B-v0.1 \(MixtralForCausalLM\): .*block_sparse_moe"):
        driver.on_validate_config(cfg, log=lambda *_: None)
    assert set(asked) == {("mistralai/Mixtral-8x7B-v0.1", "config.json")}


@pytest.mark.parametrize("preset", ["int8", "fp8"])
def test_a_qwen3_moe_hub_id_is_checked_from_its_config_alone(hub, preset):
    """Qwen3-30B-A3B with bf16 experts: 3% of its linear weights, 30% of a token's linear FLOPs in 8 bits."""
    configs, asked = hub
    configs["Qwen/Qwen3-30B-A3B"] = MOE_CONFIG
    cfg = compose_ppo_config([f"+qurl={preset}", "actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B"])
    lines = []
    driver.check_config(cfg, log=lines.append)
    assert set(asked) == {("Qwen/Qwen3-30B-A3B", "config.json")}
    assert any("3% of the linear weights and 30% of the active linear FLOPs" in line for line in lines), lines


def test_an_unreadable_hub_config_stops_the_run_with_the_fix(hub):
    cfg = compose_ppo_config(["+qurl=int8", "actor_rollout_ref.model.path=org/private-model"])
    with pytest.raises(QurlConfigError, match="cannot read its config.json from the hub .*pass its local folder"):
        driver.on_validate_config(cfg, log=lambda *_: None)


def test_a_dry_run_downloads_nothing(hub, monkeypatch):
    """The recipes' offline config checks read the local cache only, and go on without the file."""
    configs, asked = hub
    configs["Qwen/Qwen3-30B-A3B"] = MOE_CONFIG
    monkeypatch.setenv(DRY_RUN_ENV, "1")
    assert dry_run()
    assert hf_config_of("Qwen/Qwen3-30B-A3B") is None
    assert asked == []


@pytest.mark.parametrize("path,expected", [
    ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B"), ("./Qwen/x", None), ("/abs/org/name", None), ("hdfs://a/b", None),
    ("one-part", None), ("a/b/c", None),
])
def test_what_counts_as_a_hub_id(path, expected):
    assert hub_id(path) == expected


def test_uaq_convert_refuses_an_unknown_layout_before_reading_a_tensor(tmp_path, monkeypatch):
    from qurl_verl.quant import uaq_convert

    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MIXTRAL_CONFIG))
    (model / "model.safetensors").write_bytes(b"")

    def safe_open(*args, **kwargs):
        raise AssertionError("a tensor was about to be read")

    monkeypatch.setattr(uaq_convert, "safe_open", safe_open)
    with pytest.raises(ValueError, match="model_type 'mixtral'"):
        uaq_convert.convert_checkpoint(model, tmp_path / "out")
