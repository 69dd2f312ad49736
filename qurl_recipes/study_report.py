"""Tables, claim checks and figures of the GRPO study (``qurl_recipes.grpo_study``), across seeds.

Every statistic is computed per seed first and then summarised across seeds as a mean and its
standard error (sample standard deviation / sqrt(seeds)), so the error bars are seed-to-seed
variation, not step-to-step noise. A difference between two variants counts only beyond twice
the standard error of the difference (sqrt(se_a^2 + se_b^2)). Pure Python + matplotlib.

The report in ``--out`` is extended, not thrown away: arms it already holds whose runs are not under
``--runs`` (an arm added later, such as the FP8 KV cache arm, runs on its own) keep their summaries,
and its long-horizon section stays unless ``--long-runs`` replaces it. Figures drawn from per-step
records are redrawn only when every arm has its runs; otherwise the existing ones stay.

``--long-runs`` adds a long-horizon section (paper Fig. 3: TIS drifts after ~500 steps, ACR does
not) from a separate set of runs of >= 600 steps, in 100-step windows; without ``--runs`` it adds
that section to the report already in ``--out`` and leaves the rest of it as it is.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from qurl_recipes.repro_report import moving_average

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
}
VARIANT_COLORS = {"bf16": "tab:blue", "naive": "tab:orange", "tis": "tab:green", "acr_no_uaq": "tab:red",
                  "acr_uaq": "tab:purple", "acr_per_group_lr": "tab:brown", "acr_per_group_lr_uaq_clip": "tab:olive",
                  "tis_fp8kv": "tab:cyan", "acr_uaq_fp8kv": "tab:pink"}
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


def _train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "reward" in r]


def seed_statistics(rows: list[dict], is_cap: float, max_grad_norm: float = 1.0) -> dict:
    """One seed's numbers from its per-step records (``metrics.jsonl``)."""
    train = _train_rows(rows)
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


def _fmt(diff: float, se: float, spec: str = ".3f") -> str:
    return f"{diff:+{spec}} ± {se:{spec}}"


# The outcome the claims compare: greedy accuracy of the trained fp32 weights on the training
# questions at the end, the same evaluator for every variant. The train reward is sampled from each
# variant's own rollout policy, so it also carries the quantized policy's lower accuracy from step 0.
FINAL_ACCURACY = "train_acc_full_last"


