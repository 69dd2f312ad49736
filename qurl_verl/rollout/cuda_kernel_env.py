"""Which CUDA INT8 kernel a ``qurl_vllm`` engine may use: GPU kernel policy, applied by the server
through the environment the engine's processes inherit.

vLLM picks the first INT8 kernel of its CUDA list whose is_supported() passes, and Cutlass claims
every CUDA GPU (vllm/model_executor/kernels/linear/__init__.py:282-287, scaled_mm/cutlass.py:33-40)
but fails at run time on Blackwell (SM100/SM120, vLLM issue #54311). Naming it in
VLLM_DISABLED_KERNELS (a comma list, envs.py:1100-1104) makes vLLM take the Triton INT8 kernel.
"""
from __future__ import annotations

from collections.abc import Mapping

from qurl_verl.settings import RolloutFormat

DISABLED_KERNELS_ENV = "VLLM_DISABLED_KERNELS"
CUTLASS_INT8_KERNEL = "CutlassInt8ScaledMMLinearKernel"
MIN_BLACKWELL_CAPABILITY = (10, 0)


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
