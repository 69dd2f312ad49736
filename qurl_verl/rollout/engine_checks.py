"""What a ``qurl_vllm`` engine can run: the model's architecture, quantized MoE experts on the installed
vLLM, FP8 on the GPU's compute capability, FP8 formats on a CPU. Checked in the driver before Ray
starts, and again by each server on its own vLLM and hardware."""
from __future__ import annotations

from collections.abc import Iterable

from qurl_verl.model_info import REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from qurl_verl.rollout.vllm_versions import W8A8_INT8_EXPERTS_VLLM, vllm_release
from qurl_verl.settings import (
    QUANTIZATION_KEY,
    ROLLOUT_CUSTOM_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    ExpertsPrecision,
    KVCacheFormat,
    QurlConfigError,
    RolloutFormat,
    RolloutSettings,
)

# FP8 W8A8 needs FP8 tensor cores (Ada/Hopper, compute capability 8.9+); below that vLLM's
# compressed-tensors silently falls back to weight-only FP8, which leaves activations unquantized.
MIN_FP8_CAPABILITY = (8, 9)
# vLLM-CPU's FP8 KV path (``v1/attention/backends/cpu_attn.py::_get_attn_isa``, 0.24 and 0.32) runs
# head sizes that are multiples of 32, on x86 CPUs with AVX-512 or AMX; it raises for the rest.
FP8_KV_CPU_HEAD_DIM_MULTIPLE = 32
FP8_KV_FIX = f"remove {ROLLOUT_CUSTOM_KEY}.kv_cache (the KV cache in the engine's dtype)"


def check_architecture(architectures: Iterable[str] | None, model: str = "the model") -> None:
    archs = list(architectures or [])
    refused = [a for a in archs if a in REFUSED_ARCHITECTURES]
    if refused:
        raise QurlConfigError(
            f"{ROLLOUT_NAME} cannot quantize {model} ({refused[0]}): {REFUSED_ARCHITECTURES[refused[0]]}. "
            f"Supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Use {ROLLOUT_NAME_KEY}=vllm for this model."
        )
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise QurlConfigError(
            f"{ROLLOUT_NAME} does not know how to quantize {model} (architectures={archs or 'unknown'}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Use {ROLLOUT_NAME_KEY}=vllm for other models."
        )


def check_quantized_experts(settings: RolloutSettings, vllm_version: str | None, on_cpu: bool, amx: bool) -> None:
    """Refuse ``custom.qurl.experts=quantized`` where the installed vLLM would not run the experts W8A8.

    Called for MoE models only. ``vllm_version`` None (not installed where this runs): nothing to
    decide here; the rollout server checks again with its own vLLM."""
    if settings.experts is not ExpertsPrecision.QUANTIZED:
        return
    release = vllm_release(vllm_version)
    if release is None:
        return
    key, fix = f"{ROLLOUT_CUSTOM_KEY}.experts=quantized", f"remove {ROLLOUT_CUSTOM_KEY}.experts (experts in bf16)"
    if on_cpu:
        if release < W8A8_INT8_EXPERTS_VLLM:
            raise QurlConfigError(f"{key}: vLLM-CPU {vllm_version} has no INT8 or FP8 MoE kernel; {fix}")
        if settings.format is not RolloutFormat.INT8:
            raise QurlConfigError(
                f"{key} with {QUANTIZATION_KEY}={settings.format.value}: vLLM-CPU {vllm_version} has no FP8 MoE kernel for "
                f"this CPU; set {QUANTIZATION_KEY}=int8 (on an AMX CPU), or {fix}"
            )
        if not amx:
            raise QurlConfigError(
                f"{key}: vLLM-CPU {vllm_version} runs INT8 experts on CPUs with AMX only (Sapphire Rapids or newer), "
                f"this CPU has none; {fix}"
            )
    elif settings.format is RolloutFormat.INT8 and release < W8A8_INT8_EXPERTS_VLLM:
        raise QurlConfigError(
            f"{key} with {QUANTIZATION_KEY}=int8: vLLM {vllm_version} runs compressed-tensors INT8 experts with dynamic "
            "activations as W8A16 (bf16 activations; fixed in vLLM 0.32, PR #50833), so the rollout would not be the "
            f"W8A8 model; use {QUANTIZATION_KEY}=fp8 (W8A8 on GPUs with compute capability >= 8.9), or {fix}"
        )


