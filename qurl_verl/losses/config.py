"""Hyper-parameters of the qurl losses, and the driver-side check of the settings they depend on.

Select them with

    actor_rollout_ref.actor.policy_loss._target_=qurl_verl.losses.config.QurlPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=qurl_acr        # or qurl_tis
    +actor_rollout_ref.actor.policy_loss.acr_C=2.0                # optional, default 2.0

eps_low / eps_high / dual-clip c are verl's own `actor.clip_ratio_low/high/c`; they are not
repeated here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from verl.workers.config import PolicyLossConfig

QURL_LOSS_MODES = ("qurl_acr", "qurl_tis")
CONFIG_TARGET = "qurl_verl.losses.config.QurlPolicyLossConfig"

# verl builds the weights as exp(clamp(log-ratio, +-20)), so e^20 is the largest weight it can
# send. A threshold at or above it never truncates, and ACR sees the true pi_prox / pi_behav.
MIN_IS_THRESHOLD = math.exp(20.0)
SUGGESTED_IS_THRESHOLD = "1e9"


class AcrConfigError(ValueError):
    """A setting the qurl losses cannot run with; the message names the override that fixes it."""


def check_loss_values(acr_C: Any, acr_upper_cap: Any, clip_ratio_high: Optional[float] = None) -> list[str]:
    """Problems with the loss's own numbers, one line each (empty when fine)."""
    problems = []
    prefix = "actor_rollout_ref.actor.policy_loss"
    if not isinstance(acr_C, (int, float)) or isinstance(acr_C, bool) or not math.isfinite(acr_C) or acr_C < 1.0:
        problems.append(
            f"{prefix}.acr_C={_show(acr_C)}: the IS truncation C must be a finite number >= 1 "
            f"(C < 1 would down-weight even matched tokens); set {prefix}.acr_C=2.0"
        )
    if acr_upper_cap is not None:
        floor = 1.0 + (clip_ratio_high if clip_ratio_high is not None else 0.0)
        if not isinstance(acr_upper_cap, (int, float)) or isinstance(acr_upper_cap, bool) or acr_upper_cap < floor:
            problems.append(
                f"{prefix}.acr_upper_cap={_show(acr_upper_cap)}: a cap on the widened upper bound must be >= "
                f"1 + clip_ratio_high = {floor:g}; set {prefix}.acr_upper_cap=null (the paper's setting)"
            )
    return problems


