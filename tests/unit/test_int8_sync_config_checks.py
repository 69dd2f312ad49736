"""``checkpoint_engine.backend=qurl_int8`` in the driver: passes with a quantized ``qurl_vllm`` rollout whose
settings the engine carries, the driver filling the rollout's dtype and the model's tied lm_head; refused, naming
the fix, for bf16, for verl's stock rollout, without the plugin import, with other settings than the rollout's,
with a tied lm_head the model lacks, with keys the engine does not take, with the code-change tracker; the FP8
KV scales and LoRA adapters stay refused (they need the colocated sync)."""
from __future__ import annotations

import pytest
import torch
from test_config_checks import CPU_OK  # the driver tests' CPU overrides

from qurl_recipes.compose import compose_ppo_config
from qurl_verl import driver as qc
from qurl_verl.settings import QurlConfigError, uses_qurl

pytestmark = pytest.mark.both_stacks



@pytest.fixture
def tiny_model(tmp_path_factory):
    from qurl_recipes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _host_with(**probed):
    from qurl_verl.platform.host import Host

    return Host(**{**Host.probe().__dict__, **probed})

CE = "actor_rollout_ref.rollout.checkpoint_engine"


def int8_sync(fmt: str = "int8") -> list[str]:
    return [f"{CE}.backend=qurl_int8", f"{CE}.custom_backend_module=qurl_verl.checkpoint_engine.int8_engine",
            f"+{CE}.engine_kwargs.qurl_int8.quantization={fmt}",
            "+actor_rollout_ref.rollout.custom.qurl.code_change_row_stride=0"]


@pytest.fixture
def qurl(monkeypatch, tiny_model):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    return [*(o.replace("rollout.name=vllm", "rollout.name=qurl_vllm") for o in CPU_OK),
            f"actor_rollout_ref.model.path={tiny_model}"]


def test_passes_for_a_quantized_qurl_vllm_rollout(qurl):
    qc.check_config(compose_ppo_config([*qurl, *int8_sync()]))
    fp8 = [*qurl, *int8_sync("fp8"), "actor_rollout_ref.rollout.quantization=fp8"]
    qc.check_config(compose_ppo_config(fp8), host=_host_with(avx512=True))


def test_refused_for_bf16_and_for_stock_vllm(qurl, monkeypatch, tiny_model):
    bf16 = [*qurl, *int8_sync(), "actor_rollout_ref.rollout.quantization=bf16"]
    with pytest.raises(QurlConfigError, match=r"backend=qurl_int8 with .*quantization=bf16.*Set .*quantization=int8"):
        qc.check_config(compose_ppo_config(bf16))
    monkeypatch.delenv("VERL_PLATFORM")
    stock = compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tiny_model}", *int8_sync()[:3]])
    assert uses_qurl(stock)  # the engine alone brings the driver in
    with pytest.raises(QurlConfigError, match=r"backend=qurl_int8 with actor_rollout_ref.rollout.name=vllm.*"
                                              r"Set actor_rollout_ref.rollout.name=qurl_vllm"):
        qc.check_config(stock)


def test_refused_without_its_module_or_with_other_settings(qurl):
    no_module = [o for o in int8_sync() if "custom_backend_module" not in o]
    with pytest.raises(QurlConfigError, match=r"custom_backend_module=.*Set .*custom_backend_module="
                                              r"qurl_verl.checkpoint_engine.int8_engine"):
        qc.check_config(compose_ppo_config([*qurl, *no_module]))
    other = [*qurl, *int8_sync("fp8")]  # the rollout is int8
    with pytest.raises(QurlConfigError, match=r"differs from the rollout's quantization.*quantization=int8"):
        qc.check_config(compose_ppo_config(other))
    ignore = [*qurl, *int8_sync(), "+actor_rollout_ref.rollout.custom.qurl.ignore=[down_proj]"]
    with pytest.raises(QurlConfigError, match=r"engine_kwargs.qurl_int8.ignore=\[down_proj\]"):
        qc.check_config(compose_ppo_config(ignore))
    qc.check_config(compose_ppo_config([*ignore, f"+{CE}.engine_kwargs.qurl_int8.ignore=[down_proj]"]))
    rest = [*qurl, *int8_sync(), f"+{CE}.engine_kwargs.qurl_int8.rest_dtype=float16"]
    with pytest.raises(QurlConfigError, match=r"rest_dtype=float16 with actor_rollout_ref.rollout.dtype=bfloat16.*Set "):
        qc.check_config(compose_ppo_config(rest))
    qc.check_config(compose_ppo_config([*qurl, *int8_sync(), f"+{CE}.engine_kwargs.qurl_int8.rest_dtype=bfloat16"]))
    tracker = [o for o in int8_sync() if "code_change" not in o]
    # the key is not in verl's schema: the override the message prints must add it, or Hydra refuses it
    with pytest.raises(QurlConfigError, match=r"code-change tracker.*Set \+actor_rollout_ref\.rollout\.custom\.qurl\."
                                              r"code_change_row_stride=0$"):
        qc.check_config(compose_ppo_config([*qurl, *tracker]))


def test_kv_scales_and_lora_adapters_stay_refused(qurl):
    fp8_kv = [*qurl, *int8_sync(), "+actor_rollout_ref.rollout.custom.qurl.kv_cache=fp8"]
    with pytest.raises(QurlConfigError, match=r"kv_cache=fp8 with .*backend='?qurl_int8'?.*naive"):
        qc.check_config(compose_ppo_config(fp8_kv), host=_host_with(avx512=True))
    lora = [*qurl, *int8_sync(), "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
    with pytest.raises(QurlConfigError, match=r"LoRA adapters .*backend='?qurl_int8'?.*naive"):
        qc.check_config(compose_ppo_config(lora))


@pytest.fixture
def untied_model(tmp_path_factory):
    from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "untied", TinyModelSpec(tie_word_embeddings=False))