def check_fp8_hardware(settings: RolloutSettings, capability: tuple[int, int] | None) -> None:
    """Refuse FP8 rollout on a CUDA GPU whose ``capability`` (major, minor) is below 8.9 (A100, A6000)."""
    if capability is None or not settings.quantized or settings.format is RolloutFormat.INT8:
        return
    if tuple(capability) < MIN_FP8_CAPABILITY:
        raise QurlConfigError(
            f"{QUANTIZATION_KEY}={settings.format.value} needs FP8 tensor cores (compute capability >= 8.9: L40S, H100, "
            f"H200, B200); this GPU has {capability[0]}.{capability[1]}, where vLLM would run weight-only FP8 (W8A16) and "
            f"leave activations in bf16. Use {QUANTIZATION_KEY}=int8 (the int8 / tis_int8 presets)."
        )


def check_cpu_rollout_format(settings: RolloutSettings, amx: bool, amx_fp8: bool = False) -> str | None:
    """FP8 on a CPU: block FP8 needs AMX (error) and runs W8A16 without AMX-FP8 (returns a warning); per-channel
    FP8 is emulated (returns a warning)."""
    if settings.format is RolloutFormat.FP8_BLOCK and not amx:
        raise QurlConfigError(
            f"{QUANTIZATION_KEY}=fp8_block needs a CPU with AMX (Sapphire Rapids or newer): vLLM-CPU has no other "
            f"block-FP8 kernel. Use {QUANTIZATION_KEY}=fp8 (per-channel, slow on CPU) or =int8 (fast on CPU)."
        )
    if settings.format is RolloutFormat.FP8_BLOCK and not amx_fp8:
        # vLLM-CPU's CPUFp8BlockScaledMMKernel ("W8A16 ... Input stays BF16"); W8A8 only with AMX-FP8 (0.32)
        return (
            f"{ROLLOUT_NAME}: {QUANTIZATION_KEY}=fp8_block on a CPU without AMX-FP8 runs vLLM-CPU's W8A16 block-FP8 "
            "kernel: FP8 weights, bf16 activations, so the rollout is not the W8A8 model (its mismatch is smaller). "
            f"{QUANTIZATION_KEY}=int8 runs W8A8 here."
        )
    if settings.format is RolloutFormat.FP8:
        return (
            f"{ROLLOUT_NAME}: {QUANTIZATION_KEY}=fp8 on CPU runs vLLM's emulated FP8 matmul, 10-30x slower than "
            "bf16; correct but meant for testing. int8 is the fast CPU format."
        )
    return None


def check_fp8_kv_cache(settings: RolloutSettings, *, on_cpu: bool, avx512: bool, amx: bool,
                       head_dim: int | None, uses_mla: bool) -> None:
    """Refuse ``custom.qurl.kv_cache=fp8`` for a model or CPU the engine's FP8 KV cache cannot serve."""
    if settings.kv_cache is not KVCacheFormat.FP8:
        return
    key = f"{ROLLOUT_CUSTOM_KEY}.kv_cache=fp8"
    if uses_mla:
        raise QurlConfigError(
            f"{key}: this model uses multi-head latent attention (kv_lora_rank), whose cache holds a compressed "
            f"latent with scales of its own, not per-layer K and V; {FP8_KV_FIX}"
        )
    if not on_cpu:
        return
    if not (avx512 or amx):
        raise QurlConfigError(
            f"{key}: vLLM-CPU runs an FP8 KV cache on x86 CPUs with AVX-512 or AMX only, and this CPU has neither "
            f"(AVX2); {FP8_KV_FIX}"
        )
    if head_dim is not None and head_dim % FP8_KV_CPU_HEAD_DIM_MULTIPLE:
        raise QurlConfigError(
            f"{key}: vLLM-CPU's FP8 KV cache needs a head size divisible by {FP8_KV_CPU_HEAD_DIM_MULTIPLE}; this model's "
            f"is {head_dim}; {FP8_KV_FIX}"
        )
