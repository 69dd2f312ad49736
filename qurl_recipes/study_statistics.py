"""Per-seed statistics of the GRPO study and their summary across seeds (mean and standard error).

Kept apart from the report's tables and figures so that the numbers can be checked on their own.
"""
from __future__ import annotations

import math
import statistics

VARIANT_LABELS = {
    "bf16": "BF16 rollout",
    "naive": "naive W{b}A8 (Eq. 3)",
    "tis": "W{b}A8 + TIS",
    "acr_no_uaq": "W{b}A8 + ACR",
    "acr_uaq": "W{b}A8 + ACR + UAQ",
    "acr_per_group_lr": "W{b}A8 + ACR + per-group LR",
    "acr_per_group_lr_uaq_clip": "W{b}A8 + ACR + per-group LR, clipped as UAQ",
    "tis_fp8kv": "W{b}A8 + FP8 KV + TIS",
    "acr_uaq_fp8kv": "W{b}A8 + FP8 KV + ACR + UAQ",
    "bf16_tis": "BF16 rollout + TIS",
    "bf16_acr": "BF16 rollout + ACR",
}
VARIANT_COLORS = {"bf16": "tab:blue", "naive": "tab:orange", "tis": "tab:green", "acr_no_uaq": "tab:red",
                  "acr_uaq": "tab:purple", "acr_per_group_lr": "tab:brown", "acr_per_group_lr_uaq_clip": "tab:olive",
                  "tis_fp8kv": "tab:cyan", "acr_uaq_fp8kv": "tab:pink",
                  "bf16_tis": "tab:gray", "bf16_acr": "tab:cyan"}
# each FP8 KV cache arm: the same variant without the cache, and the claim the pair tests
FP8_KV_PAIRS = {"tis_fp8kv": ("tis", "TIS holds the extra mismatch of an FP8 KV cache"),
                "acr_uaq_fp8kv": ("acr_uaq", "ACR + UAQ holds the extra mismatch of an FP8 KV cache")}
SMOOTH = 10  # moving-average window of the per-step curves
SIGNIFICANCE = 2.0  # differences count beyond this many standard errors


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean across seeds and its standard error (nan with one seed: no seed-to-seed estimate)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def window(n_steps: int) -> int:
    """Steps averaged for the first/last reward: a tenth of the run, at least one."""
    return max(1, n_steps // 10)


def train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "reward" in r]


def seed_statistics(rows: list[dict], is_cap: float, max_grad_norm: float = 1.0) -> dict:
    """One seed's numbers from its per-step records (``metrics.jsonl``)."""
    train = train_rows(rows)
    n = len(train)
    w = window(n)
    rewards = [r["reward"] for r in train]
    kl = [r["kl_k3"] for r in train]
    half = n // 2
    changed = [r["changed_code_share"] for r in train if "changed_code_share" in r]
    changed_qkv = [r["changed_code_share_qkv"] for r in train if "changed_code_share_qkv" in r]
    evals = sorted((r for r in rows if "val_acc" in r), key=lambda r: r["step"])

    def at(key, i):
        return evals[i].get(key, float("nan")) if evals else float("nan")

    grad_norms = [r["grad_norm_max"] for r in train if "grad_norm_max" in r]
    return {**_fp8_kv_statistics(train),
        "steps": n,
        "reward_first": statistics.fmean(rewards[:w]),
        "reward_last": statistics.fmean(rewards[-w:]),
        "kl_mean": statistics.fmean(kl),
        "kl_first_half": statistics.fmean(kl[:half]) if half else float("nan"),
        "kl_second_half": statistics.fmean(kl[half:]),
        "w_max": max(r["w_max"] for r in train),
        "w_above_c_step_share": sum(r["w_max"] > is_cap for r in train) / n,
        "w_frac_above_c_mean": statistics.fmean(r["w_frac_above_c"] for r in train),
        "clipfrac_upper_mean": statistics.fmean(r["clipfrac_upper"] for r in train),
        "changed_code_share": statistics.fmean(changed) if changed else float("nan"),
        "changed_code_share_qkv": statistics.fmean(changed_qkv) if changed_qkv else float("nan"),
        "val_acc_first": at("val_acc", 0),
        "val_acc_last": at("val_acc", -1),
        "val_acc_full_first": at("val_acc_full", 0),
        "val_acc_full_last": at("val_acc_full", -1),
        "train_acc_full_first": at("train_acc_full", 0),
        "train_acc_full_last": at("train_acc_full", -1),
        "grad_clipped_step_share": (sum(g > max_grad_norm for g in grad_norms) / len(grad_norms)
                                    if grad_norms else float("nan")),
        "sync_s": statistics.fmean(r["sync_s"] for r in train),
        "step_s": statistics.fmean(r["step_s"] for r in train),
    }