def claim_checks(s: dict[str, dict]) -> list[dict]:
    """The issue's six claims, each with its measure and a verdict computed from the summaries."""
    checks = []

    def add(claim, measure, verdict):
        checks.append({"claim": claim, "measure": measure, "verdict": verdict})

    if {"naive", "bf16"} <= s.keys():
        d, se = difference(s["naive"], s["bf16"], FINAL_ACCURACY)
        dg, seg = difference(s["naive"], s["bf16"], "reward_gain")
        add("naive quantized rollout degrades",
            f"final accuracy naive − BF16 {_fmt(d, se)}; train-reward gain naive − BF16 {_fmt(dg, seg)}",
            "reproduced" if d < 0 and beyond_noise(d, se) else "not reproduced")
    if "tis" in s:
        t = s["tis"]
        add("TIS drifts (KL(behav‖prox) grows over the run)",
            f"KL second − first half {_fmt(t['kl_drift'], t['kl_drift_se'], '.2e')}",
            "reproduced" if t["kl_drift"] > 0 and beyond_noise(t["kl_drift"], t["kl_drift_se"]) else "not reproduced")
    if {"tis", "acr_no_uaq"} <= s.keys():
        d, se = difference(s["acr_no_uaq"], s["tis"], FINAL_ACCURACY)
        dk, sek = difference(s["acr_no_uaq"], s["tis"], "kl_drift")
        share = s["tis"]["w_above_c_step_share"]
        tis_drifts = s["tis"]["kl_drift"] > 0 and beyond_noise(s["tis"]["kl_drift"], s["tis"]["kl_drift_se"])
        if share == 0:
            verdict = "not testable (no w > C: ACR is TIS)"
        elif (d > 0 and beyond_noise(d, se)) or (dk < 0 and beyond_noise(dk, sek)):
            verdict = "reproduced"
        elif not tis_drifts:
            verdict = "not testable (TIS does not drift here; ACR and TIS agree within noise)"
        else:
            verdict = "not reproduced"
        add("ACR stays stable where TIS drifts",
            f"final accuracy ACR − TIS {_fmt(d, se)}; KL drift ACR − TIS {_fmt(dk, sek, '.2e')}; "
            f"steps with w > C (TIS) {share:.2f}", verdict)
    if {"acr_uaq", "acr_no_uaq"} <= s.keys():
        d, se = difference(s["acr_uaq"], s["acr_no_uaq"], "changed_code_share")
        ratio = s["acr_uaq"]["changed_code_share"] / s["acr_no_uaq"]["changed_code_share"]
        ratio_qkv = s["acr_uaq"]["changed_code_share_qkv"] / s["acr_no_uaq"]["changed_code_share_qkv"]
        add("UAQ makes more weight updates visible",
            f"changed codes per step ×{ratio:.2f} ({_fmt(d, se, '.2e')}), q/k/v alone ×{ratio_qkv:.2f}",
            "reproduced" if d > 0 and beyond_noise(d, se) else "not reproduced")
    if {"acr_uaq", "acr_no_uaq", "bf16"} <= s.keys():
        gap, gap_se = difference(s["acr_no_uaq"], s["bf16"], FINAL_ACCURACY)
        gap_uaq, gap_uaq_se = difference(s["acr_uaq"], s["bf16"], FINAL_ACCURACY)
        if not (gap < 0 and beyond_noise(gap, gap_se)):
            verdict = "no gap to close (ACR without UAQ already within noise of BF16 or above)"
        elif not beyond_noise(gap_uaq, gap_uaq_se) or gap_uaq > 0:
            verdict = "reproduced"
        else:
            verdict = "not reproduced"
        add("UAQ closes the gap to BF16",
            f"final accuracy − BF16: ACR {_fmt(gap, gap_se)}, ACR + UAQ {_fmt(gap_uaq, gap_uaq_se)}", verdict)
    arms = {"acr_per_group_lr": "UAQ ≈ per-group learning rate (q/k/v lr × s, norm lr / s)",
            "acr_per_group_lr_uaq_clip": "UAQ ≈ per-group learning rate with the gradient clipped as UAQ clips it"}
    for arm, claim in arms.items():
        if {"acr_uaq", arm} <= s.keys():
            keys = (FINAL_ACCURACY, "reward_last", "changed_code_share", "kl_mean")
            diffs = {k: difference(s[arm], s["acr_uaq"], k) for k in keys}
            differ = [k for k in keys if beyond_noise(*diffs[k])]
            agree = [k for k in keys if k not in differ]
            verdict = ("agree within seed noise" if not differ else f"differ beyond seed noise in {', '.join(differ)}"
                       + (f"; agree in {', '.join(agree)}" if agree else ""))
            add(claim, "; ".join(f"{k} per-group − UAQ {_fmt(*diffs[k], '.3g')}" for k in keys), verdict)
    for arm, (base, claim) in FP8_KV_PAIRS.items():
        if {arm, base} <= s.keys():
            a, b = s[arm], s[base]
            d, se = difference(a, b, FINAL_ACCURACY)
            dk, sek = difference(a, b, "kl_mean")
            if d < 0 and beyond_noise(d, se):
                verdict = "not held (final accuracy falls beyond seed noise)"
            else:
                verdict = ("held within seed noise (final accuracy); KL(behav‖prox) "
                           + ("rises beyond" if dk > 0 and beyond_noise(dk, sek) else "within") + " seed noise")
            add(claim, f"final accuracy FP8 KV − without {_fmt(d, se)}; KL(behav‖prox) FP8 KV − without "
                       f"{_fmt(dk, sek, '.2e')}; KL added by the cache alone {a['kl_fp8kv_mean']:.2e} ± "
                       f"{a['kl_fp8kv_mean_se']:.2e}; tokens with w > C {a['w_frac_above_c_mean']:.2e} against "
                       f"{b['w_frac_above_c_mean']:.2e}", verdict)
    return checks


