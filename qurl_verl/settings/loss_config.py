"""The verl policy-loss config of the qurl losses, selected with

    actor_rollout_ref.actor.policy_loss._target_=qurl_verl.settings.loss_config.QurlPolicyLossConfig

(the quantized presets set it). verl builds it in the driver and in every actor worker; the
fields, defaults and checks are those of ``LossSettings`` (``settings/loss.py``). It subclasses
verl's ``PolicyLossConfig``, so unlike the rest of ``settings`` it imports verl: the package's
``__init__`` never imports it, verl's config instantiation does (by the target above).
"""
from __future__ import annotations

from dataclasses import dataclass

from verl.workers.config import PolicyLossConfig

from .loss import DEFAULT_IS_CAP, LossSettings


@dataclass
class QurlPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus ``is_cap`` (C) and ``acr_upper_cap`` (see ``LossSettings``)."""

    is_cap: float = DEFAULT_IS_CAP
    acr_upper_cap: float | None = None

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        LossSettings(is_cap=self.is_cap, acr_upper_cap=self.acr_upper_cap).check()