def _fp8_kv_statistics(train: list[dict]) -> dict:
    """The FP8 KV cache's per-step fields of one seed (nan for a variant without the cache). The scale
    ranges leave out step 0, whose scales are the initial 1.0, not measured ones."""
    nan = float("nan")
    added = [r["kl_fp8kv_k3"] for r in train if "kl_fp8kv_k3" in r]
    fill = [r["kv_fill_max"] for r in train if "kv_fill_max" in r]
    measured = [r for r in train if r["step"] > 0 and "kv_k_scale_min" in r]

    def extreme(pick, key):
        return pick(r[key] for r in measured) if measured else nan

    return {"kl_fp8kv_mean": statistics.fmean(added) if added else nan, "kv_fill_max": max(fill) if fill else nan,
            **{key: extreme(pick, key) for pick, key in FP8_KV_SCALE_EXTREMES}}


# (how seeds combine, key): the scale range over the measured steps, widest across seeds
FP8_KV_SCALE_EXTREMES = ((min, "kv_k_scale_min"), (max, "kv_k_scale_max"), (min, "kv_v_scale_min"),
                         (max, "kv_v_scale_max"))

# quantities summarised as mean +- se across seeds; w_max is the maximum over seeds
AVERAGED = ("reward_first", "reward_last", "kl_mean", "kl_first_half", "kl_second_half", "w_above_c_step_share",
            "w_frac_above_c_mean", "clipfrac_upper_mean", "changed_code_share", "changed_code_share_qkv",
            "val_acc_first", "val_acc_last", "val_acc_full_first", "val_acc_full_last", "train_acc_full_first",
            "train_acc_full_last", "grad_clipped_step_share", "sync_s", "step_s", "kl_fp8kv_mean",
            "kv_fill_max")
# accuracies on a fixed question set: key -> which set ("val" or "train") they are measured on
ACCURACIES = {"val_acc_first": "val", "val_acc_last": "val", "val_acc_full_first": "val", "val_acc_full_last": "val",
              "train_acc_full_first": "train", "train_acc_full_last": "train"}


def variant_summary(per_seed: dict[int, dict], questions: dict[str, int] | None = None) -> dict:
    """Across-seed summary of one variant from its ``seed_statistics``.

    ``questions`` ({"val": n, "train": n}) floors the standard error of an accuracy at the binomial
    one of its question set, sqrt(p (1 - p) / (n x seeds)): two seeds can agree by chance, and a
    zero standard error would make any difference look real.
    """
    stats = list(per_seed.values())
    out: dict = {"seeds": sorted(per_seed), "steps": min(s["steps"] for s in stats),
                 "w_max": max(s["w_max"] for s in stats)}
    for key in AVERAGED:
        m, se = mean_se([s[key] for s in stats])
        if questions and key in ACCURACIES and not math.isnan(m):
            floor = math.sqrt(m * (1 - m) / (questions[ACCURACIES[key]] * len(stats)))
            se = floor if math.isnan(se) else max(se, floor)
        out[key], out[f"{key}_se"] = m, se
    for pick, key in FP8_KV_SCALE_EXTREMES:
        values = [s[key] for s in stats if not math.isnan(s.get(key, float("nan")))]
        out[key] = pick(values) if values else float("nan")
    m, se = mean_se([s["kl_second_half"] - s["kl_first_half"] for s in stats])
    out["kl_drift"], out["kl_drift_se"] = m, se
    m, se = mean_se([s["reward_last"] - s["reward_first"] for s in stats])
    out["reward_gain"], out["reward_gain_se"] = m, se
    return out


def difference(a: dict, b: dict, key: str) -> tuple[float, float]:
    """a[key] - b[key] and its standard error, from two independent across-seed summaries."""
    return a[key] - b[key], math.hypot(a[f"{key}_se"], b[f"{key}_se"])


def beyond_noise(diff: float, se: float) -> bool:
    return not math.isnan(se) and abs(diff) > SIGNIFICANCE * se


def fmt_difference(diff: float, se: float, spec: str = ".3f") -> str:
    return f"{diff:+{spec}} ± {se:{spec}}"


# The outcome the claims compare: greedy accuracy of the trained fp32 weights on the training
# questions at the end, the same evaluator for every variant. The train reward is sampled from each
# variant's own rollout policy, so it also carries the quantized policy's lower accuracy from step 0.
