"""The qurl losses' group: ``actor_rollout_ref.actor.policy_loss.{loss_mode, is_cap, acr_upper_cap}``, read
in the driver and the actor workers (by ``loss_config.QurlPolicyLossConfig``). What the losses need from the rest
of verl's config: ``loss_requirements``."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .errors import is_number, raise_problems
from .keys import POLICY_LOSS_KEY, select, show


class LossMode(str, enum.Enum):
    ACR = "qurl_acr"  # Adaptive Clipping Range, paper Eq. 9
    TIS = "qurl_tis"  # decoupled PPO with token-level TIS, Eq. 5 (the ACR baseline)


DEFAULT_IS_CAP = 2.0  # C; verl's FP8-rollout TIS uses 2 as well


@dataclass(frozen=True)
class LossSettings:
    """Hyper-parameters of the qurl losses (``actor_rollout_ref.actor.policy_loss.*``).

    is_cap: C, the truncation of the outer importance weight min(pi_prox / pi_behav, C) (Eq. 5/9),
        also where ACR starts widening the upper clip bound.
    acr_upper_cap: optional ceiling on ACR's widened upper bound (1 + eps_high) / r; None (the
        paper) leaves it uncapped.
    eps_low / eps_high / dual-clip c are verl's own ``actor.clip_ratio_low/high/c``.
    """

    is_cap: float = DEFAULT_IS_CAP
    acr_upper_cap: float | None = None

    def problems(self, clip_ratio_high: float | None = None) -> list[str]:
        found = []
        if not is_number(self.is_cap) or self.is_cap < 1.0:
            found.append(
                f"{POLICY_LOSS_KEY}.is_cap={show(self.is_cap)}: the IS truncation C must be a finite number >= 1 "
                f"(C < 1 would down-weight even matched tokens); set {POLICY_LOSS_KEY}.is_cap={DEFAULT_IS_CAP}"
            )
        if self.acr_upper_cap is not None:
            floor = 1.0 + (clip_ratio_high or 0.0)
            if not is_number(self.acr_upper_cap) or self.acr_upper_cap < floor:
                found.append(
                    f"{POLICY_LOSS_KEY}.acr_upper_cap={show(self.acr_upper_cap)}: a cap on the widened upper bound "
                    f"must be >= 1 + clip_ratio_high = {floor:g}; set {POLICY_LOSS_KEY}.acr_upper_cap=null (the paper's setting)"
                )
        return found

    def check(self) -> None:
        raise_problems("qurl loss settings:", self.problems())

    @classmethod
    def from_policy_loss_config(cls, node: Any) -> LossSettings:
        is_cap = select(node, "is_cap")
        return cls(is_cap=DEFAULT_IS_CAP if is_cap is None else is_cap, acr_upper_cap=select(node, "acr_upper_cap"))
