"""Which CUDA kernels a ``qurl_vllm`` engine may use: GPU kernel policy, applied by the server before the
engine starts, through the environment its processes inherit and the engine arguments it passes.

* INT8 on Blackwell: vLLM picks the first INT8 kernel of its CUDA list whose is_supported() passes, and Cutlass
  claims every CUDA GPU (vllm/model_executor/kernels/linear/__init__.py:282-287, scaled_mm/cutlass.py:33-40)
  but fails at run time on Blackwell (SM100/SM120, vLLM issue #54311). Naming it in VLLM_DISABLED_KERNELS (a
  comma list, envs.py:1100-1104) makes vLLM take the Triton INT8 kernel.
* ``fp8_block``: on Hopper and Blackwell vLLM 0.24 prefers its DeepGEMM-based block kernels
  (``_POSSIBLE_FP8_BLOCK_KERNELS``: FlashInfer+DeepGEMM, DeepGEMM, then Cutlass), whose weight post-processing
  re-quantizes the streamed codes to power-of-two (UE8M0) scales whenever ``VLLM_USE_DEEP_GEMM_E8M0`` is on,
  its default (``fp8_utils.requant_weight_ue8m0_inplace``): the engine would run other codes than the ones the
  trainer quantized, checksummed and tracked. ``VLLM_USE_DEEP_GEMM=0`` takes both DeepGEMM kernels out
  (``is_deep_gemm_supported``), leaving Cutlass's block kernel, which keeps the codes and their fp32 scales.
  (``VLLM_USE_DEEP_GEMM_E8M0=0`` alone keeps DeepGEMM with fp32 scales, with reports of faults and NaNs on
  SM12x: vLLM #57486, #54125.)

The attention backend an FP8 attention cache needs off Hopper is its sync feature's (``rollout.features``).
"""
from __future__ import annotations

from collections.abc import Mapping

from qurl_verl.settings import RolloutFormat

DISABLED_KERNELS_ENV = "VLLM_DISABLED_KERNELS"
CUTLASS_INT8_KERNEL = "CutlassInt8ScaledMMLinearKernel"
MIN_BLACKWELL_CAPABILITY = (10, 0)
USE_DEEP_GEMM_ENV = "VLLM_USE_DEEP_GEMM"


def int8_kernel_env(fmt: RolloutFormat | str, capability: tuple[int, int] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment an INT8 rollout engine needs on an NVIDIA GPU of ``capability`` (None: none).

    On Blackwell (>= 10.0) the Cutlass INT8 kernel is appended to ``VLLM_DISABLED_KERNELS``, keeping
    whatever ``environ`` already disables; otherwise, or when it is already listed, nothing.
    """
    if RolloutFormat(fmt) is not RolloutFormat.INT8 or capability is None or tuple(capability) < MIN_BLACKWELL_CAPABILITY:
        return {}
    current = environ.get(DISABLED_KERNELS_ENV, "")
    if CUTLASS_INT8_KERNEL in current.split(","):  # vLLM compares the unstripped entries
        return {}
    kept = current.rstrip(",")
    return {DISABLED_KERNELS_ENV: f"{kept},{CUTLASS_INT8_KERNEL}" if kept else CUTLASS_INT8_KERNEL}


def fp8_block_kernel_env(fmt: RolloutFormat | str, capability: tuple[int, int] | None,
                         environ: Mapping[str, str]) -> dict[str, str]:
    """``VLLM_USE_DEEP_GEMM=0`` for an ``fp8_block`` engine on an NVIDIA GPU, unless the user set the variable."""
    if RolloutFormat(fmt) is not RolloutFormat.FP8_BLOCK or capability is None or USE_DEEP_GEMM_ENV in environ:
        return {}
    return {USE_DEEP_GEMM_ENV: "0"}


def kernel_env(fmt: RolloutFormat | str, capability: tuple[int, int] | None, environ: Mapping[str, str]) -> dict[str, str]:
    return {**int8_kernel_env(fmt, capability, environ), **fp8_block_kernel_env(fmt, capability, environ)}


def nvidia_capability(capability: tuple[int, int] | None) -> tuple[int, int] | None:
    import torch

    return capability if torch.version.hip is None else None  # ROCm capabilities count differently
