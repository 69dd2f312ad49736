"""The pure ACR / TIS math (qurl_verl.losses.acr) against independent float64 references and verl's vanilla loss."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from qurl_verl.losses.acr import AcrStats, acr_token_loss, log_weight_from_is_weights

EPS_LOW, EPS_HIGH, DUAL_C, C = 0.2, 0.28, 3.0, 2.0


def make_batch(batch=16, length=48, *, log_w_scale=0.3, log_ratio_scale=0.3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 5
    logp = old + torch.randn(batch, length, generator=g, dtype=torch.float64) * log_ratio_scale
    log_w = torch.randn(batch, length, generator=g, dtype=torch.float64) * log_w_scale
    adv = torch.randn(batch, 1, generator=g, dtype=torch.float64).expand(batch, length).clone()
    adv[0] = 0.0  # a zero-advantage row
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return SimpleNamespace(
        logp=logp.to(dtype), old=old.to(dtype), log_w=log_w.to(dtype), adv=adv.to(dtype), mask=mask
    )


def reference_objective(logp, old, log_w, adv, *, cap, eps_low, eps_high, dual_c, adaptive, upper_cap=None):
    """Eq. 9 / Eq. 5 written as the objective to maximise, in float64, from the paper's symbols."""
    logp, old, log_w, adv = (t.double() for t in (logp, old, log_w, adv))
    w = torch.exp(log_w)
    r = torch.clamp(cap / w, max=1.0)                        # Eq. 7: r = pi_behav / pi_behav^trunc
    big_r = torch.exp(torch.clamp(logp - old, -20.0, 20.0))  # ratio to the proximal policy
    upper = (1.0 + eps_high) / r if adaptive else torch.full_like(w, 1.0 + eps_high)
    if upper_cap is not None:
        upper = torch.clamp(upper, max=upper_cap)
    clipped = torch.maximum(torch.minimum(big_r, upper), torch.full_like(w, 1.0 - eps_low))
    surrogate = torch.minimum(big_r * adv, clipped * adv)
    surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_c * adv), surrogate)  # dual clip
    return torch.minimum(w, torch.full_like(w, cap)) * surrogate


def run(b, *, adaptive=True, cap=C, upper_cap=None, with_stats=True):
    logp = b.logp.clone().requires_grad_(True)
    loss_mat, stats = acr_token_loss(
        logp, b.old, b.log_w, b.adv, b.mask,
        is_cap=cap, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=DUAL_C,
        adaptive=adaptive, upper_bound_cap=upper_cap, with_stats=with_stats,
    )
    return logp, loss_mat, stats


def masked_sum(x, mask):
    return torch.where(mask, x, torch.zeros_like(x)).sum()


