"""Which kernel class each FP8 linear of a live vLLM engine runs, read from the engine's kernel objects.

vLLM's compressed-tensors W8A8 FP8 scheme (``fp8`` and ``fp8_block``) picks a kernel object per layer when it
builds the model (``scheme.fp8_linear``: on CUDA Cutlass's per-channel or block class, DeepGEMM's, FlashInfer's,
Triton's; on a CPU vLLM-CPU's), through the selector and the environment the server set
(``cuda_kernel_env``). The class the layer holds is what it runs; this names it, as ``int8_gemm_report`` does
for INT8.
"""
from __future__ import annotations

import torch


def fp8_kernel(module: torch.nn.Module):
    """The FP8 kernel object of a quantized linear (compressed-tensors W8A8 FP8), else None."""
    return getattr(getattr(module, "scheme", None), "fp8_linear", None)


def fp8_kernels(model: torch.nn.Module) -> dict[str, str]:
    """{module name: kernel class name} for every FP8 linear of the model."""
    out = {}
    for name, module in model.named_modules():
        kernel = fp8_kernel(module)
        if kernel is not None:
            out[name] = type(kernel).__name__
    return out
