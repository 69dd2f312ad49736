"""Applied in every process that imports verl; each acts only on configs that use qurl-verl."""
from __future__ import annotations

from collections.abc import Callable

from qurl_verl.patches.contract import Patch, group_patches

ORDER = ("validate_config_hook", "ray_runtime_env", "fully_async_sync_metrics")


def patches() -> list[Patch]:
    return group_patches(__name__, ORDER)


def apply_all(check: Callable[[object], None], prepare: Callable[[object], None]) -> dict[str, str]:
    """Applied by the plugin at ``import verl``, with the driver's ``on_validate_config`` (``check``) and
    ``ensure_prepared`` (``prepare``), which the first two run and never import: {patch name: what it did}."""
    hooks = {"validate_config_hook": (check,), "ray_runtime_env": (prepare,)}
    return {p.name: p.apply(*hooks.get(p.name, ())) for p in patches()}
