"""Applied by the plugin only when the CPU platform is selected (`VERL_PLATFORM=cpu`)."""
from __future__ import annotations

from qurl_verl.patches.contract import Patch, apply_each, group_patches

ORDER = (
    "gloo_backend_dedup",
    "cpu_engine_lookup",
    "weight_sync_ack_timeout",
    "vllm_cpu_thread_binding",
    "value_model_attention",
    "vllm_cpu_unquantized_gemm",  # not in qurl_vllm's engine processes (its applies-predicate)
)


def patches() -> list[Patch]:
    return group_patches(__name__, ORDER)


def apply_all() -> dict[str, str]:
    """Applied by the plugin on the CPU platform: {patch name: what it did}."""
    return apply_each(patches())
