"""Applied by the `qurl_vllm` rollout adapter, in its own process only: the metrics channel always, the
K/V range observation (``attention_kv_hook``, ``actor_kv_ranges``) with ``custom.qurl.kv_cache=fp8``."""
from __future__ import annotations

from qurl_verl.patches.contract import Patch, apply_each, group_patches

ORDER = ("loss_metrics_channel", "attention_kv_hook", "actor_kv_ranges")


def patches() -> list[Patch]:
    return group_patches(__name__, ORDER)


def apply_all(kv_cache_scales: bool = False) -> dict[str, str]:
    """{patch name: what it did}; the K/V range patches only for an FP8 KV cache (``kv_cache_scales``)."""
    kv = {"attention_kv_hook", "actor_kv_ranges"}
    return apply_each(p for p in patches() if kv_cache_scales or p.name not in kv)
