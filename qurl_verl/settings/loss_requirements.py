"""What the qurl losses (``loss_mode=qurl_acr`` / ``qurl_tis``) need from the rest of verl's config, checked in
the driver: their config class as ``policy_loss._target_``, verl's rollout correction sending pi_prox / pi_behav
untruncated, the engine's log-probs; and the refusal of another loss handed those untruncated weights."""
from __future__ import annotations

import importlib
import math
from typing import Any

from .errors import Requirement, problems
from .keys import LOSS_MODE_KEY, POLICY_LOSS_KEY, ROLLOUT_CORRECTION_KEY, ROLLOUT_KEY, select, show
from .loss import DEFAULT_IS_CAP, LossMode, LossSettings

LOSS_CONFIG_TARGET = "qurl_verl.settings.loss_config.QurlPolicyLossConfig"

# verl builds the IS weights as exp(clamp(log-ratio, +-20)); a threshold >= e^20 never truncates,
# so the loss sees the true pi_prox / pi_behav and applies its own C.
MIN_IS_THRESHOLD = math.exp(20.0)
SUGGESTED_IS_THRESHOLD = "1e9"


def is_qurl_loss_config_target(target: Any) -> bool:
    """``policy_loss._target_`` names ``QurlPolicyLossConfig`` (under either module that holds it) or a subclass of it."""
    if target == LOSS_CONFIG_TARGET:
        return True
    if not isinstance(target, str) or "." not in target:
        return False
    module_name, _, cls_name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
        base = importlib.import_module(LOSS_CONFIG_TARGET.rpartition(".")[0]).QurlPolicyLossConfig
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, base)


def _untruncated_threshold(value: Any) -> bool:
    if value is None or (isinstance(value, str) and "_" in value):
        return False
    try:
        return float(value) >= MIN_IS_THRESHOLD
    except (TypeError, ValueError):
        return False


_RC = ROLLOUT_CORRECTION_KEY
# What qurl_acr / qurl_tis need from the rest of verl's config (the quantized presets set all of it).
LOSS_REQUIRED = (
    Requirement(f"{POLICY_LOSS_KEY}._target_", is_qurl_loss_config_target, LOSS_CONFIG_TARGET,
                f"the qurl losses read is_cap / acr_upper_cap from {POLICY_LOSS_KEY}"),
    Requirement(f"{_RC}.bypass_mode", lambda v: v is False, False,
                "the qurl losses need decoupled PPO (the trainer recomputes the full-precision old log-probs)"),
    Requirement(f"{_RC}.rollout_is", lambda v: v == "token", "token", "the qurl losses need per-token weights pi_prox/pi_behav"),
    Requirement(f"{_RC}.rollout_is_threshold", _untruncated_threshold, SUGGESTED_IS_THRESHOLD,
                "verl must hand the loss pi_prox/pi_behav untruncated, a number >= e^20 (null sends no IS weights at all; "
                "a 'lower_upper' pair is IcePop, which zeroes out-of-band weights)"),
    Requirement(f"{_RC}.rollout_is_batch_normalize", lambda v: not v, False,
                "batch normalisation rescales the weights, so pi_prox/pi_behav cannot be recovered"),
    Requirement(f"{_RC}.rollout_rs", lambda v: v is None, None,
                "rejection sampling rewrites response_mask before the loss; the qurl losses bound large ratios through C"),
    Requirement(f"{ROLLOUT_KEY}.calculate_log_probs", lambda v: v is True, True,
                "the qurl losses need the quantized engine's log-probs"),
)


def loss_problems(cfg: Any) -> list[str]:
    """Every problem of a config whose loss_mode is a qurl loss (empty for other loss modes)."""
    if select(cfg, LOSS_MODE_KEY) not in {m.value for m in LossMode}:
        return []
    if select(cfg, _RC) is None:
        return [f"{_RC} is missing: the qurl losses need verl's rollout correction; compose from verl's ppo_trainer.yaml"]
    clip_high = select(cfg, "actor_rollout_ref.actor.clip_ratio_high", select(cfg, "actor_rollout_ref.actor.clip_ratio"))
    settings = LossSettings.from_policy_loss_config(select(cfg, POLICY_LOSS_KEY))
    return problems(cfg, LOSS_REQUIRED) + settings.problems(clip_high)


def untruncated_weights_problem(cfg: Any) -> str | None:
    """A loss other than the qurl ones, handed the quantized presets' untruncated pi_prox / pi_behav.

    The presets set verl's ``rollout_is_threshold`` to 1e9 so that the qurl losses receive the true ratio
    and truncate it at their own C. A later ``loss_mode`` override (a verl example's ``vanilla`` or ``gspo``)
    keeps that threshold, and verl's losses multiply by the weights as they come
    (``verl/trainer/ppo/core_algos.py``: ``pg_losses * rollout_is_weights``): unbounded wherever the 8-bit
    rollout and the trainer disagree."""
    loss_mode = select(cfg, LOSS_MODE_KEY)
    if loss_mode in {m.value for m in LossMode} or select(cfg, f"{_RC}.rollout_is") is None:
        return None
    threshold = select(cfg, f"{_RC}.rollout_is_threshold")
    if not _untruncated_threshold(threshold):
        return None
    return (
        f"{LOSS_MODE_KEY}={show(loss_mode)} with {_RC}.rollout_is_threshold={float(threshold):g}: nothing truncates the "
        f"importance weight pi_prox/pi_behav, which verl's {show(loss_mode)} loss multiplies into every token's loss "
        "(the quantized presets leave it untruncated for the qurl losses, which truncate it at their own C). "
        f"Keep the preset's loss (remove the {LOSS_MODE_KEY} override: qurl_acr, or qurl_tis), or truncate in verl: "
        f"{_RC}.rollout_is_threshold={DEFAULT_IS_CAP} (verl's token-level TIS)"
    )