@dataclass
class QurlPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus the qurl loss settings.

    acr_C: C, truncation of the outer importance weight min(pi_prox / pi_behav, C) (Eq. 5/9);
        also where ACR starts widening the upper clip bound. 2.0 follows verl's FP8-rollout TIS.
    acr_upper_cap: optional ceiling on ACR's widened upper bound (1 + eps_high) / r. None (the
        paper) leaves it uncapped.

    Building this config (driver and every actor worker do, through `_target_`) also registers
    the qurl losses, so they are found even when verl's plugin loading is switched off.
    """

    acr_C: float = 2.0
    acr_upper_cap: Optional[float] = None

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        problems = check_loss_values(self.acr_C, self.acr_upper_cap)
        if problems:
            raise AcrConfigError("\n".join(problems))
        from qurl_verl.losses.registration import register

        register()


def _select(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, default=None)


def _show(value: Any) -> str:
    """A value as it is written in a Hydra override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def validate_loss_settings(cfg: DictConfig) -> None:
    """Check a composed verl config for everything `qurl_acr` / `qurl_tis` rely on.

    Run in the driver before any worker starts. Does nothing for other loss modes. Raises one
    `AcrConfigError` listing every problem, each line naming the key and the value to set.
    """
    loss_mode = _select(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode")
    if loss_mode not in QURL_LOSS_MODES:
        return

    problems: list[str] = []
    pl = "actor_rollout_ref.actor.policy_loss"
    rc = "algorithm.rollout_correction"

    target = _select(cfg, f"{pl}._target_")
    if not _is_qurl_config_target(target):
        problems.append(f"{pl}._target_={_show(target)}: loss_mode={loss_mode} reads its settings from {pl}; set {pl}._target_={CONFIG_TARGET}")

    if _select(cfg, rc) is None:
        problems.append(f"{rc} is missing: loss_mode={loss_mode} needs verl's rollout correction; compose from verl's ppo_trainer.yaml")
    else:
        if _select(cfg, f"{rc}.bypass_mode") is not False:
            problems.append(
                f"{rc}.bypass_mode={_show(_select(cfg, f'{rc}.bypass_mode'))}: {loss_mode} needs decoupled PPO (the trainer "
                f"recomputes the full-precision old log-probs); set {rc}.bypass_mode=false"
            )
        if _select(cfg, f"{rc}.rollout_is") != "token":
            problems.append(
                f"{rc}.rollout_is={_show(_select(cfg, f'{rc}.rollout_is'))}: {loss_mode} needs per-token weights "
                f"pi_prox/pi_behav; set {rc}.rollout_is=token"
            )
        problems.extend(_threshold_problems(_select(cfg, f"{rc}.rollout_is_threshold"), rc))
        if _select(cfg, f"{rc}.rollout_is_batch_normalize"):
            problems.append(
                f"{rc}.rollout_is_batch_normalize=true rescales the weights, so pi_prox/pi_behav cannot be "
                f"recovered; set {rc}.rollout_is_batch_normalize=false"
            )
        if _select(cfg, f"{rc}.rollout_rs") is not None:
            problems.append(
                f"{rc}.rollout_rs={_show(_select(cfg, f'{rc}.rollout_rs'))}: rejection sampling rewrites response_mask "
                f"before the loss; the qurl losses bound large ratios through C instead; set {rc}.rollout_rs=null"
            )

    if _select(cfg, "actor_rollout_ref.rollout.calculate_log_probs") is not True:
        problems.append(
            "actor_rollout_ref.rollout.calculate_log_probs="
            f"{_show(_select(cfg, 'actor_rollout_ref.rollout.calculate_log_probs'))}: {loss_mode} needs the quantized "
            "engine's log-probs; set actor_rollout_ref.rollout.calculate_log_probs=true"
        )

    clip_high = _select(cfg, "actor_rollout_ref.actor.clip_ratio_high")
    if clip_high is None:
        clip_high = _select(cfg, "actor_rollout_ref.actor.clip_ratio")
    acr_C = _select(cfg, f"{pl}.acr_C")
    problems.extend(
        check_loss_values(
            QurlPolicyLossConfig.acr_C if acr_C is None else acr_C,
            _select(cfg, f"{pl}.acr_upper_cap"),
            clip_high,
        )
    )

    if problems:
        raise AcrConfigError(f"loss_mode={loss_mode} cannot run with this config:\n  " + "\n  ".join(problems))


def _threshold_problems(threshold: Any, rc: str) -> list[str]:
    fix = f"set {rc}.rollout_is_threshold={SUGGESTED_IS_THRESHOLD}"
    if threshold is None:
        return [f"{rc}.rollout_is_threshold=null: verl then sends no IS weights at all; {fix}"]
    if isinstance(threshold, str) and "_" in threshold:
        return [
            f"{rc}.rollout_is_threshold={threshold}: a 'lower_upper' threshold is IcePop, which zeroes "
            f"out-of-band weights; {fix}"
        ]
    try:
        value = float(threshold)
    except (TypeError, ValueError):
        return [f"{rc}.rollout_is_threshold={_show(threshold)} is not a number; {fix}"]
    if not value >= MIN_IS_THRESHOLD:
        return [
            f"{rc}.rollout_is_threshold={threshold}: verl would truncate pi_prox/pi_behav before the loss "
            f"(the loss applies its own C); it must be >= e^20 = {MIN_IS_THRESHOLD:.4g}; {fix}"
        ]
    return []


def _is_qurl_config_target(target: Any) -> bool:
    if not isinstance(target, str) or not target:
        return False
    if target == CONFIG_TARGET:
        return True
    module_name, _, cls_name = target.rpartition(".")
    try:
        import importlib

        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, QurlPolicyLossConfig)
