"""The long-horizon part of the GRPO study (runs of >= 600 steps, in 100-step windows): statistics and checks."""
from __future__ import annotations

import math
import statistics

from qurl_recipes.study_statistics import SIGNIFICANCE, beyond_noise, difference, fmt_difference, mean_se, train_rows

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
    values = [r[key] for r in train_rows(rows) if start <= r["step"] < end and r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def long_seed_statistics(rows: list[dict], width: int = LONG_WINDOW) -> dict:
    """One seed's window means, its evaluations at multiples of ``width``, and the verdict windows."""
    end = max(r["step"] for r in train_rows(rows)) + 1  # the final row (step == steps) is evaluation only
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


def window_name(w) -> str:
    return f"{w[0]}–{w[1]}"


def long_horizon_checks(s: dict[str, dict]) -> list[dict]:
    """Fig. 3's two claims on the long runs, each with its measure, numbers and verdict (2-SE rule)."""
    checks = []
    base = window_name(LONG_BASE)
    tis = s.get("tis")
    values: dict = {}
    if tis is None:
        verdict, measure = "not testable (no TIS runs)", "n/a"
    elif tis["steps"] < LONG_MIN_STEPS:
        verdict = (f"not testable (runs have {tis['steps']} steps; at least {LONG_MIN_STEPS} are needed for a "
                   f"{LONG_WINDOW}-step window after step {LONG_BASE[1]})")
        measure = "n/a"
    else:
        late = window_name(tis["late_window"])
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
                   f"{tis['kl_base']:.2e} ± {tis['kl_base_se']:.2e}; late − {base} {fmt_difference(rise, rise_se, '.2e')}; "
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
            measure = (f"late-window KL {variant} − TIS {fmt_difference(dk, sek, '.2e')}; {variant} reward "
                       f"{window_name(acr['late_window'])} − {base} {fmt_difference(dr, ser)}")
        checks.append({"claim": claim, "measure": measure, "verdict": verdict, "values": values})
    return checks
