"""Applied in every process that imports verl; each acts only on configs that use qurl-verl."""
from __future__ import annotations

from qurl_verl.patches.contract import Patch, apply_each, group_patches

ORDER = ("validate_config_hook", "ray_runtime_env")


def patches() -> list[Patch]:
    return group_patches(__name__, ORDER)


def apply_all() -> dict[str, str]:
    """Applied by the plugin at ``import verl``: {patch name: what it did}."""
    return apply_each(patches())
