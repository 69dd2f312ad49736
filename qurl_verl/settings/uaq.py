"""The UAQ group: ``qurl.uaq.*``, read in the driver (the checkpoint is converted before Ray starts); the vLLM
server checks the checkpoint against the presets' mirror of it, ``actor_rollout_ref.rollout.custom.qurl_uaq``.
Its defaults are the pure layer's (``qurl_verl.quant.uaq``), which the presets leave null."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qurl_verl.quant.uaq import DEFAULT_UAQ_SCALE, DEFAULT_UAQ_TARGETS

from .errors import QurlConfigError, is_number, raise_problems
from .keys import UAQ_KEY, select, show

UAQ_KEYS = ("enable", "scale", "targets", "cache_dir")


@dataclass(frozen=True)
class UaqSettings:
    """``qurl.uaq.*``: Update-Aware Quantization, applied once to the checkpoint in the driver.

    enable: convert ``actor_rollout_ref.model.path`` (norm x s, q/k/v / s) before step 1.
    scale: s. targets: the projections divided by s (whole norm groups). null: the pure layer's default.
    cache_dir: where converted checkpoints are kept (default ``$QURL_CACHE_DIR/uaq`` or
        ``~/.cache/qurl_verl/uaq``); on several nodes, storage every node reads.
    """

    enable: bool = False
    scale: float = DEFAULT_UAQ_SCALE
    targets: tuple[str, ...] = tuple(DEFAULT_UAQ_TARGETS)
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        found = []
        if not isinstance(self.enable, bool):
            found.append(f"{UAQ_KEY}.enable={show(self.enable)}: must be true or false")
        if not is_number(self.scale) or self.scale <= 0:
            found.append(f"{UAQ_KEY}.scale={show(self.scale)}: must be a positive finite number; set {UAQ_KEY}.scale={DEFAULT_UAQ_SCALE}")
        if not self.targets or any(not isinstance(t, str) for t in self.targets):
            found.append(f"{UAQ_KEY}.targets={show(list(self.targets))}: must be a list of projections, e.g. [q_proj,k_proj,v_proj]")
        raise_problems("qurl UAQ settings:", found)

    @classmethod
    def from_config(cls, cfg: Any) -> UaqSettings:
        node = select(cfg, UAQ_KEY)
        if node is None:
            return cls()
        if not (isinstance(node, Mapping) or hasattr(node, "items")):
            raise QurlConfigError(f"{UAQ_KEY}={show(node)}: must be a mapping with keys {', '.join(UAQ_KEYS)}")
        values = dict(node.items())
        unknown = sorted(set(values) - set(UAQ_KEYS))
        if unknown:
            raise QurlConfigError(f"unknown key(s) {', '.join(f'{UAQ_KEY}.{k}' for k in unknown)}; UAQ reads only: {', '.join(UAQ_KEYS)}")
        targets = values.get("targets") or DEFAULT_UAQ_TARGETS
        return cls(
            enable=values.get("enable", False),
            scale=DEFAULT_UAQ_SCALE if values.get("scale") is None else values["scale"],
            targets=(targets,) if isinstance(targets, str) else tuple(targets),
            cache_dir=values.get("cache_dir"),
        )
