"""Applied by the `qurl_vllm` rollout adapter, in its own process only."""
from __future__ import annotations

from qurl_verl.patches.contract import Patch, apply_each, group_patches

ORDER = ("loss_metrics_channel",)


def patches() -> list[Patch]:
    return group_patches(__name__, ORDER)


def apply_all() -> dict[str, str]:
    """{patch name: what it did}."""
    return apply_each(patches())