@pytest.mark.parametrize("adaptive, upper_cap", [(True, None), (False, None), (True, 3.0)])
def test_loss_and_grad_match_float64_reference_with_extreme_ratios(adaptive, upper_cap):
    # log w up to ~11.5 (w ~ 1e5) and PPO log-ratios past the +-20 clamp
    b = make_batch(32, 64, log_w_scale=4.0, log_ratio_scale=3.0, seed=1)
    b.log_w[1, :5] = torch.tensor([math.log(1e5), math.log(1e5) - 0.5, 8.0, -11.0, 0.69])
    b.logp[1, :5] = b.old[1, :5] + torch.tensor([2.5, 25.0, -25.0, 1.0, 0.3])
    b.adv[1] = 1.0
    logp, loss_mat, _ = run(b, adaptive=adaptive, upper_cap=upper_cap)
    masked_sum(loss_mat, b.mask).backward()

    ref_logp = b.logp.double().clone().requires_grad_(True)
    ref = -reference_objective(
        ref_logp, b.old, b.log_w, b.adv, cap=C, eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_c=DUAL_C,
        adaptive=adaptive, upper_cap=upper_cap,
    )
    masked_sum(ref, b.mask).backward()

    torch.testing.assert_close(torch.where(b.mask, loss_mat, 0).double(), torch.where(b.mask, ref, 0).detach(), rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(logp.grad.double(), ref_logp.grad, rtol=2e-5, atol=1e-5)
    # the test exercised what it claims: widened bounds that bind differently from TIS
    w_above_c = (b.log_w > math.log(C)) & b.mask
    assert w_above_c.sum() > 50


def test_no_nan_or_inf_for_log_ratios_of_50():
    b = make_batch(8, 32, seed=2)
    signs = torch.tensor([1.0, -1.0])[torch.randint(0, 2, b.log_w.shape)]
    b.log_w = 50.0 * signs
    b.logp = b.old + 50.0 * signs.flip(0)
    b.adv[:4] = 3.0
    b.adv[4:] = -3.0
    for adaptive in (True, False):
        logp, loss_mat, stats = run(b, adaptive=adaptive)
        masked_sum(loss_mat, b.mask).backward()
        assert torch.isfinite(loss_mat).all()
        assert torch.isfinite(logp.grad).all()
        assert torch.isfinite(stats.values).all()


def test_where_w_within_c_acr_equals_verl_vanilla_with_tis_weights():
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.workers.config import ActorConfig

    b = make_batch(16, 40, log_w_scale=0.3, log_ratio_scale=0.4, seed=3)
    b.log_w = torch.clamp(b.log_w, max=math.log(C) - 1e-3)  # w <= C everywhere
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                      clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=DUAL_C)

    logp, loss_mat, stats = run(b, adaptive=True)
    ours = masked_sum(loss_mat, b.mask) / b.mask.sum()
    ours.backward()

    v_logp = b.logp.clone().requires_grad_(True)
    weights = torch.clamp(torch.exp(b.log_w), max=C) * b.mask
    vanilla, vanilla_metrics = compute_policy_loss_vanilla(
        b.old, v_logp, b.adv, b.mask, "token-mean", config=cfg, rollout_is_weights=weights
    )
    vanilla.backward()

    torch.testing.assert_close(ours, vanilla, rtol=5e-6, atol=0)
    torch.testing.assert_close(logp.grad, v_logp.grad, rtol=5e-6, atol=1e-9)
    s = stats.as_dict()
    assert s["clipfrac_upper"] + s["clipfrac_lower"] == pytest.approx(vanilla_metrics["actor/pg_clipfrac"], abs=1e-6)
    assert s["clipfrac_dual"] == pytest.approx(vanilla_metrics["actor/pg_clipfrac_lower"], abs=1e-6)
    assert s["ppo_kl"] == pytest.approx(vanilla_metrics["actor/ppo_kl"], rel=1e-5, abs=1e-7)
    assert s["clipfrac_upper"] > 0 and s["clipfrac_lower"] > 0  # clipping really happened


def test_tis_equals_verl_vanilla_with_truncated_weights_everywhere():
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.workers.config import ActorConfig

    b = make_batch(16, 40, log_w_scale=2.0, log_ratio_scale=0.5, seed=4)
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                      clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=DUAL_C)
    logp, loss_mat, _ = run(b, adaptive=False)
    ours = masked_sum(loss_mat, b.mask) / b.mask.sum()
    ours.backward()
    v_logp = b.logp.clone().requires_grad_(True)
    weights = torch.clamp(torch.exp(b.log_w), max=C) * b.mask
    vanilla, _ = compute_policy_loss_vanilla(b.old, v_logp, b.adv, b.mask, "token-mean", config=cfg, rollout_is_weights=weights)
    vanilla.backward()
    torch.testing.assert_close(ours, vanilla, rtol=5e-6, atol=0)
    torch.testing.assert_close(logp.grad, v_logp.grad, rtol=5e-6, atol=1e-9)