# Long horizon (paper Fig. 3): decoupled PPO + TIS holds for about 500 steps, then KL(behav‖prox)
# climbs (0.002 -> 0.025) and training collapses after about 1,000 steps, while ACR stays stable.
# Tested on a separate set of long runs (``--long-runs``), in 100-step windows.
LONG_WINDOW = 100  # steps per window of the long-horizon tables
LONG_BASE = (400, 500)  # the window where TIS is still fine; the last window is compared with it
LONG_MIN_STEPS = 600  # shorter runs have no 100-step window after step 500
# Late/base KL ratio that counts as drift. The paper's rise is 12x; a factor of 2 sits well above the
# tens-of-percent wander of the 200-step runs' KL between halves, so noise alone rarely passes it.
DRIFT_FACTOR = 2.0
# Per-step fields averaged per window. "Where ACR's bound binds" is clipfrac_upper: the share of
# tokens with A > 0 whose ratio R exceeds the upper clip bound, so their gradient is stopped. For
# the acr variants that bound is ACR's (1 + eps_high) / r, for tis and bf16 the fixed 1 + eps_high,
# so the one column compares the bound each variant trains with. w_frac_above_c (w > C, r < 1) is
# where ACR widens the bound at all (elsewhere ACR is TIS): it says where ACR acts, not where its
# bound binds, and is kept alongside for that reason. entropy (of the sampled policy, nats per
# response token; runs from before it was logged show n/a) tells whether the KL moves with how
# peaked the policy is rather than with the weight error.
LONG_WINDOW_KEYS = ("kl_k3", "reward", "clipfrac_upper", "w_frac_above_c", "entropy")
LONG_EVAL_KEYS = {"train_acc_full": "train", "val_acc_full": "val", "val_acc": "val"}  # key -> question set
LONG_SECTION = "## Long horizon"  # the heading that starts the long-horizon part of results.md
LONG_ACR = {"acr_no_uaq": "ACR stays stable where TIS drifts", "acr_uaq": "ACR + UAQ stays stable where TIS drifts"}


