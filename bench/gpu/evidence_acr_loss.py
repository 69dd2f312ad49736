"""Step ``acr_loss`` of gpu_evidence.py: forward+backward of the ACR loss vs plain PPO losses."""
from __future__ import annotations

import statistics
import time

import torch
from evidence_run_control import Budget, Context

from qurl_verl.losses.acr import acr_token_loss, log_weight_from_is_weights

# ACR / PPO hyper-parameters of bench/bench_acr_loss.py.
IS_CAP, CLIP_LOW, CLIP_HIGH, CLIP_C = 2.0, 0.2, 0.28, 3.0
# ----------------------------------------------------------------------------- step 4: ACR loss


def ppo_clipped_token_mean(logp, old, adv, maskf, is_weight=None):
    """verl's vanilla PPO loss (dual clip for A < 0), optionally times the truncated IS weight, token-mean."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    loss = torch.where(adv < 0, torch.minimum(-adv * CLIP_C, loss), loss)
    if is_weight is not None:
        loss = loss * is_weight
    return (loss * maskf).sum() / maskf.sum()


def step_acr_loss(ctx: Context, budget: Budget, res: dict, flush) -> None:
    batch, length = (8, 256) if ctx.dry_run else (256, 8192)
    warm, reps = (1, 3) if ctx.dry_run else (3, 20)
    gen = torch.Generator(device=ctx.device).manual_seed(6)
    old = -torch.rand(batch, length, device=ctx.device, generator=gen) * 5
    logp0 = old + torch.randn(batch, length, device=ctx.device, generator=gen) * 0.2
    log_w_true = torch.randn(batch, length, device=ctx.device, generator=gen) * 0.5
    adv = torch.randn(batch, 1, device=ctx.device, generator=gen).expand(batch, length).contiguous()
    lengths = torch.randint(length // 4, length + 1, (batch,), device=ctx.device, generator=gen)
    mask = torch.arange(length, device=ctx.device)[None, :] < lengths[:, None]
    maskf = mask.float()
    w = torch.exp(log_w_true) * maskf  # what verl's rollout correction sends
    w_tis = torch.clamp(w, max=IS_CAP)

    def acr(logp, adaptive=True, with_stats=True):
        log_w = log_weight_from_is_weights(w, mask)
        loss_mat, _ = acr_token_loss(logp, old, log_w, adv, mask, is_cap=IS_CAP, clip_ratio_low=CLIP_LOW,
                                     clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C, adaptive=adaptive,
                                     with_stats=with_stats)
        return (loss_mat * maskf).sum() / maskf.sum()

    contenders = {
        "vanilla_ppo": lambda logp: ppo_clipped_token_mean(logp, old, adv, maskf),
        "vanilla_tis": lambda logp: ppo_clipped_token_mean(logp, old, adv, maskf, w_tis),
        "acr": acr,
        "acr_no_stats": lambda logp: acr(logp, with_stats=False),
    }
    tis_value = float(acr(logp0, adaptive=False))
    vanilla_tis_value = float(contenders["vanilla_tis"](logp0))
    res.update(
        shape=[batch, length],
        masked_tokens=int(mask.sum()),
        hyper_parameters=dict(is_cap=IS_CAP, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C),
        what=("forward+backward of one token-mean loss on fp32 [B, T] tensors, device-synchronised wall time, "
              "round-robin over contenders, median; acr includes log_weight_from_is_weights (one host sync) "
              "and the on-device diagnostics; vanilla_ppo is verl's vanilla loss in plain torch, "
              "vanilla_tis the same times min(w, C)"),
        qurl_tis_minus_vanilla_tis=abs(tis_value - vanilla_tis_value),
    )
    times: dict[str, list[float]] = {name: [] for name in contenders}
    peak: dict[str, int] = {}
    for rep in range(warm + reps):
        if budget.expired():
            break
        for name, fn in contenders.items():
            logp = logp0.clone().requires_grad_(True)
            if ctx.cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
            ctx.sync()
            start = time.perf_counter()
            fn(logp).backward()
            ctx.sync()
            if rep >= warm:
                times[name].append((time.perf_counter() - start) * 1e3)
            if ctx.cuda:
                peak[name] = torch.cuda.max_memory_allocated(ctx.device) - base
    med = {name: statistics.median(t) for name, t in times.items() if t}
    res.update(
        reps=min(len(t) for t in times.values()),
        median_ms=med,
        ratio_to_vanilla_ppo={k: v / med["vanilla_ppo"] for k, v in med.items()} if "vanilla_ppo" in med else {},
        ratio_to_vanilla_tis={k: v / med["vanilla_tis"] for k, v in med.items()} if "vanilla_tis" in med else {},
        peak_extra_bytes=peak or None,
    )