def test_eq8_tis_is_ppo_on_truncated_behaviour_with_shrunk_range_and_acr_restores_upper():
    """Eq. 8: min(w,C) clip(R, 1-e, 1+e) = w * clip(rR, r(1-e), r(1+e)); ACR keeps the upper at 1+e."""
    b = make_batch(32, 32, log_w_scale=2.0, log_ratio_scale=0.6, seed=5)
    b.adv = b.adv.abs() + 0.1  # A > 0: no dual clip, the upper bound is what matters
    w = torch.exp(b.log_w.double())
    r = torch.clamp(C / w, max=1.0)
    big_r = torch.exp(b.logp.double() - b.old.double())
    a = b.adv.double()

    def clip(x, lo, hi):
        return torch.maximum(torch.minimum(x, hi), lo)

    tis_absorbed = w * torch.minimum(r * big_r * a, clip(r * big_r, r * (1 - EPS_LOW), r * (1 + EPS_HIGH)) * a)
    acr_absorbed = w * torch.minimum(r * big_r * a, clip(r * big_r, r * (1 - EPS_LOW), torch.full_like(r, 1 + EPS_HIGH)) * a)

    _, tis_mat, _ = run(b, adaptive=False)
    _, acr_mat, _ = run(b, adaptive=True)
    torch.testing.assert_close(-tis_mat.detach().double(), tis_absorbed, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(-acr_mat.detach().double(), acr_absorbed, rtol=1e-5, atol=1e-6)

    # ACR differs from TIS exactly on the tokens where w > C and the TIS upper bound binds
    differs = (tis_mat - acr_mat).abs() > 1e-6
    expected = (w > C) & (big_r > 1 + EPS_HIGH)
    assert torch.equal(differs, expected)
    assert expected.sum() > 20
    within = w <= C
    assert torch.equal(tis_mat[within], acr_mat[within])


def test_negative_advantages_are_untouched_by_acr_and_dual_clipped():
    b = make_batch(16, 32, log_w_scale=3.0, log_ratio_scale=1.5, seed=6)
    b.adv = -(b.adv.abs() + 0.1)
    _, tis_mat, _ = run(b, adaptive=False)
    _, acr_mat, stats = run(b, adaptive=True)
    assert torch.equal(tis_mat, acr_mat)
    big_r = torch.exp(b.logp - b.old)
    capped = (big_r > DUAL_C) & b.mask
    assert capped.any()
    w_tis = torch.clamp(torch.exp(b.log_w), max=C)
    torch.testing.assert_close(acr_mat[capped], (-b.adv * DUAL_C * w_tis)[capped], rtol=1e-5, atol=0)
    assert stats.as_dict()["clipfrac_dual"] == pytest.approx((capped.sum() / b.mask.sum()).item(), abs=1e-7)


def test_stats_match_float64_reference():
    b = make_batch(24, 40, log_w_scale=2.5, log_ratio_scale=0.7, seed=7)
    _, _, stats = run(b, adaptive=True)
    s = stats.as_dict()
    assert set(s) == set(AcrStats.names())

    m = b.mask
    log_w = b.log_w.double()[m]
    w = torch.exp(log_w)
    big_r = torch.exp(b.logp.double() - b.old.double())[m]
    a = b.adv.double()[m]
    upper = (1 + EPS_HIGH) / torch.clamp(C / w, max=1.0)
    expected = {
        "kl_behav_prox_k1": (-log_w).mean(),
        "kl_behav_prox_k3": (w - 1 - log_w).mean(),
        "w_max": w.max(),
        "w_frac_above_c": (w > C).double().mean(),
        "w_truncated_ess": truncated_ess_reference(w, C),
        "upper_bound_mean": upper.mean(),
        "upper_bound_max": upper.max(),
        "clipfrac_upper": ((a > 0) & (big_r > upper)).double().mean(),
        "clipfrac_lower": ((a < 0) & (big_r < 1 - EPS_LOW)).double().mean(),
        "clipfrac_dual": ((a < 0) & (big_r > DUAL_C)).double().mean(),
        "ppo_kl": (b.old.double() - b.logp.double())[m].mean(),
    }
    for k, v in expected.items():
        assert s[k] == pytest.approx(v.item(), rel=1e-5, abs=1e-6), k
    assert s["clipfrac_upper"] > 0 and s["w_frac_above_c"] > 0


def truncated_ess_reference(w: torch.Tensor, cap: float) -> torch.Tensor:
    """verl's rollout_is_eff_sample_size, 1 / mean((w / mean w)^2), of min(w, C), in float64."""
    truncated = torch.clamp(w.double(), max=cap)
    return 1.0 / (truncated / truncated.mean()).square().mean()


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("log_w_scale, seed", [(0.05, 11), (1.0, 12), (4.0, 13)])
def test_truncated_weight_stats_match_a_direct_float64_formula(adaptive, log_w_scale, seed):
    """Both losses truncate at C, so both report the fraction truncated and the ESS of min(w, C)."""
    b = make_batch(20, 36, log_w_scale=log_w_scale, seed=seed)
    b.log_w[~b.mask] = 30.0  # padding must not count, however large
    s = run(b, adaptive=adaptive)[2].as_dict()
    w = torch.exp(b.log_w.double()[b.mask])
    truncated = torch.clamp(w, max=C)
    direct = truncated.sum().square() / (truncated.numel() * truncated.square().sum())
    assert s["w_truncated_ess"] == pytest.approx(direct.item(), rel=1e-9)
    assert s["w_truncated_ess"] == pytest.approx(truncated_ess_reference(w, C).item(), rel=1e-9)
    assert s["w_frac_above_c"] == pytest.approx((w > C).double().mean().item(), rel=1e-12)
    assert 0.0 < s["w_truncated_ess"] <= 1.0


def test_truncated_ess_is_one_for_equal_weights_and_without_tokens():
    b = make_batch(4, 8, seed=14)
    b.log_w = torch.full_like(b.log_w, 3.0)  # every w = e^3 > C: all truncated to C, all equal
    s = run(b, adaptive=True)[2].as_dict()
    assert s["w_truncated_ess"] == pytest.approx(1.0, rel=1e-12) and s["w_frac_above_c"] == 1.0
    b.mask = torch.zeros_like(b.mask)
    assert run(b, adaptive=True)[2].as_dict()["w_truncated_ess"] == 1.0


def test_upper_cap_limits_the_widened_bound():
    b = make_batch(8, 32, log_w_scale=4.0, seed=8)
    _, _, stats = run(b, adaptive=True, upper_cap=5.0)
    assert stats.as_dict()["upper_bound_max"] == pytest.approx(5.0, rel=1e-6)
    _, _, uncapped = run(b, adaptive=True)
    assert uncapped.as_dict()["upper_bound_max"] > 100


def test_log_weight_recovery_from_verl_weights():
    g = torch.Generator().manual_seed(9)
    log_ratio = torch.randn(6, 20, generator=g) * 8
    mask = torch.rand(6, 20, generator=g) > 0.3
    # exactly how verl builds token-level weights (rollout_corr_helper, threshold above e^20)
    w = torch.exp(torch.clamp(log_ratio, -20, 20)) * mask
    log_w = log_weight_from_is_weights(w, mask)
    torch.testing.assert_close(log_w[mask], torch.clamp(log_ratio, -20, 20)[mask], rtol=0, atol=2e-6)
    assert (log_w[~mask] == 0).all()

    w_zeroed = w.clone()
    w_zeroed[mask.nonzero()[0].tolist()] = 0.0  # what an IcePop band does to an out-of-band token
    with pytest.raises(ValueError, match="non-positive"):
        log_weight_from_is_weights(w_zeroed, mask)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_on_response_tokens_raise_with_their_count(bad):
    """NaN passes `amin() <= 0` (NaN compares False), so it needs its own check; outside the mask it is ignored."""
    mask = torch.tensor([[True, True, True, False]])
    w = torch.tensor([[1.0, bad, bad, bad]])
    with pytest.raises(ValueError, match=r"2 non-finite value\(s\) on response tokens \(of 3\)"):
        log_weight_from_is_weights(w, mask)
    w[0, 1:3] = 0.5
    assert torch.isfinite(log_weight_from_is_weights(w, mask)).all()


@pytest.mark.parametrize("kwargs, match", [
    ({"is_cap": 0.0}, "is_cap"), ({"clip_ratio_c": 1.0}, "clip_ratio_c"), ({"upper_bound_cap": 1.1}, "upper_bound_cap")])
def test_bad_constants_are_refused(kwargs, match):
    b = make_batch(2, 4)
    args = dict(is_cap=C, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=DUAL_C) | kwargs
    with pytest.raises(ValueError, match=match):
        acr_token_loss(b.logp, b.old, b.log_w, b.adv, b.mask, **args)


def test_bf16_log_probs_next_to_fp32_weights():
    """verl's FSDP engine hands bf16 log-probs while the IS weights are fp32: loss and stats must run."""
    b = make_batch(8, 32, log_w_scale=1.5, seed=3)
    logp = b.logp.to(torch.bfloat16).requires_grad_(True)
    loss_mat, stats = acr_token_loss(
        logp, b.old.to(torch.bfloat16), b.log_w, b.adv, b.mask,
        is_cap=C, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=DUAL_C,
    )
    masked_sum(loss_mat, b.mask).backward()
    assert torch.isfinite(logp.grad).all()
    ref = reference_objective(logp.detach(), b.old.to(torch.bfloat16), b.log_w, b.adv,
                              cap=C, eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_c=DUAL_C, adaptive=True)
    assert masked_sum(loss_mat.double(), b.mask).item() == pytest.approx(-masked_sum(ref, b.mask).item(), rel=2e-2)
    assert all(math.isfinite(v) for v in stats.as_dict().values())