def engine_kwargs(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.qurl_int8)


@pytest.mark.parametrize("tied", [True, False])
def test_the_driver_fills_the_rest_dtype_and_the_tied_lm_head_from_the_run(qurl, tied, untied_model, tiny_model,
                                                                          monkeypatch, tmp_path):
    """verl hands the engine only its engine_kwargs: the driver's hook sets the rollout's dtype for the rest and
    the model's ``tie_word_embeddings`` (read from the checkpoint's config.json, as transformers builds it), and
    the engine built from them leaves lm_head out exactly for the tied model."""
    import json

    from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine
    from qurl_verl.driver import on_validate_config

    monkeypatch.setenv("QURL_CACHE_DIR", str(tmp_path))
    model = tiny_model if tied else untied_model
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is tied  # the builder's own flag
    overrides = [o for o in qurl if not o.startswith("actor_rollout_ref.model.path=")]
    cfg = compose_ppo_config([*overrides, f"actor_rollout_ref.model.path={model}", *int8_sync(),
                              "actor_rollout_ref.rollout.dtype=float16"])
    on_validate_config(cfg, log=lambda *_: None)
    kwargs = engine_kwargs(cfg)
    assert kwargs == {"quantization": "int8", "rest_dtype": "float16", "tie_word_embeddings": tied}
    on_validate_config(cfg, log=lambda *_: None)  # verl's TaskRunner runs the hook again: nothing changes
    assert engine_kwargs(cfg) == kwargs
    engine = QurlInt8CheckpointEngine(1 << 20, device="cpu", **kwargs)
    assert engine.encoder.skip == (frozenset({"lm_head.weight"}) if tied else frozenset())
    assert engine.encoder.rest_dtype == torch.float16


def test_the_engines_defaults_without_the_driver_are_safe():
    """Built from bare engine_kwargs (the driver skipped): lm_head is sent (right for tied and untied models),
    the rest in bf16, verl's default rollout dtype."""
    from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine

    engine = QurlInt8CheckpointEngine(1 << 20, device="cpu")
    assert engine.encoder.skip == frozenset() and engine.encoder.rest_dtype == torch.bfloat16


def test_a_tied_lm_head_the_model_does_not_have_and_unknown_kwargs_are_refused(qurl, untied_model):
    overrides = [o for o in qurl if not o.startswith("actor_rollout_ref.model.path=")]
    untied = [*overrides, f"actor_rollout_ref.model.path={untied_model}", *int8_sync()]
    with pytest.raises(QurlConfigError, match=r"tie_word_embeddings=True for a model whose config.json does "
                                              r"not tie.*Set ~actor_rollout_ref.*tie_word_embeddings"):
        qc.check_config(compose_ppo_config([*untied, f"+{CE}.engine_kwargs.qurl_int8.tie_word_embeddings=true"]))
    qc.check_config(compose_ppo_config([*untied, f"+{CE}.engine_kwargs.qurl_int8.tie_word_embeddings=false"]))
    with pytest.raises(QurlConfigError, match=r"has bucket_mb, which the engine does not take.*Remove "
                                              r"~actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.qurl_int8.bucket_mb"):
        qc.check_config(compose_ppo_config([*untied, f"+{CE}.engine_kwargs.qurl_int8.bucket_mb=4"]))


def test_the_delta_mode_passes_and_bad_delta_settings_are_refused(qurl):
    """``delta`` and ``full_sync_every`` pass the driver and reach the engine; wrong values are refused by the
    driver and by the engine itself, naming the fix."""
    from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine

    delta = [*qurl, *int8_sync(), f"+{CE}.engine_kwargs.qurl_int8.delta=true"]
    qc.check_config(compose_ppo_config(delta))
    qc.check_config(compose_ppo_config([*delta, f"+{CE}.engine_kwargs.qurl_int8.full_sync_every=10"]))
    with pytest.raises(QurlConfigError, match=r"full_sync_every=10 without delta=true.*Set \+actor_rollout_ref.*"
                                              r"qurl_int8.delta=true"):
        qc.check_config(compose_ppo_config([*qurl, *int8_sync(), f"+{CE}.engine_kwargs.qurl_int8.full_sync_every=10"]))
    with pytest.raises(QurlConfigError, match=r"delta='yes': must be true or false"):
        qc.check_config(compose_ppo_config([*qurl, *int8_sync(), f"+{CE}.engine_kwargs.qurl_int8.delta=yes"]))
    with pytest.raises(QurlConfigError, match=r"full_sync_every=-1: must be an integer >= 0"):
        qc.check_config(compose_ppo_config([*delta, f"+{CE}.engine_kwargs.qurl_int8.full_sync_every=-1"]))
    with pytest.raises(ValueError, match=r"qurl_int8: full_sync_every=3 without delta=true"):
        QurlInt8CheckpointEngine(1 << 20, device="cpu", full_sync_every=3)
    engine = QurlInt8CheckpointEngine(1 << 20, device="cpu", delta=True, full_sync_every=5)
    assert engine.delta_sender.full_sync_every == 5 and engine.delta_receiver is not None
    assert QurlInt8CheckpointEngine(1 << 20, device="cpu").delta_sender is None  # off by default
