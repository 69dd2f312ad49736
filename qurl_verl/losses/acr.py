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

import torch

# verl clamps the PPO log-ratio to +-20 before exp (core_algos.compute_policy_loss_vanilla) and
# the rollout IS log-ratio to +-20 (rollout_corr_helper.SAFETY_BOUND). The same bound keeps every
# exp() here finite: a clip bound above e^20 can never bind because R <= e^20.
LOG_RATIO_BOUND = 20.0

# Order of the scalars in `AcrStats.values` (and their logged names, under actor/qurl/).
_STAT_NAMES = (
    "kl_behav_prox_k1",
    "kl_behav_prox_k3",
    "w_max",
    "w_frac_above_c",
    "w_truncated_ess",
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
    w_max                largest w = pi_prox / pi_behav among this call's tokens. Logged, verl
                         reduces it as every policy-loss metric: the mean over micro-batches and
                         data-parallel ranks of a mini-batch (verl forces a mean there), then the
                         max over mini-batches (its reduce_metrics takes np.max for a key holding
                         "max"). So at most the batch maximum, verl's rollout_corr/rollout_is_max
    w_frac_above_c       fraction of tokens with w > C: the tokens whose weight min(w, C) the loss
                         truncates (both losses) and where ACR widens the upper bound. verl's
                         rollout_is_ratio_fraction_high at threshold C; the presets set verl's
                         threshold to 1e9, so verl's own reads 0
    w_truncated_ess      effective sample size of the weights the loss applies, min(w, C):
                         (sum w)^2 / (n sum w^2) over the n masked tokens, in (0, 1]; verl's
                         rollout_is_eff_sample_size at threshold C (1 with no tokens)
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
    w_or_one = torch.where(mask, rollout_is_weights.detach(), 1.0)  # log(1) = 0 outside the mask
    non_finite = int((~torch.isfinite(w_or_one)).sum())  # amin() would carry a NaN past the check below
    if non_finite:
        raise ValueError(
            f"rollout_is_weights has {non_finite} non-finite value(s) on response tokens (of {int(mask.sum())}): "
            "the trainer's or the engine's log-probs were NaN/inf, so pi_prox/pi_behav is undefined"
        )
    if bool(w_or_one.amin() <= 0):
        raise ValueError(
            "rollout_is_weights has non-positive values on response tokens: the qurl losses need "
            "untruncated token-level weights pi_prox/pi_behav (no IcePop 'lo_hi' threshold, no "
            "rejection sampling, no batch normalisation in algorithm.rollout_correction)."
        )
    return torch.log(w_or_one)


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
    upper_bound_cap: float | None = None,
    with_stats: bool = True,
) -> tuple[torch.Tensor, AcrStats | None]:
    """Per-token ACR (adaptive=True, Eq. 9) or TIS (adaptive=False, Eq. 5) loss, to be minimised.

    Args:
        log_prob: log pi_theta, [B, T], requires grad.
        old_log_prob: log pi_prox, [B, T] (treated as a constant).
        log_w: log(pi_prox / pi_behav), [B, T] (treated as a constant; any magnitude).
        advantages: [B, T].
        response_mask: [B, T], bool or 0/1.
        is_cap: C, the truncation of the outer importance weight min(w, C); > 0.
        clip_ratio_low / clip_ratio_high: eps_low / eps_high (DAPO clip-higher form).
        clip_ratio_c: verl's dual-clip constant for A < 0; > 1.
        adaptive: widen the upper bound to (1 + eps_high) / r (ACR); False gives plain TIS.
        upper_bound_cap: optional ceiling on the widened upper bound (None = the paper: no cap).
        with_stats: also compute the diagnostics (about 20 extra elementwise passes).

    Returns:
        (loss_mat [B, T] with gradient through log_prob only, AcrStats or None). Entries outside
        the mask are finite but meaningless; aggregate with the mask.
    """
    if is_cap <= 0:
        raise ValueError(f"is_cap (C) must be > 0, got {is_cap}")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    if upper_bound_cap is not None and upper_bound_cap < 1.0 + clip_ratio_high:
        raise ValueError(f"upper_bound_cap must be >= 1 + clip_ratio_high = {1.0 + clip_ratio_high}, got {upper_bound_cap}")

    log_w = log_w.detach()
    log_c = math.log(is_cap)
    is_weight = torch.exp(torch.clamp(log_w, max=log_c))  # min(w, C), without forming w (no overflow)

    log_ratio = torch.clamp(log_prob - old_log_prob.detach(), min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)

    lower = 1.0 - clip_ratio_low
    if adaptive:
        upper = torch.exp(_log_upper_bound(log_w, log_c, clip_ratio_high, upper_bound_cap))
        clipped_ratio = torch.clamp(ratio, min=ratio.new_tensor(lower), max=upper)
    else:
        upper = 1.0 + clip_ratio_high
        clipped_ratio = torch.clamp(ratio, min=lower, max=upper)

    # verl's vanilla PPO expression (pg_losses1/2/3), so the clipping decisions match it exactly.
    neg_adv = -advantages
    unclipped_loss = neg_adv * ratio
    clipped_loss = neg_adv * clipped_ratio
    ppo_loss = torch.maximum(unclipped_loss, clipped_loss)
    dual_clip_loss = torch.minimum(neg_adv * clip_ratio_c, ppo_loss)
    loss_mat = torch.where(advantages < 0, dual_clip_loss, ppo_loss) * is_weight

    stats = None
    if with_stats:
        with torch.no_grad():
            upper_of = (lambda lw: _log_upper_bound(lw, log_c, clip_ratio_high, upper_bound_cap).exp()) if adaptive else None
            stats = _token_stats(log_w, log_c, log_ratio, ratio, upper, upper_of, advantages, response_mask, lower, clip_ratio_c)
    return loss_mat, stats


