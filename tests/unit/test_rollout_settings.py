"""qurl_vllm rollout settings: where the format comes from, what the engine is built with, and
the one-message errors a user gets for configs that cannot run."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from omegaconf import OmegaConf

from qurl_verl import driver
from qurl_verl.platform.host import Host
from qurl_verl.quant import FP8_BLOCK, FP8_CHANNEL, INT8_CHANNEL, Granularity, QuantScheme, int_format, parse_scheme
from qurl_verl.rollout.engine_checks import check_cpu_rollout_format
from qurl_verl.settings import QurlConfigError, RolloutSettings

# always full precision besides lm_head: the MoE routers, and the routed experts by default
MOE_ALWAYS = (r"re:(?:.*\.)?mlp\.gate$", r"re:(?:.*\.)?mlp\.shared_expert_gate$", r"re:(?:.*\.)?mlp\.experts(?:\..*)?$")


def validate_rollout_settings(cfg, host=None):
    """What the driver checks and returns for the rollout group of a config (on ``host``, default this one)."""
    return driver.check_config(cfg, host=host).rollout


def without_amx() -> Host:
    return dataclasses.replace(Host.probe(), amx=False, amx_fp8=False)


def rollout_node(quantization=None, qurl=None):
    node = {"name": "qurl_vllm", "quantization": quantization, "custom": None}
    if qurl is not None:
        node["custom"] = {"qurl": qurl}
    return OmegaConf.create(node)


@pytest.mark.parametrize(
    "value, fmt, scheme",
    [
        (None, "int8", INT8_CHANNEL),  # rollout.name=qurl_vllm alone means INT8
        ("int8", "int8", INT8_CHANNEL),
        ("FP8", "fp8", FP8_CHANNEL),
        ("fp8_block", "fp8_block", FP8_BLOCK),
        ("bf16", "bf16", None),
    ],
)
def test_format_comes_from_rollout_quantization(value, fmt, scheme):
    s = RolloutSettings.from_rollout_config(rollout_node(value))
    assert (s.format, s.format.engine_scheme, s.quant_scheme) == (fmt, scheme, scheme)


def test_int8_engine_config_is_compressed_tensors_w8a8_per_channel_per_token():
    quantization, overrides = RolloutSettings.from_rollout_config(rollout_node("int8")).engine_quantization()
    cfg = overrides["quantization_config"]
    group = cfg["config_groups"]["group_0"]
    assert quantization == "compressed-tensors" and cfg["quant_method"] == "compressed-tensors"
    assert group["weights"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    assert cfg["ignore"] == ["lm_head", *MOE_ALWAYS]  # the MoE entries match no module of a dense model


def test_fp8_block_engine_config_has_128_blocks_and_groups():
    _, overrides = RolloutSettings(format="fp8_block").engine_quantization()
    group = overrides["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["type"] == "float" and group["weights"]["block_structure"] == [128, 128]
    assert group["input_activations"]["strategy"] == "group" and group["input_activations"]["group_size"] == 128


def test_bf16_builds_an_unquantized_engine():
    assert RolloutSettings(format="bf16").engine_quantization() == (None, {})


def test_ignored_layers_join_the_always_ignored_lm_head():
    s = RolloutSettings.from_rollout_config(
        rollout_node("int8", {"ignore": ["model.layers.0.mlp.down_proj", "re:.*layers\\.1\\.self_attn.*"]})
    )
    assert s.ignore_patterns == ("lm_head", *MOE_ALWAYS, "model.layers.0.mlp.down_proj", "re:.*layers\\.1\\.self_attn.*")
    assert s.quantization_config()["ignore"] == list(s.ignore_patterns)


def through_the_engine(s: RolloutSettings, existing: dict | None = None) -> RolloutSettings:
    """What a worker reads: the server's ``additional_config``, through the JSON of verl's CLI arguments."""
    import json

    return RolloutSettings.from_additional_config(json.loads(json.dumps(s.additional_config(existing))))


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_block", "bf16"])
def test_worker_gets_the_settings_with_the_engine(fmt):
    s = RolloutSettings(format=fmt, ignore=("model.layers.0.mlp.down_proj",) if fmt != "bf16" else (),
                        code_change_row_stride=3, code_change_max_mb=0.5, kv_cache="fp8")
    assert through_the_engine(s) == s
    assert s.additional_config({"other_plugin": 1})["other_plugin"] == 1  # a user's own entries are kept


def test_an_engine_without_qurl_settings_is_refused_by_name():
    with pytest.raises(QurlConfigError, match=r"carries no qurl_vllm settings \(additional_config\['qurl'\]\)"):
        RolloutSettings.from_additional_config({})


def test_unknown_format_names_the_key_and_the_choices():
    with pytest.raises(QurlConfigError) as e:
        RolloutSettings.from_rollout_config(rollout_node("int4"))
    msg = str(e.value)
    assert "actor_rollout_ref.rollout.quantization=int4 " in msg and "int8, fp8, fp8_block, bf16" in msg


def test_unknown_custom_key_is_rejected():
    with pytest.raises(QurlConfigError, match=r"custom\.qurl\.keep_bf16.*reads only: ignore, code_change_row_stride, code_change_max_mb, weight_bits"):
        RolloutSettings.from_rollout_config(rollout_node("int8", {"keep_bf16": ["x"]}))


def test_ignore_must_hold_names():
    with pytest.raises(QurlConfigError, match=r"ignore=\[3\]: must be a list"):
        RolloutSettings.from_rollout_config(rollout_node("int8", {"ignore": [3]}))


def driver_config(tmp_path, quantization="int8", architectures=("Qwen2ForCausalLM",), device="cpu"):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": list(architectures)}))
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"model": {"path": str(model)}, "rollout": rollout_node(quantization)},
            "trainer": {"device": device},
        }
    )


def test_valid_config_passes(tmp_path):
    assert validate_rollout_settings(driver_config(tmp_path)).format == "int8"


def test_unknown_architecture_is_one_clear_error(tmp_path):
    with pytest.raises(QurlConfigError) as e:
        validate_rollout_settings(driver_config(tmp_path, architectures=["GPT2LMHeadModel"]))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "Qwen2ForCausalLM" in msg and "rollout.name=vllm" in msg


def test_block_fp8_on_a_cpu_without_amx_is_one_clear_error(tmp_path):
    with pytest.raises(QurlConfigError, match="fp8_block needs a CPU with AMX.*=int8"):
        validate_rollout_settings(driver_config(tmp_path, quantization="fp8_block"), host=without_amx())


def test_block_fp8_on_gpu_hosts_is_not_checked_against_the_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    cfg = driver_config(tmp_path, quantization="fp8_block", device="cuda")
    assert validate_rollout_settings(cfg, host=without_amx()).format == "fp8_block"


def test_block_fp8_with_amx_is_allowed():
    assert check_cpu_rollout_format(RolloutSettings(format="fp8_block"), amx=True, amx_fp8=True) is None


def test_block_fp8_without_amx_fp8_warns_that_activations_stay_bf16():
    """vLLM-CPU runs block FP8 W8A8 only on AMX-FP8 CPUs; on other AMX CPUs its kernel keeps bf16 activations."""
    warning = check_cpu_rollout_format(RolloutSettings(format="fp8_block"), amx=True)
    assert warning is not None and "W8A16" in warning and "quantization=int8" in warning
    assert check_cpu_rollout_format(RolloutSettings(format="int8"), amx=True) is None


def test_per_channel_fp8_on_cpu_runs_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="qurl_verl"):
        assert validate_rollout_settings(driver_config(tmp_path, quantization="fp8")).format == "fp8"
    assert "emulated FP8" in caplog.text


def test_code_change_tracking_defaults_on_and_can_be_turned_off():
    assert RolloutSettings.from_rollout_config(rollout_node("int8")).code_change_row_stride == 8
    off = RolloutSettings.from_rollout_config(rollout_node("int8", {"code_change_row_stride": 0}))
    assert off.code_change_row_stride == 0


def test_code_change_row_stride_must_be_a_count():
    with pytest.raises(QurlConfigError, match="code_change_row_stride=-1: must be an integer >= 0"):
        RolloutSettings.from_rollout_config(rollout_node("int8", {"code_change_row_stride": -1}))


@pytest.mark.parametrize("bits", [4, 7, 8])
def test_weight_bits_select_the_integer_code_width(bits):
    s = RolloutSettings.from_rollout_config(rollout_node("int8", {"weight_bits": bits}))
    assert (s.weight_bits, s.quant_scheme) == (bits, QuantScheme(int_format(bits), Granularity.CHANNEL))
    assert s.quant_scheme == parse_scheme(f"int{bits}", "channel")
    # the engine runs the same INT8 W8A8 kernel for every width: its config does not change
    assert s.quantization_config() == RolloutSettings(format="int8").quantization_config()
    assert through_the_engine(s) == s


@pytest.mark.parametrize("node, match", [
    (rollout_node("int8", {"weight_bits": 3}), r"weight_bits=3: must be an integer from 4 to 8"),
    (rollout_node("int8", {"weight_bits": True}), r"weight_bits=true: must be an integer"),
    (rollout_node("fp8", {"weight_bits": 7}), r"weight_bits=7 with actor_rollout_ref.rollout.quantization=fp8"),
])
def test_bad_weight_bits_name_the_key_and_the_fix(node, match):
    with pytest.raises(QurlConfigError, match=match):
        RolloutSettings.from_rollout_config(node)


def test_tracker_memory_cap_defaults_to_256_mib_and_must_be_positive():
    assert RolloutSettings.from_rollout_config(rollout_node("int8")).code_change_max_bytes == 256 * 2**20
    assert RolloutSettings.from_rollout_config(rollout_node("int8", {"code_change_max_mb": 0.5})).code_change_max_bytes == 2**19
    for bad in (0, -1, "big", True):
        with pytest.raises(QurlConfigError, match="code_change_max_mb=.*: must be a number > 0"):
            RolloutSettings.from_rollout_config(rollout_node("int8", {"code_change_max_mb": bad}))


def test_kv_cache_setting_reads_from_the_rollout_config_and_names_vllms_dtype():
    from qurl_verl.settings.rollout import KVCacheFormat

    rollout = {"name": "qurl_vllm", "quantization": "int8", "custom": {"qurl": {"kv_cache": "FP8"}}}
    settings = RolloutSettings.from_rollout_config(rollout)
    assert settings.kv_cache is KVCacheFormat.FP8 and settings.kv_cache.engine_dtype == "fp8_e4m3"
    assert RolloutSettings.from_rollout_config({"name": "qurl_vllm"}).kv_cache.engine_dtype == "auto"
    with pytest.raises(QurlConfigError, match=r"custom.qurl.kv_cache=int4: must be one of auto, fp8"):
        RolloutSettings.from_rollout_config({**rollout, "custom": {"qurl": {"kv_cache": "int4"}}})
