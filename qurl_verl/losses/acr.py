"""Adaptive Clipping Range (ACR, QuRL Eq. 9) and token-level TIS (Eq. 5), per token, in pure torch.

Three log-probs per response token (decoupled PPO, Eq. 4):
    log_prob      log pi_theta        (current actor, carries the gradient)
    old_log_prob  log pi_prox         (full-precision old actor, recomputed by the trainer)
    log_w         log(pi_prox / pi_behav), pi_behav = the quantized engine that sampled the token

With w = pi_prox / pi_behav, R = pi_theta / pi_prox and r = min(1, C / w) (Eq. 7), the per-token
objective is

    min(w, C) * min(R * A, clip(R, 1 - eps_low, (1 + eps_high) / r) * A)          (Eq. 9)

Only the upper bound adapts: TIS multiplies the clipped term by min(w, C) = w * r, which
silently shrinks the clip range by r (Eq. 8); dividing the upper bound by r restores a fixed
upper bound on the ratio to the truncated behaviour policy. Where w <= C, r = 1 and ACR is TIS.
With `adaptive=False` the same code is TIS (FlashRL's correction, verl's FP8-rollout baseline).

verl's dual clip for A < 0 (loss capped at -A * clip_ratio_c) is kept unchanged. For A < 0 the
upper bound never binds (max(-A R, -A clip(R)) = -A max(R, 1 - eps_low)), so ACR changes nothing
there: negative-advantage tokens are treated exactly as in TIS.

The result is the per-token loss matrix; aggregation (token-mean, seq-mean-...) is left to the
caller so that the trainer's own normalisation across micro-batches and ranks applies. This
module never imports verl.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# verl clamps the PPO log-ratio to +-20 before exp (core_algos.compute_policy_loss_vanilla) and
# the rollout IS log-ratio to +-20 (rollout_corr_helper.SAFETY_BOUND). The same bound keeps every
# exp() here finite: a clip bound above e^20 can never bind because R <= e^20.
LOG_RATIO_BOUND = 20.0

# Order of the scalars in `AcrStats.values`; `metric_names` gives the logged names.
_STAT_NAMES = (
    "kl_behav_prox_k1",
    "kl_behav_prox_k3",
    "w_max",
    "w_frac_above_c",
    "upper_bound_mean",
    "upper_bound_max",
    "clipfrac_upper",
    "clipfrac_lower",
    "clipfrac_dual",
    "ppo_kl",
)


@dataclass(frozen=True)
class AcrStats:
    """Per-call diagnostics over the masked tokens, as one tensor so one host sync reads them all.

    kl_behav_prox_k1/k3  KL(pi_behav || pi_prox): k1 = E[-log w], k3 = E[w - 1 - log w]
                         (samples come from pi_behav, so these are unbiased estimators)
    w_max                largest w = pi_prox / pi_behav in this call
    w_frac_above_c       fraction of tokens with w > C (where ACR widens the upper bound)
    upper_bound_mean/max the upper clip bound (1 + eps_high) / r actually applied
    clipfrac_upper       A > 0 and R above the upper bound (gradient stopped)
    clipfrac_lower       A < 0 and R below 1 - eps_low (gradient stopped)
    clipfrac_dual        A < 0 and R above clip_ratio_c (dual clip active)
    ppo_kl               E[log pi_prox - log pi_theta], from the clamped log-ratio as verl does
    """

    values: torch.Tensor  # shape [len(_STAT_NAMES)], float64, detached

    @staticmethod
    def names() -> tuple[str, ...]:
        return _STAT_NAMES

    def as_dict(self) -> dict[str, float]:
        return dict(zip(_STAT_NAMES, self.values.tolist()))


def log_weight_from_is_weights(rollout_is_weights: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Recover log(pi_prox / pi_behav) from verl's token-level IS weights (0 outside the mask).

    verl sends w = exp(clamp(old_log_probs - rollout_log_probs, +-20)) * response_mask. A masked
    token with w <= 0 means something zeroed it (IcePop band, rejection, batch normalisation
    gone wrong); ACR would silently treat it as w = tiny, so refuse instead.
    """
    mask = response_mask.bool()
    w = rollout_is_weights.detach()
    if bool(((w <= 0) & mask).any()):
        raise ValueError(
            "rollout_is_weights has non-positive values on response tokens: the qurl losses need "
            "untruncated token-level weights pi_prox/pi_behav (no IcePop 'lo_hi' threshold, no "
            "rejection sampling, no batch normalisation in algorithm.rollout_correction)."
        )
    return torch.where(mask, torch.log(w.clamp_min(torch.finfo(w.dtype).tiny)), torch.zeros_like(w))


