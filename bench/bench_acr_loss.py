"""Forward + backward time of the registered qurl losses vs verl's vanilla PPO loss on one batch.

All contenders see the same [batch x length] tensors; runs are interleaved (round-robin) so load
drift on a shared machine hits them equally, and the median per contender is reported. Torch runs
on one thread so that, besides wall time, the thread's CPU time measures the work itself: on a
machine shared with other jobs, wall time mostly measures waiting for a core.
vanilla_tis is verl's vanilla loss fed min(w, C) as rollout_is_weights: the FP8-rollout TIS
baseline, i.e. the same work qurl_tis does. The target is qurl_acr <= 1.2x vanilla_tis.

    python bench/bench_acr_loss.py [--batch 256 --length 4096 --repeats 9]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import bench_harness
import torch
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
from verl.workers.config import ActorConfig

from qurl_verl.losses.acr import acr_token_loss, log_weight_from_is_weights
from qurl_verl.losses.config import QurlPolicyLossConfig
from qurl_verl.losses.verl_losses import qurl_acr_policy_loss, qurl_tis_policy_loss

C = 2.0


def make_inputs(batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g) * 5
    logp = old + torch.randn(batch, length, generator=g) * 0.2
    log_w = torch.randn(batch, length, generator=g) * 0.5
    adv = torch.randn(batch, 1, generator=g).expand(batch, length).contiguous()
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    w = torch.exp(log_w) * mask  # what verl's rollout correction sends
    return old, logp, adv, mask, w


def make_config(loss_mode: str) -> ActorConfig:
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        policy_loss=QurlPolicyLossConfig(loss_mode=loss_mode, is_cap=C),
    )
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "acr_loss.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    old, logp0, adv, mask, w = make_inputs(args.batch, args.length)
    cfg = make_config("qurl_acr")
    w_tis = torch.clamp(w, max=C)

    def vanilla_tis(logp):
        return compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", config=cfg, rollout_is_weights=w_tis)[0]

    def qurl_tis(logp):
        return qurl_tis_policy_loss(old, logp, adv, mask, "token-mean", config=cfg, rollout_is_weights=w)[0]

    def qurl_acr(logp):
        return qurl_acr_policy_loss(old, logp, adv, mask, "token-mean", config=cfg, rollout_is_weights=w)[0]

    def qurl_acr_no_metrics(logp):
        # the bare loss path, to separate the cost of the diagnostics from the cost of Eq. 9
        log_w = torch.where(mask, torch.log(w.clamp_min(1e-30)), torch.zeros_like(w))
        loss_mat, _ = acr_token_loss(logp, old, log_w, adv, mask, is_cap=C, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                     clip_ratio_c=3.0, with_stats=False)
        return (loss_mat * mask).sum() / mask.sum()

    contenders = {"vanilla_tis": vanilla_tis, "qurl_tis": qurl_tis, "qurl_acr": qurl_acr, "qurl_acr_no_metrics": qurl_acr_no_metrics}
    assert torch.allclose(qurl_tis(logp0), vanilla_tis(logp0), rtol=1e-5)
    _ = log_weight_from_is_weights(w, mask)  # warm the path once

    wall: dict[str, list[float]] = {k: [] for k in contenders}
    cpu: dict[str, list[float]] = {k: [] for k in contenders}
    for rep in range(args.repeats + 1):  # the first round is warm-up
        for name, fn in contenders.items():
            logp = logp0.clone().requires_grad_(True)
            c0, t0 = time.thread_time(), time.perf_counter()
            loss = fn(logp)
            loss.backward()
            t1, c1 = time.perf_counter(), time.thread_time()
            if rep > 0:
                wall[name].append(t1 - t0)
                cpu[name].append(c1 - c0)

    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    result = {
        "what": "forward+backward of one policy-loss call, token-mean, fp32 CPU tensors",
        "shape": [args.batch, args.length],
        "masked_tokens": int(mask.sum()),
        "repeats": args.repeats,
        "median_wall_s": med,
        "ratio_to_vanilla_tis_wall": {k: v / med["vanilla_tis"] for k, v in med.items()},
        "median_cpu_s": med_cpu,
        "ratio_to_vanilla_tis_cpu": {k: v / med_cpu["vanilla_tis"] for k, v in med_cpu.items()},
        "all_wall_s": wall,
        "all_cpu_s": cpu,
        "target": "qurl_acr <= 1.2x vanilla_tis",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "environment": bench_harness.environment(),
    }
    out = bench_harness.write_json(Path(args.out), result, indent=2)
    for k, v in med.items():
        print(f"{k:>22}: wall {v * 1e3:7.1f} ms ({result['ratio_to_vanilla_tis_wall'][k]:.2f}x)   "
              f"cpu {med_cpu[k] * 1e3:7.1f} ms ({result['ratio_to_vanilla_tis_cpu'][k]:.2f}x vanilla_tis)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
