"""The GRPO study's figures (matplotlib): per-step curves across seeds, the FP8 KV cache and long-horizon plots."""
from __future__ import annotations

import math
from pathlib import Path

from qurl_recipes.repro_report import moving_average
from qurl_recipes.study_long_horizon import LONG_BASE, LONG_WINDOW, window_name
from qurl_recipes.study_statistics import FP8_KV_PAIRS, SMOOTH, VARIANT_COLORS, VARIANT_LABELS, train_rows


def _curve(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


CURVES = {  # file name -> (metric, y label, log scale, smoothed)
    "reward": ("reward", "train reward (exact final answer)", False, True),
    "mismatch_kl": ("kl_k3", "KL(behav ‖ prox), k3 estimator", True, True),
    "max_w": ("w_max", "max w = π_prox / π_behav in the step", False, True),
    "share_above_c": ("w_frac_above_c", "share of tokens with w > C", False, True),
    "changed_codes": ("changed_code_share", "share of weight codes changed by the step", False, True),
    "train_accuracy": ("train_acc_full", "training-question accuracy (greedy, trained fp32 weights)", False, False),
    "val_accuracy": ("val_acc_full", "validation accuracy (greedy, trained fp32 weights)", False, False),
}


def _draw(ax, runs, variant, key, smooth, bits):
    import numpy as np

    curves = [_curve(rows, key) for rows, _ in runs[variant].values()]
    curves = [c for c in curves if c[1]]
    if not curves:
        return False
    n = min(len(c[1]) for c in curves)
    steps = curves[0][0][:n]
    values = np.array([(moving_average(c[1], SMOOTH) if smooth else c[1])[:n] for c in curves])
    color = VARIANT_COLORS.get(variant)
    ax.plot(steps, values.mean(0), color=color, lw=1.6, marker="o" if not smooth else None, ms=3,
            label=VARIANT_LABELS.get(variant, variant).format(b=bits))
    if len(values) > 1:
        ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.15, lw=0)
    return True