def span_mean(rows: list[dict], key: str, start: int, end: int) -> float:
    """Mean of ``key`` over the training steps start <= step < end (nan if none logged it)."""
    values = [r[key] for r in _train_rows(rows) if start <= r["step"] < end and r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def long_seed_statistics(rows: list[dict], width: int = LONG_WINDOW) -> dict:
    """One seed's window means, its evaluations at multiples of ``width``, and the verdict windows."""
    end = max(r["step"] for r in _train_rows(rows)) + 1  # the final row (step == steps) is evaluation only
    windows = [{"start": a, "end": min(a + width, end), **{k: span_mean(rows, k, a, min(a + width, end))
                                                            for k in LONG_WINDOW_KEYS}}
               for a in range(0, end, width)]
    evals = [{"step": r["step"], **{k: r[k] for k in LONG_EVAL_KEYS if k in r}}
             for r in sorted(rows, key=lambda r: r["step"])
             if r["step"] % width == 0 and any(k in r for k in LONG_EVAL_KEYS)]
    late = (max(0, end - width), end)
    return {"steps": end, "late_window": list(late), "windows": windows, "evals": evals,
            "kl_base": span_mean(rows, "kl_k3", *LONG_BASE), "kl_late": span_mean(rows, "kl_k3", *late),
            "reward_base": span_mean(rows, "reward", *LONG_BASE), "reward_late": span_mean(rows, "reward", *late)}


def _accuracy_se(m: float, se: float, questions: int, seeds: int) -> float:
    """The standard error floored at the binomial one, as ``variant_summary`` does for accuracies."""
    if not questions or math.isnan(m):
        return se
    floor = math.sqrt(m * (1 - m) / (questions * seeds))
    return floor if math.isnan(se) else max(se, floor)


def long_variant_summary(per_seed: dict[int, dict], questions: dict[str, int] | None = None) -> dict:
    """Across-seed mean ± SE of every window, evaluation and verdict quantity of one variant."""
    seeds = sorted(per_seed)
    stats = [per_seed[s] for s in seeds]
    out: dict = {"seeds": seeds, "steps": min(s["steps"] for s in stats),
                 "late_window": min((s["late_window"] for s in stats), key=lambda w: w[1])}
    out["windows"] = []
    for i in range(min(len(s["windows"]) for s in stats)):
        row = {"start": stats[0]["windows"][i]["start"], "end": min(s["windows"][i]["end"] for s in stats)}
        for k in LONG_WINDOW_KEYS:
            row[k], row[f"{k}_se"] = mean_se([s["windows"][i][k] for s in stats])
        out["windows"].append(row)
    out["evals"] = []
    for step in sorted({e["step"] for s in stats for e in s["evals"]}):
        row = {"step": step}
        for k, which in LONG_EVAL_KEYS.items():
            values = [e[k] for s in stats for e in s["evals"] if e["step"] == step and k in e]
            if values:
                m, se = mean_se(values)
                row[k], row[f"{k}_se"] = m, _accuracy_se(m, se, (questions or {}).get(which, 0), len(values))
        out["evals"].append(row)
    for k in ("kl_base", "kl_late", "reward_base", "reward_late"):
        out[k], out[f"{k}_se"] = mean_se([s[k] for s in stats])
    out["kl_rise"], out["kl_rise_se"] = mean_se([s["kl_late"] - s["kl_base"] for s in stats])
    out["reward_change"], out["reward_change_se"] = mean_se([s["reward_late"] - s["reward_base"] for s in stats])
    out["per_seed"] = {seed: {k: per_seed[seed][k] for k in ("windows", "evals")} for seed in seeds}
    return out


def _window_name(w) -> str:
    return f"{w[0]}–{w[1]}"


def long_horizon_checks(s: dict[str, dict]) -> list[dict]:
    """Fig. 3's two claims on the long runs, each with its measure, numbers and verdict (2-SE rule)."""
    checks = []
    base = _window_name(LONG_BASE)
    tis = s.get("tis")
    values: dict = {}
    if tis is None:
        verdict, measure = "not testable (no TIS runs)", "n/a"
    elif tis["steps"] < LONG_MIN_STEPS:
        verdict = (f"not testable (runs have {tis['steps']} steps; at least {LONG_MIN_STEPS} are needed for a "
                   f"{LONG_WINDOW}-step window after step {LONG_BASE[1]})")
        measure = "n/a"
    else:
        late = _window_name(tis["late_window"])
        rise, rise_se = tis["kl_rise"], tis["kl_rise_se"]
        if tis["kl_base"] > 0:
            ratio = tis["kl_late"] / tis["kl_base"]
        else:
            ratio = math.inf if tis["kl_late"] > 0 else float("nan")
        values = {"kl_base": tis["kl_base"], "kl_base_se": tis["kl_base_se"], "kl_late": tis["kl_late"],
                  "kl_late_se": tis["kl_late_se"], "kl_rise": rise, "kl_rise_se": rise_se, "ratio": ratio,
                  "ratio_threshold": DRIFT_FACTOR, "base_window": list(LONG_BASE), "late_window": tis["late_window"]}
        if math.isnan(rise_se):
            verdict = "not testable (one seed: no seed-to-seed standard error)"
        elif rise > 0 and beyond_noise(rise, rise_se) and ratio >= DRIFT_FACTOR:
            verdict = "reproduced"
        else:
            verdict = "not reproduced"
        measure = (f"TIS KL(behav‖prox) steps {late} {tis['kl_late']:.2e} ± {tis['kl_late_se']:.2e}, steps {base} "
                   f"{tis['kl_base']:.2e} ± {tis['kl_base_se']:.2e}; late − {base} {_fmt(rise, rise_se, '.2e')}; "
                   f"ratio ×{ratio:.2f} (drift needs ×{DRIFT_FACTOR:g} and > {SIGNIFICANCE:g} SE)")
    checks.append({"claim": f"TIS drifts after ~{LONG_BASE[1]} steps", "measure": measure, "verdict": verdict,
                   "values": values})
    tis_verdict = verdict

    for variant, claim in LONG_ACR.items():
        acr = s.get(variant)
        if acr is None and variant != "acr_no_uaq":
            continue  # an optional arm: no runs, no claim
        values, measure = {}, "n/a"
        if tis_verdict == "not reproduced":
            verdict = "not testable (TIS does not drift)"
        elif tis_verdict != "reproduced":
            verdict = tis_verdict
        elif acr is None:
            verdict = f"not testable (no {variant} runs)"
        elif acr["steps"] < LONG_MIN_STEPS:
            verdict = f"not testable ({variant} runs have {acr['steps']} steps, fewer than {LONG_MIN_STEPS})"
        else:
            dk, sek = difference(acr, tis, "kl_late")
            dr, ser = acr["reward_change"], acr["reward_change_se"]
            kl_below = dk < 0 and beyond_noise(dk, sek)
            reward_held = not (dr < 0 and beyond_noise(dr, ser))
            verdict = "reproduced" if kl_below and reward_held else "not reproduced"
            values = {"kl_late_minus_tis": dk, "kl_late_minus_tis_se": sek, "reward_change": dr,
                      "reward_change_se": ser, "base_window": list(LONG_BASE), "late_window": acr["late_window"]}
            measure = (f"late-window KL {variant} − TIS {_fmt(dk, sek, '.2e')}; {variant} reward "
                       f"{_window_name(acr['late_window'])} − {base} {_fmt(dr, ser)}")
        checks.append({"claim": claim, "measure": measure, "verdict": verdict, "values": values})
    return checks


def load_runs(runs_dir: Path, variants: list[str]) -> dict[str, dict[int, tuple[list[dict], dict]]]:
    """variant -> seed -> (per-step records, run.json) for every finished run under ``runs_dir``."""
    out: dict[str, dict[int, tuple[list[dict], dict]]] = {}
    for variant in variants:
        for summary in sorted((runs_dir / variant).glob("seed*/run.json")):
            run = json.loads(summary.read_text())
            rows = [json.loads(line) for line in (summary.parent / "metrics.jsonl").read_text().splitlines() if line]
            out.setdefault(variant, {})[run["seed"]] = (rows, run)
    return out


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
            rows = [r for r in _train_rows(next(iter(runs[v].values()))[0])  # the first seed, measured scales
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
        ax.axvspan(*LONG_BASE, color="0.85", zorder=0, label=f"steps {_window_name(LONG_BASE)}")
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
                 f"grey: steps {_window_name(LONG_BASE)})", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path = out_dir / "long_horizon_reward.png"
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
    return written


TABLE_COLUMNS = (  # key, header, format
    ("reward_first", "reward first", ".3f"), ("reward_last", "reward last", ".3f"),
    ("train_acc_full_first", "train acc start", ".3f"), ("train_acc_full_last", "train acc end", ".3f"),
    ("val_acc_full_first", "val acc start", ".3f"), ("val_acc_full_last", "val acc end", ".3f"),
    ("val_acc_first", "val acc start (rollout)", ".3f"), ("val_acc_last", "val acc end (rollout)", ".3f"),
    ("kl_mean", "KL mean", ".2e"), ("kl_first_half", "KL 1st half", ".2e"), ("kl_second_half", "KL 2nd half", ".2e"),
    ("w_above_c_step_share", "steps with w > C", ".2f"), ("changed_code_share", "codes changed", ".2e"),
    ("grad_clipped_step_share", "steps clipped", ".2f"), ("sync_s", "sync s", ".3f"), ("step_s", "step s", ".2f"),
)


def _cpu_name(cpu: dict) -> str:
    return f"{cpu.get('model', '?')} ({cpu.get('isa', '?')})"


def markdown(summaries: dict[str, dict], checks: list[dict], settings: dict, cpu: dict, bits: int,
             kept: dict[str, dict] | None = None) -> str:
    """The 200-step tables and claims; ``kept``: {variant: {"cpu": ...}} of the arms taken over from
    the earlier report (their runs were not under ``--runs``)."""
    origin = f"CPU: {_cpu_name(cpu)}."
    if kept:
        by_cpu: dict[str, list[str]] = {}
        for v in (v for v in summaries if v in kept):
            by_cpu.setdefault(_cpu_name(kept[v].get("cpu", {})), []).append(VARIANT_LABELS.get(v, v).format(b=bits))
        fresh = [VARIANT_LABELS.get(v, v).format(b=bits) for v in summaries if v not in kept]
        origin = (f"CPU: {_cpu_name(cpu)} for {', '.join(fresh)}; "
                  + "; ".join(f"{', '.join(names)} kept from the earlier report (CPU: {name})"
                              for name, names in by_cpu.items()) + ".")
    lines = ["# GRPO study: results (generated by `python -m qurl_recipes.study_report`)", "",
             f"Weight bits {bits}, {settings['steps']} steps, lr {settings['lr']:g}, "
             f"{settings['prompts_per_step']} prompts × {settings['group_size']} samples, "
             f"{settings.get('mini_batches', 1)} updates per rollout, C = {settings['is_cap']:g}. "
             f"{origin} Values: mean ± standard error across seeds.", "",
             "| variant | seeds | " + " | ".join(h for _, h, _ in TABLE_COLUMNS) + " | max w |",
             "|---|---|" + "---:|" * (len(TABLE_COLUMNS) + 1)]
    for v, s in summaries.items():
        cells = []
        for key, _, spec in TABLE_COLUMNS:
            m, se = s[key], s[f"{key}_se"]
            cells.append("n/a" if math.isnan(m) else f"{m:{spec}}" + ("" if math.isnan(se) else f" ± {se:{spec}}"))
        lines.append(f"| {VARIANT_LABELS.get(v, v).format(b=bits)} | {len(s['seeds'])} | " + " | ".join(cells)
                     + f" | {s['w_max']:.2f} |")
    lines += ["", "| claim | measure | verdict |", "|---|---|---|"]
    lines += [f"| {c['claim']} | {c['measure']} | {c['verdict']} |" for c in checks]
    lines += fp8_kv_markdown(summaries, bits)
    return "\n".join(lines) + "\n"


FP8_KV_COLUMNS = (  # key, header, format
    ("kl_mean", "KL(behav‖prox)", ".2e"), ("kl_fp8kv_mean", "KL added by the cache", ".2e"),
    ("w_frac_above_c_mean", "tokens with w > C", ".2e"), ("w_above_c_step_share", "steps with w > C", ".2f"),
    ("reward_last", "reward last", ".3f"), ("train_acc_full_last", "train acc end", ".3f"),
    ("val_acc_last", "val acc end (rollout)", ".3f"), ("kv_fill_max", "largest K or V / FP8 range", ".2f"),
    ("step_s", "step s", ".2f"),
)


def fp8_kv_markdown(summaries: dict[str, dict], bits: int) -> list[str]:
    """The FP8 KV cache table: each FP8 arm under the same variant without the cache (no lines without an arm)."""
    rows = [v for arm, (base, _) in FP8_KV_PAIRS.items() if arm in summaries for v in (base, arm) if v in summaries]
    if not rows:
        return []
    lines = ["", "## FP8 KV cache", "",
             f"KL added by the cache: KL(π_behav ‖ the same W{bits}A8 policy without the FP8 KV cache) on the sampled "
             "tokens, per step, then averaged. Scales: per layer, from the K/V ranges of the previous step's update "
             "forwards; step 0 rolls out with 1.0 in every layer and is left out of the scale ranges.", "",
             "| variant | seeds | " + " | ".join(h for _, h, _ in FP8_KV_COLUMNS) + " | max w | K scales | V scales |",
             "|---|---|" + "---:|" * (len(FP8_KV_COLUMNS) + 3)]
    for v in rows:
        s = summaries[v]
        cells = [_cell(s.get(key, float("nan")), s.get(f"{key}_se", float("nan")), spec) for key, _, spec in FP8_KV_COLUMNS]
        scales = [("n/a" if math.isnan(s.get(f"kv_{p}_scale_min", float("nan")))
                   else f"{s[f'kv_{p}_scale_min']:.2e}–{s[f'kv_{p}_scale_max']:.2e}") for p in ("k", "v")]
        lines.append(f"| {VARIANT_LABELS.get(v, v).format(b=bits)} | {len(s['seeds'])} | " + " | ".join(cells)
                     + f" | {s['w_max']:.2f} | " + " | ".join(scales) + " |")
    return lines


def _cell(m: float, se: float, spec: str) -> str:
    return "n/a" if math.isnan(m) else f"{m:{spec}}" + ("" if math.isnan(se) else f" ± {se:{spec}}")


def long_markdown(long: dict, bits: int) -> str:
    """The "Long horizon" section of results.md."""
    st, summaries = long["settings"], long["variants"]
    cpu = long.get("cpu", {})
    lines = [LONG_SECTION, "",
             f"Weight bits {bits}, {st['steps']} steps, lr {st['lr']:g}, {st['prompts_per_step']} prompts × "
             f"{st['group_size']} samples, {st.get('mini_batches', 1)} updates per rollout, C = {st['is_cap']:g}. "
             f"CPU: {cpu.get('model', '?')} ({cpu.get('isa', '?')}). Windows of {LONG_WINDOW} steps; values: mean ± standard error across seeds. TIS drift compares the "
             f"last window with steps {_window_name(LONG_BASE)}."]

    def label(v):
        return f"{VARIANT_LABELS.get(v, v).format(b=bits)} | {len(summaries[v]['seeds'])}"

    spans = sorted({(w["start"], w["end"]) for s in summaries.values() for w in s["windows"]})
    for key, title, spec in (("kl_k3", "KL(behav‖prox) (k3) per window", ".2e"),
                             ("reward", "Train reward per window", ".3f"),
                             ("clipfrac_upper", "Share of tokens where the upper clip bound binds (clipfrac_upper; "
                                                "ACR's adaptive bound for the ACR variants)", ".2e"),
                             ("w_frac_above_c", "Share of tokens with w > C (where ACR widens the bound)", ".2e"),
                             ("entropy", "Entropy of the sampled policy (nats per response token)", ".3f")):
        lines += ["", f"### {title}", "", "| variant | seeds | " + " | ".join(_window_name(w) for w in spans) + " |",
                  "|---|---|" + "---:|" * len(spans)]
        for v, s in summaries.items():
            by_span = {(w["start"], w["end"]): w for w in s["windows"]}
            lines.append(f"| {label(v)} | " + " | ".join(
                _cell(by_span[w][key], by_span[w][f"{key}_se"], spec) if w in by_span else "n/a" for w in spans) + " |")
    steps = sorted({e["step"] for s in summaries.values() for e in s["evals"]})
    for key, title in (("train_acc_full", "Training-question accuracy (greedy, trained fp32 weights)"),
                       ("val_acc_full", "Validation accuracy (greedy, trained fp32 weights)"),
                       ("val_acc", "Validation accuracy (greedy, rollout policy)")):
        lines += ["", f"### {title}, every {LONG_WINDOW} steps", "",
                  "| variant | seeds | " + " | ".join(str(t) for t in steps) + " |", "|---|---|" + "---:|" * len(steps)]
        for v, s in summaries.items():
            by_step = {e["step"]: e for e in s["evals"]}
            lines.append(f"| {label(v)} | " + " | ".join(
                _cell(by_step[t][key], by_step[t][f"{key}_se"], ".3f") if key in by_step.get(t, {}) else "n/a"
                for t in steps) + " |")
    lines += ["", "### Verdicts", "", "| claim | measure | verdict |", "|---|---|---|"]
    lines += [f"| {c['claim']} | {c['measure']} | {c['verdict']} |" for c in long["verdicts"]]
    return "\n".join(lines) + "\n"


def _load_checked(runs_dir: Path, variants: list[str]):
    """Finished runs under ``runs_dir`` and their shared settings and CPU (refuses mixed settings)."""
    runs = load_runs(runs_dir, variants)
    if not runs:
        raise SystemExit(f"no finished runs under {runs_dir}")
    first = next(iter(next(iter(runs.values())).values()))[1]
    settings, cpu = first["settings"], first["cpu"]
    for variant, seeds in runs.items():
        for seed, (_, run) in seeds.items():
            if run["settings"] != settings:
                raise SystemExit(f"{variant} seed {seed} ran with other settings than the rest; rerun it or remove it")
    return runs, settings, cpu


def build_long_horizon(runs_dir: Path, variants: list[str], out_dir: Path) -> dict:
    """Window tables, Fig. 3 verdicts and figures of the long runs (the ``long_horizon`` entry)."""
    runs, settings, cpu = _load_checked(runs_dir, variants)
    questions = {"val": settings.get("n_val", 0), "train": settings.get("n_train", 0)}
    summaries = {v: long_variant_summary({seed: long_seed_statistics(rows) for seed, (rows, _) in seeds.items()},
                                         questions)
                 for v, seeds in runs.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = plot_long(runs, summaries, out_dir, settings["weight_bits"])
    return {"settings": settings, "cpu": cpu, "window": LONG_WINDOW, "base_window": list(LONG_BASE),
            "min_steps": LONG_MIN_STEPS, "drift_factor": DRIFT_FACTOR, "significance": SIGNIFICANCE,
            "variants": summaries, "verdicts": long_horizon_checks(summaries), "figures": [p.name for p in figures]}


def add_long_horizon(long_runs: Path, variants: list[str], out_dir: Path) -> dict:
    """Adds (or replaces) the long-horizon part of the report already in ``out_dir``.

    The 200-step part stays as it was written, so the long runs can be added on another day or
    machine than the 200-step ones, which need not be on disk any more.
    """
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    if not (json_path.exists() and md_path.exists()):
        raise SystemExit(f"no report in {out_dir} (results.json, results.md) to add the long horizon to; "
                         "build it with --runs first")
    result = json.loads(json_path.read_text())
    result["long_horizon"] = build_long_horizon(long_runs, variants, out_dir)
    head = md_path.read_text().split("\n" + LONG_SECTION + "\n")[0]
    text = head + "\n" + long_markdown(result["long_horizon"], result["long_horizon"]["settings"]["weight_bits"])
    json_path.write_text(json.dumps(result, indent=1, sort_keys=True, default=float) + "\n")
    md_path.write_text(text)
    return result


def _previous_report(out_dir: Path) -> tuple[dict, str]:
    """results.json and results.md already in ``out_dir`` ({} and "" where there are none)."""
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    if not (json_path.exists() and md_path.exists()):
        return {}, ""
    return json.loads(json_path.read_text()), md_path.read_text()


def kept_arms(previous: dict, fresh: set[str], settings: dict) -> dict[str, dict]:
    """{variant: {"summary": ..., "cpu": ...}} for the arms of the earlier report with no runs now.

    They are kept only from a report of the same settings: the tables and claims compare arms as
    equals, so an arm of other settings must be rerun (or the earlier report moved away)."""
    old = {v: s for v, s in previous.get("variants", {}).items() if v not in fresh}
    if not old:
        return {}
    if previous["settings"] != settings:
        raise SystemExit(f"the report in --out holds {', '.join(old)} from runs with other settings than those under "
                         "--runs; rerun them with these settings, or move results.json and results.md away")
    cpus = previous.get("kept_arms", {})
    return {v: {"summary": s, "cpu": cpus.get(v, {}).get("cpu", previous.get("cpu", {}))} for v, s in old.items()}


def build_report(runs_dir: Path, variants: list[str], out_dir: Path, long_runs: Path | None = None) -> dict:
    runs, settings, cpu = _load_checked(runs_dir, variants)
    is_cap, bits = settings["is_cap"], settings["weight_bits"]
    questions = {"val": settings.get("n_val", 0), "train": settings.get("n_train", 0)}
    summaries = {v: variant_summary({seed: seed_statistics(rows, is_cap, settings.get("max_grad_norm", 1.0))
                                     for seed, (rows, _) in seeds.items()}, questions if all(questions.values()) else None)
                 for v, seeds in runs.items()}
    previous, previous_md = _previous_report(out_dir)
    kept = kept_arms(previous, set(summaries), settings)
    merged = {**{v: k["summary"] for v, k in kept.items()}, **summaries}
    order = [v for v in VARIANT_LABELS if v in merged] + [v for v in merged if v not in VARIANT_LABELS]
    summaries = {v: merged[v] for v in order}
    checks = claim_checks(summaries)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kept:  # arms without per-step records: the curves already drawn stay as they are
        figures = [f for f in previous.get("figures", []) if (out_dir / f).exists()]
    else:
        figures = [p.name for p in plot(runs, out_dir, bits, is_cap)]
    figures += [p.name for p in plot_fp8_kv(runs, summaries, out_dir, bits, is_cap) if p.name not in figures]
    result = {"settings": settings, "cpu": cpu, "variants": summaries, "claims": checks, "figures": figures}
    kept_info = {v: {"cpu": k["cpu"]} for v, k in kept.items()}
    if kept:
        result["kept_arms"] = kept_info
    text = markdown(summaries, checks, settings, cpu, bits, kept_info)
    if long_runs is not None:
        result["long_horizon"] = build_long_horizon(long_runs, variants, out_dir)
        text += "\n" + long_markdown(result["long_horizon"], result["long_horizon"]["settings"]["weight_bits"])
    elif "long_horizon" in previous:  # the long runs are separate: their section stays as it was written
        result["long_horizon"] = previous["long_horizon"]
        marker = "\n" + LONG_SECTION + "\n"
        text += "\n" + (LONG_SECTION + "\n" + previous_md.split(marker, 1)[1] if marker in previous_md
                        else long_markdown(previous["long_horizon"], previous["long_horizon"]["settings"]["weight_bits"]))
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, sort_keys=True, default=float) + "\n")
    (out_dir / "results.md").write_text(text)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Tables, claims and figures of the GRPO study.")
    ap.add_argument("--runs", type=Path, default=None,
                    help="runs folder of the 200-step study; without it, --long-runs updates the report in --out")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--variants", nargs="+", default=list(VARIANT_LABELS))
    ap.add_argument("--long-runs", type=Path, default=None,
                    help="runs folder of the long-horizon study (>= 600 steps); adds its section to the report")
    a = ap.parse_args(argv)
    if a.runs is None and a.long_runs is None:
        ap.error("give --runs (the 200-step study), --long-runs (the long horizon) or both")
    if a.runs is None:
        result = add_long_horizon(a.long_runs, a.variants, a.out)
    else:
        result = build_report(a.runs, a.variants, a.out, long_runs=a.long_runs)
    for c in result["claims"]:
        print(f"[report] {c['claim']}: {c['verdict']} ({c['measure']})")
    for c in result.get("long_horizon", {}).get("verdicts", []):
        print(f"[report] long horizon: {c['claim']}: {c['verdict']} ({c['measure']})")


if __name__ == "__main__":
    main()
