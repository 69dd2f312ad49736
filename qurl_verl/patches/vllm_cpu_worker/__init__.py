"""Applied by the `qurl_vllm` worker extension inside vLLM-CPU workers (some only on some CPU classes).

Two lists: ``BEFORE_MODEL_LOAD`` once per worker process, before vLLM builds the model, in this
order (the scale keep-alive wraps vLLM's INT8 oneDNN post-processing, which the project's CPU INT8
kernels, put into vLLM's kernel list by ``vllm_cpu_int8_kernels``, call through);
``AFTER_RELOAD`` after every finalized weight reload (post-processing vLLM's layerwise reload
leaves undone). Both do nothing on a vLLM platform other than CPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from qurl_verl.patches.contract import Patch, apply_each, group_patches

if TYPE_CHECKING:
    import torch

BEFORE_MODEL_LOAD = (
    "vllm_cpu_onednn_scale_keepalive",
    "vllm_cpu_int8_kernels",
    "vllm_cpu_fp8_block_bias",
    "vllm_cpu_moe_silu",
    "vllm_cpu_lora_device",
)
AFTER_RELOAD = (
    "vllm_cpu_tied_lm_head_refresh",
    "vllm_cpu_moe_prepack_refresh",
)
ORDER = BEFORE_MODEL_LOAD + AFTER_RELOAD


def patches(names=ORDER) -> list[Patch]:
    return group_patches(__name__, names)


def _on_vllm_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def before_model_load() -> dict[str, str]:
    """Process-wide vLLM-CPU fixes, before the model is built: {patch name: what it did} ({} off CPU)."""
    return apply_each(patches(BEFORE_MODEL_LOAD)) if _on_vllm_cpu() else {}


def after_reload(model: torch.nn.Module) -> dict[str, str]:
    """Per-reload fixes, after finalize: {patch name: what it did} ({} off CPU)."""
    return apply_each(patches(AFTER_RELOAD), model) if _on_vllm_cpu() else {}
