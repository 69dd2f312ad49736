"""verl glue for the qurl losses: `loss_mode=qurl_acr` (Eq. 9) and `loss_mode=qurl_tis` (Eq. 5).

Each loss is registered where it is defined, with verl's own decorator; importing this module
(the plugin does) is what registers them.

verl's `ppo_loss` calls a registered policy loss with keyword arguments only and hands it the
driver-computed `rollout_is_weights` = pi_prox / pi_behav (token level; the driver checks
the settings that make verl send them, `qurl_verl.settings.LOSS_REQUIRED`). The numerics live in `qurl_verl.losses.acr`; this module reads the
settings, recovers log w, aggregates with verl's `agg_loss` (including the global batch
normalisation `ppo_loss` stores in `config.global_batch_info`) and formats the metrics.

Metric note: verl wraps a policy loss's metrics as mean-aggregated (`verl/workers/utils/losses.py`,
`Metric.from_dict(pg_metrics, aggregation=MEAN)`; a max-aggregated `Metric` returned here would be
refused as a mismatch), averages them over micro-batches and data-parallel ranks, and only then, over
mini-batches, takes np.max of a key holding "max" (`verl/utils/metric/utils.py`, `reduce_metrics`). So
`actor/qurl/w_max` and `actor/qurl/upper_bound_max` are the largest mini-batch mean of per-micro-batch
maxima. The batch-wide maximum of w is verl's own `rollout_corr/rollout_is_max`, computed in the driver.
"""
from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from qurl_verl.losses.acr import acr_token_loss, log_weight_from_is_weights

METRIC_PREFIX = "actor/qurl/"


def _policy_loss(
    adaptive: bool,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    name = "qurl_acr" if adaptive else "qurl_tis"
    if config is None:
        raise ValueError(f"loss_mode={name} needs the actor config (verl's ppo_loss passes it)")
    if rollout_is_weights is None:
        raise ValueError(
            f"loss_mode={name} got no rollout_is_weights. It needs pi_prox/pi_behav per token from verl's "
            "rollout correction: set algorithm.rollout_correction.rollout_is=token, "
            "algorithm.rollout_correction.rollout_is_threshold=1e9, algorithm.rollout_correction.bypass_mode=false "
            "and actor_rollout_ref.rollout.calculate_log_probs=true "
            "(the driver checks all of them)."
        )
    settings = config.policy_loss
    is_cap = settings.get("is_cap", None)
    if is_cap is None:
        raise ValueError(
            f"loss_mode={name}: actor.policy_loss has no is_cap; set "
            "actor_rollout_ref.actor.policy_loss._target_=qurl_verl.settings.loss_config.QurlPolicyLossConfig"
        )
    clip_ratio = config.clip_ratio
    clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio

    log_w = log_weight_from_is_weights(rollout_is_weights, response_mask)
    loss_mat, stats = acr_token_loss(
        log_prob,
        old_log_prob,
        log_w,
        advantages,
        response_mask,
        is_cap=float(is_cap),
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        clip_ratio_c=config.get("clip_ratio_c", 3.0),
        adaptive=adaptive,
        upper_bound_cap=settings.get("acr_upper_cap", None) if adaptive else None,
    )
    pg_loss = agg_loss(loss_mat, response_mask, loss_agg_mode, **config.get("global_batch_info", {}))

    values = stats.as_dict()
    metrics = {METRIC_PREFIX + k: v for k, v in values.items() if k != "ppo_kl"}
    # verl's standard keys, same meaning as in its vanilla loss, so existing dashboards still work.
    metrics["actor/pg_clipfrac"] = values["clipfrac_upper"] + values["clipfrac_lower"]
    metrics["actor/pg_clipfrac_lower"] = values["clipfrac_dual"]
    metrics["actor/ppo_kl"] = values["ppo_kl"]
    return pg_loss, metrics


@register_policy_loss("qurl_acr")
def qurl_acr_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """QuRL's Adaptive Clipping Range loss (Eq. 9), as verl's `loss_mode=qurl_acr`."""
    return _policy_loss(True, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)


@register_policy_loss("qurl_tis")
def qurl_tis_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO with token-level TIS min(w, C) (Eq. 5), as verl's `loss_mode=qurl_tis`: the ACR baseline."""
    return _policy_loss(False, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