def _log_upper_bound(log_w: torch.Tensor, log_c: float, clip_ratio_high: float, upper_bound_cap: float | None) -> torch.Tensor:
    """log((1 + eps_high) / r) = log(1 + eps_high) + max(0, log w - log C), in one clamp.

    Optionally capped, and clamped at e^20, above which it cannot bind (R <= e^20).
    """
    base = math.log1p(clip_ratio_high)
    top = LOG_RATIO_BOUND if upper_bound_cap is None else min(LOG_RATIO_BOUND, math.log(upper_bound_cap))
    return torch.clamp(log_w + (base - log_c), min=base, max=max(top, base))


def _token_stats(log_w, log_c, log_ratio, ratio, upper, upper_of, advantages, response_mask, lower, clip_ratio_c) -> AcrStats:
    """The AcrStats values, with as few passes over the [B, T] tensors as is readable."""
    mask = response_mask.bool()
    # the trainer may hand bf16 log-probs next to fp32 weights: reduce in fp32 whatever comes in
    maskf = mask.to(torch.float32).reshape(-1)
    count = maskf.sum().clamp_min(1.0)
    log_w_in = torch.where(mask, log_w, 0.0)  # masked-out tokens count as w = 1: no KL, not above C >= 1
    adv_in = torch.where(mask, advantages, 0.0)
    positive, negative = adv_in > 0, adv_in < 0
    above_c = log_w_in > log_c
    if log_c < 0:  # C < 1: w = 1 would count as above C
        above_c &= mask

    log_w_safe = torch.clamp(log_w_in, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    truncated_ess = _truncated_ess(log_w_safe, log_c, mask)
    log_w_max = torch.where(mask, log_w, float("-inf")).amax()
    if upper_of is None:  # TIS: one constant bound
        upper_sum = count * upper
        upper_max = torch.full_like(count, upper)
    else:  # the bound grows with w, so its maximum sits at the largest w
        upper_sum = torch.dot(upper.reshape(-1).float(), maskf)
        upper_max = upper_of(log_w_max)

    def n(condition: torch.Tensor) -> torch.Tensor:
        return torch.count_nonzero(condition).to(count.dtype)

    sums = torch.stack(
        [
            -log_w_in.sum(),
            (torch.expm1(log_w_safe) - log_w_safe).sum(),
            n(above_c),
            upper_sum,
            n((ratio > upper) & positive),
            n((ratio < lower) & negative),
            n((ratio > clip_ratio_c) & negative),
            -torch.dot(log_ratio.detach().reshape(-1).float(), maskf),
        ]
    ).double() / count.double()
    k1, k3, frac_c, upper_mean, cf_up, cf_low, cf_dual, ppo_kl = sums.unbind()
    values = torch.stack(
        [k1, k3, torch.exp(log_w_max.double()), frac_c, truncated_ess, upper_mean, upper_max.double(), cf_up, cf_low, cf_dual, ppo_kl]
    )
    return AcrStats(values=values)


def _truncated_ess(log_w: torch.Tensor, log_c: float, mask: torch.Tensor) -> torch.Tensor:
    """ESS of the truncated weights min(w, C) over the masked tokens, (sum w)^2 / (n sum w^2), float64.

    Normalised as verl's rollout_is_eff_sample_size, 1 / mean((w / mean w)^2) over the valid tokens
    (verl/trainer/ppo/rollout_corr_helper.py:753-759 in verl 0.9.1, which adds 1e-8 to the mean),
    but over the weights the loss applies: verl's are truncated at its own threshold, 1e9 in the
    presets. log_w is already clamped at +-20, as verl clamps (so w > 0 and sum w^2 > 0 for n > 0).
    """
    maskd = mask.to(torch.float64)
    weight = torch.exp(torch.clamp(log_w.double(), max=log_c)) * maskd
    n = maskd.sum()
    total, total_sq = weight.sum(), weight.square().sum()
    return torch.where(n > 0, total.square() / (n * total_sq).clamp_min(torch.finfo(torch.float64).tiny), 1.0)