def plot(runs, out_dir: Path, bits: int, is_cap: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    seeds_note = "mean over seeds, shaded: min–max across seeds"
    for name, (key, ylabel, logy, smooth) in CURVES.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        drawn = [_draw(ax, runs, v, key, smooth, bits) for v in runs]
        if not any(drawn):
            plt.close(fig)
            continue
        if name == "max_w":
            ax.axhline(is_cap, color="k", ls=":", lw=1, label=f"C = {is_cap:g}")
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel}\n({SMOOTH}-step moving average; {seeds_note})" if smooth
                     else f"{ylabel}\n({seeds_note})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    arms = [v for v in ("acr_uaq", "acr_per_group_lr", "acr_per_group_lr_uaq_clip") if v in runs]
    if "acr_uaq" in arms and len(arms) >= 2:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), dpi=110)
        for ax, (key, ylabel) in zip(axes, (("reward", "train reward"), ("changed_code_share_qkv", "q/k/v codes changed"),
                                            ("kl_k3", "KL(behav ‖ prox)"))):
            for v in arms:
                _draw(ax, runs, v, key, True, bits)
            ax.set_xlabel("GRPO step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"UAQ against a per-group learning rate ({SMOOTH}-step moving average; {seeds_note})", fontsize=9)
        fig.tight_layout()
        path = out_dir / "uaq_vs_per_group_lr.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def plot_fp8_kv(runs, summaries: dict[str, dict], out_dir: Path, bits: int, is_cap: float) -> list[Path]:
    """``fp8_kv_cache.png``: KL(behav‖prox), the KL the cache adds, w > C and the scales of the FP8 KV arms
    per step; the same variants without the cache as dashed lines at their run means."""
    arms = [v for v in FP8_KV_PAIRS if v in runs]
    if not arms:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), dpi=110)
    panels = ((axes[0, 0], "kl_k3", "kl_mean", "KL(behav ‖ prox), k3"),
              (axes[0, 1], "kl_fp8kv_k3", None, "KL added by the FP8 KV cache"),
              (axes[1, 0], "w_frac_above_c", "w_frac_above_c_mean", f"share of tokens with w > C = {is_cap:g}"))
    for ax, key, mean_key, ylabel in panels:
        for v in arms:
            _draw(ax, runs, v, key, True, bits)
            base = FP8_KV_PAIRS[v][0]
            if mean_key and base in summaries:
                ax.axhline(summaries[base][mean_key], color=VARIANT_COLORS.get(base), ls="--", lw=1.2,
                           label=f"{VARIANT_LABELS.get(base, base).format(b=bits)}: run mean")
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
    ax = axes[1, 1]
    for v in arms:
        for part, style in (("k", "-"), ("v", ":")):
            rows = [r for r in train_rows(next(iter(runs[v].values()))[0])  # the first seed, measured scales
                    if r["step"] > 0 and f"kv_{part}_scale_max" in r]
            for bound in ("min", "max"):
                ax.plot([r["step"] for r in rows], [r[f"kv_{part}_scale_{bound}"] for r in rows],
                        ls=style, color=VARIANT_COLORS.get(v), lw=1,
                        label=f"{VARIANT_LABELS.get(v, v).format(b=bits)}: {part.upper()}" if bound == "max" else None)
    ax.set_yscale("log")
    ax.set_ylabel("per-layer scale (min and max over layers)")
    ax.set_title("scales of the first seed from step 1 (step 0: 1.0 in every layer)", fontsize=9)
    for ax in axes.flat:
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"FP8 KV cache arms ({SMOOTH}-step moving average; mean over seeds, shaded: min–max across seeds)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path = out_dir / "fp8_kv_cache.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def plot_long(runs, summaries: dict[str, dict], out_dir: Path, bits: int) -> list[Path]:
    """KL over the long runs (log y) and reward / training accuracy per 100-step window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(7.2, 4.2), dpi=110)
    drawn = False
    for v, s in summaries.items():
        drawn |= _draw(ax, runs, v, "kl_k3", True, bits)
        pts = [((w["start"] + w["end"]) / 2, w["kl_k3"]) for w in s["windows"] if w["kl_k3"] > 0]
        if pts:
            ax.plot(*zip(*pts), ls="none", marker="s", ms=4, mec="k", mew=0.5, color=VARIANT_COLORS.get(v))
    if drawn:
        ax.axvspan(*LONG_BASE, color="0.85", zorder=0, label=f"steps {window_name(LONG_BASE)}")
        ax.set_yscale("log")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("KL(behav ‖ prox), k3 estimator")
        ax.set_title(f"KL(behav ‖ prox) over the long runs ({SMOOTH}-step moving average;\nsquares: "
                     f"{LONG_WINDOW}-step window means; mean over seeds, shaded: min–max across seeds)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / "long_horizon_kl.png"
        fig.savefig(path)
        written.append(path)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.0), dpi=110)
    for v, s in summaries.items():
        style = dict(color=VARIANT_COLORS.get(v), marker="o", ms=3, lw=1.4, capsize=2,
                     label=VARIANT_LABELS.get(v, v).format(b=bits))
        w = s["windows"]
        axes[0].errorbar([(r["start"] + r["end"]) / 2 for r in w], [r["reward"] for r in w],
                         yerr=[0 if math.isnan(r["reward_se"]) else r["reward_se"] for r in w], **style)
        e = [r for r in s["evals"] if "train_acc_full" in r]
        axes[1].errorbar([r["step"] for r in e], [r["train_acc_full"] for r in e],
                         yerr=[0 if math.isnan(r["train_acc_full_se"]) else r["train_acc_full_se"] for r in e], **style)
    for ax, ylabel in zip(axes, (f"train reward, {LONG_WINDOW}-step window mean",
                                 "training-question accuracy (greedy, fp32 weights)")):
        ax.axvspan(*LONG_BASE, color="0.85", zorder=0)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Long runs: reward and training accuracy (mean over seeds, error bars: ± SE across seeds; "
                 f"grey: steps {window_name(LONG_BASE)})", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path = out_dir / "long_horizon_reward.png"
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
    return written
