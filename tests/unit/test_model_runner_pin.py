"""vLLM's model runner for a ``qurl_vllm`` engine: the V1 runner, pinned by the server before the engine starts
(``qurl_verl.rollout.model_runner``); a stock run keeps vLLM's own choice.

vLLM decides in ``VllmConfig.use_v2_model_runner`` (``vllm/config/vllm.py``), which verl's ``run_server`` reaches
through ``create_engine_config`` after ``launch_server`` has called ``_apply_quantization`` (verl 0.9.1,
``vllm_async_server.py``: 305 then 477-484; headless nodes of a multi-node replica go through ``launch_server``
too). The property is run here as vLLM's own code, on a stand-in for the config it reads: a generating model of
the given architecture on a platform with Triton (a GPU), none of MRv2's unsupported features set, as in verl's
GPU defaults. On a CPU (no Triton) vLLM picks V1 by itself, so only the forced Triton branch shows a difference.
"""
from __future__ import annotations

import dataclasses
import logging
import types
from types import SimpleNamespace

import pytest

from qurl_verl.platform.host import Host
from qurl_verl.rollout.console_log import engine_logger
from qurl_verl.rollout.model_runner import USE_V2_MODEL_RUNNER_ENV, model_runner_env, user_chose_v2

pytestmark = pytest.mark.both_stacks  # vLLM's runner choice differs between 0.24 and 0.32

vllm = pytest.importorskip("vllm", reason="needs vLLM")

ON_024 = vllm.__version__.startswith("0.24.")
# vLLM 0.24's DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES holds these two (and four more); 0.32 defaults every
# architecture to MRv2, Qwen2 included
MRV2_BY_DEFAULT_ON_BOTH = ["Qwen3ForCausalLM", "LlamaForCausalLM"]
V1_BY_DEFAULT_ON_024 = "Qwen2ForCausalLM"


@pytest.fixture
def qurl_warnings():
    """What the server's engine logger emits (its own console logger: vLLM's serving imports set the root logger
    and its handlers to ERROR, which would drop these lines)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = engine_logger()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.fixture
def gpu_vllm(monkeypatch):
    """vLLM's config module as on a GPU: Triton importable; the variable unset, read afresh at each access."""
    import vllm.config.vllm as vllm_config
    import vllm.envs as envs

    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)
    monkeypatch.delenv(USE_V2_MODEL_RUNNER_ENV, raising=False)
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    return vllm_config