def acr_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_w: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    is_cap: float,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    adaptive: bool = True,
    upper_bound_cap: Optional[float] = None,
    with_stats: bool = True,
) -> tuple[torch.Tensor, Optional[AcrStats]]:
    """Per-token ACR (adaptive=True, Eq. 9) or TIS (adaptive=False, Eq. 5) loss, to be minimised.

    Args:
        log_prob: log pi_theta, [B, T], requires grad.
        old_log_prob: log pi_prox, [B, T] (treated as a constant).
        log_w: log(pi_prox / pi_behav), [B, T] (treated as a constant; any finite value).
        advantages: [B, T].
        response_mask: [B, T], bool or 0/1.
        is_cap: C, the truncation of the outer importance weight min(w, C); > 0.
        clip_ratio_low / clip_ratio_high: eps_low / eps_high (DAPO clip-higher form).
        clip_ratio_c: verl's dual-clip constant for A < 0; > 1.
        adaptive: widen the upper bound to (1 + eps_high) / r (ACR); False gives plain TIS.
        upper_bound_cap: optional ceiling on the widened upper bound (None = the paper: no cap).
        with_stats: also compute the diagnostics (costs a few reductions).

    Returns:
        (loss_mat [B, T] with gradient through log_prob only, AcrStats or None). Entries outside
        the mask are finite but meaningless; aggregate with the mask.
    """
    if is_cap <= 0:
        raise ValueError(f"is_cap (C) must be > 0, got {is_cap}")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")

    log_w = log_w.detach()
    log_c = math.log(is_cap)
    # -log r = max(0, log w - log C): how far w exceeds C, in log space (no overflow for any w).
    log_excess = torch.clamp(log_w - log_c, min=0.0)
    is_weight = torch.exp(log_w - log_excess)  # min(w, C), computed without forming w

    log_ratio = torch.clamp(log_prob - old_log_prob.detach(), min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)

    lower = 1.0 - clip_ratio_low
    if adaptive:
        log_upper = math.log1p(clip_ratio_high) + log_excess  # log((1 + eps_high) / r)
        if upper_bound_cap is not None:
            log_upper = torch.clamp(log_upper, max=math.log(upper_bound_cap))
        upper = torch.exp(torch.clamp(log_upper, max=LOG_RATIO_BOUND))
        clipped_ratio = torch.minimum(torch.clamp(ratio, min=lower), upper)
    else:
        upper = 1.0 + clip_ratio_high
        clipped_ratio = torch.clamp(ratio, min=lower, max=upper)

    # Same expression tree as verl's vanilla PPO loss, so TIS matches it bit for bit.
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * clipped_ratio
    ppo_loss = torch.maximum(unclipped_loss, clipped_loss)
    dual_clip_loss = torch.minimum(-advantages * clip_ratio_c, ppo_loss)
    loss_mat = torch.where(advantages < 0, dual_clip_loss, ppo_loss) * is_weight

    stats = None
    if with_stats:
        with torch.no_grad():
            stats = _token_stats(
                log_w, log_c, log_ratio, ratio, upper, advantages, response_mask, lower, clip_ratio_c
            )
    return loss_mat, stats


def _token_stats(log_w, log_c, log_ratio, ratio, upper, advantages, response_mask, lower, clip_ratio_c) -> AcrStats:
    mask = response_mask.bool()
    maskf = mask.to(log_w.dtype)
    count = maskf.sum().clamp_min(1.0)
    positive = (advantages > 0) & mask
    negative = (advantages < 0) & mask

    log_w_safe = torch.clamp(log_w, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    neg_inf = torch.tensor(float("-inf"), dtype=log_w.dtype, device=log_w.device)
    log_w_max = torch.where(mask, log_w, neg_inf).amax()
    if isinstance(upper, torch.Tensor):
        upper_sum = (upper * maskf).sum()
        upper_max = torch.where(mask, upper, neg_inf).amax()
        above_upper = ratio > upper
    else:
        upper_sum = count * upper
        upper_max = torch.full_like(count, upper)
        above_upper = ratio > upper

    sums = torch.stack(
        [
            (-log_w * maskf).sum(),
            ((torch.expm1(log_w_safe) - log_w_safe) * maskf).sum(),
            ((log_w > log_c) & mask).sum().to(count.dtype),
            upper_sum,
            (above_upper & positive).sum().to(count.dtype),
            ((ratio < lower) & negative).sum().to(count.dtype),
            ((ratio > clip_ratio_c) & negative).sum().to(count.dtype),
            (-log_ratio * maskf).sum(),
        ]
    ).double() / count.double()
    k1, k3, frac_c, upper_mean, cf_up, cf_low, cf_dual, ppo_kl = sums.unbind()
    values = torch.stack(
        [k1, k3, torch.exp(log_w_max.double()), frac_c, upper_mean, upper_max.double(), cf_up, cf_low, cf_dual, ppo_kl]
    )
    return AcrStats(values=values)