def vllm_picks_v2(vllm_config, architecture: str) -> bool:
    """vLLM's own ``use_v2_model_runner`` for a generating model of ``architecture``."""
    config = SimpleNamespace(
        model_config=SimpleNamespace(architectures=[architecture], runner_type="generate", is_diffusion=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        watermark_config=None,
    )
    config._get_v2_model_runner_unsupported_features = lambda: []
    default_model = getattr(vllm_config.VllmConfig, "_is_default_v2_model_runner_model", None)  # 0.24 only
    if default_model is not None:
        config._is_default_v2_model_runner_model = types.MethodType(default_model, config)
    return vllm_config.VllmConfig.use_v2_model_runner.fget(config)


def qurl_server(architecture: str, quantization: str = "int8"):
    """What ``_apply_quantization`` reads of a qurl server: its rollout config and vLLM's model config."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    hf = {"Qwen3ForCausalLM": Qwen3Config, "LlamaForCausalLM": LlamaConfig, "Qwen2ForCausalLM": Qwen2Config}[architecture]
    return SimpleNamespace(
        config=SimpleNamespace(quantization=quantization, custom=None, tensor_model_parallel_size=1, enforce_eager=False,
                         dtype="bfloat16"),
        model_config=SimpleNamespace(hf_config=hf(architectures=[architecture]), path="/models/x"),
    )


def apply_quantization_on_cpu_host(monkeypatch, server):
    from qurl_verl.rollout import server as server_module

    cpu = dataclasses.replace(Host.probe(), cuda_available=False, cuda_capability=None)
    monkeypatch.setattr(server_module.Host, "probe", classmethod(lambda cls: cpu))
    return server_module.QurlvLLMHttpServer._apply_quantization(server)


def test_vllm_defaults_these_architectures_to_mrv2_on_a_gpu(gpu_vllm):
    """The premise: without the pin, a GPU run of Qwen3 or Llama would get MRv2 on both stacks (Qwen2 on 0.32)."""
    for architecture in MRV2_BY_DEFAULT_ON_BOTH:
        assert vllm_picks_v2(gpu_vllm, architecture)
    assert vllm_picks_v2(gpu_vllm, V1_BY_DEFAULT_ON_024) is (not ON_024)


@pytest.mark.parametrize("architecture", [*MRV2_BY_DEFAULT_ON_BOTH, V1_BY_DEFAULT_ON_024])
@pytest.mark.parametrize("quantization", ["int8", "bf16"])
def test_qurl_server_pins_the_v1_runner_before_the_engine(gpu_vllm, monkeypatch, qurl_warnings, architecture, quantization):
    """``_apply_quantization`` (before verl builds the engine config) sets the variable, vLLM's choice is then V1
    for every architecture, and the choice is logged. A bf16 qurl run syncs through the same reload."""
    apply_quantization_on_cpu_host(monkeypatch, qurl_server(architecture, quantization))
    import os

    import vllm.envs as envs

    assert os.environ[USE_V2_MODEL_RUNNER_ENV] == "0"
    assert envs.VLLM_USE_V2_MODEL_RUNNER is False
    assert vllm_picks_v2(gpu_vllm, architecture) is False
    assert [r for r in qurl_warnings if "V1 model runner" in r.getMessage()]


def test_a_users_own_runner_choice_is_kept_and_mrv2_warned(gpu_vllm, monkeypatch, qurl_warnings):
    monkeypatch.setenv(USE_V2_MODEL_RUNNER_ENV, "1")
    apply_quantization_on_cpu_host(monkeypatch, qurl_server("Qwen3ForCausalLM"))
    import os

    assert os.environ[USE_V2_MODEL_RUNNER_ENV] == "1"
    assert vllm_picks_v2(gpu_vllm, "Qwen3ForCausalLM")
    assert any("Model Runner V2" in r.getMessage() and "has not run" in r.getMessage() for r in qurl_warnings)


def test_a_v1_runner_already_in_the_environment_is_said_too(gpu_vllm, monkeypatch, qurl_warnings):
    """A pin set before the server (by the user, or a launcher) is kept and the server still says which runner runs."""
    monkeypatch.setenv(USE_V2_MODEL_RUNNER_ENV, "0")
    apply_quantization_on_cpu_host(monkeypatch, qurl_server("LlamaForCausalLM"))
    assert not vllm_picks_v2(gpu_vllm, "LlamaForCausalLM")
    assert [r for r in qurl_warnings if "VLLM_USE_V2_MODEL_RUNNER=0, vLLM's V1 model runner (already set" in r.getMessage()]


def test_a_stock_vllm_server_keeps_vllms_choice(gpu_vllm):
    """verl's own server (``rollout.name=vllm``) with the plugin loaded: nothing set, MRv2 stays vLLM's default."""
    import os

    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    import qurl_verl  # noqa: F401  (the plugin, as verl's CLI loads it)

    stock = qurl_server("Qwen3ForCausalLM", quantization=None)
    stock.config.qat = None
    vLLMHttpServer._apply_quantization(stock)
    assert USE_V2_MODEL_RUNNER_ENV not in os.environ
    assert vllm_picks_v2(gpu_vllm, "Qwen3ForCausalLM")


def test_the_servers_engine_lines_survive_vllms_root_logger_at_error():
    """vLLM's serving entry points import ``model_hosting_container_standards``, which sets the root logger to ERROR
    (its default ``LOG_LEVEL``): the package logger's warnings are then dropped, the engine logger's are not."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # setLevel, not the attribute: it clears the loggers' isEnabledFor caches
    try:
        assert not logging.getLogger("qurl_verl").isEnabledFor(logging.WARNING)
        logger = engine_logger()
        assert logger.isEnabledFor(logging.WARNING) and not logger.propagate
        assert [h for h in logger.handlers if h.get_name() == f"{logger.name}.console" and h.level <= logging.WARNING]
    finally:
        root.setLevel(level)


@pytest.mark.parametrize("environ, env, v2", [
    ({}, {USE_V2_MODEL_RUNNER_ENV: "0"}, False),
    ({USE_V2_MODEL_RUNNER_ENV: "0"}, {}, False),
    ({USE_V2_MODEL_RUNNER_ENV: "1"}, {}, True),
    ({USE_V2_MODEL_RUNNER_ENV: "2"}, {}, True),  # vLLM: bool(int(value))
])
def test_model_runner_env_reads_the_variable_as_vllm_does(environ, env, v2):
    assert model_runner_env(environ) == env
    assert user_chose_v2(environ) is v2
