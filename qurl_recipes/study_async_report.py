"""The staleness x quantization report: per-arm tables, a verdict per claim, figures.

Reads the runs ``qurl_recipes.study_async`` wrote (each arm's lr and staleness from its ``run.json``),
summarises seeds as the GRPO study does (``study_statistics``: mean and standard error, accuracies floored
at their binomial error) and writes ``results.md``, ``results.json`` and the figures to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from qurl_recipes.repro_report import moving_average
from qurl_recipes.study_claims import FINAL_ACCURACY
from qurl_recipes.study_statistics import (
    SIGNIFICANCE,
    SMOOTH,
    VARIANT_LABELS,
    beyond_noise,
    difference,
    fmt_difference,
    mean_se,
    seed_statistics,
    train_rows,
    variant_summary,
)
from qurl_recipes.study_tables import cell, cpu_name

# the mismatch's parts (StudyRun.mismatch_parts), averaged over the steps at the arm's full staleness
PARTS = ("kl_total", "kl_staleness", "kl_quantization")
PRECISION = {"bf16_tis": "bf16", "bf16_acr": "bf16", "tis": "quantized", "acr_no_uaq": "quantized"}
CORRECTION = {"bf16_tis": "tis", "bf16_acr": "acr", "tis": "tis", "acr_no_uaq": "acr"}
SAME_CORRECTION_BF16 = {"tis": "bf16_tis", "acr_no_uaq": "bf16_acr"}
# a growth ratio within this factor of (lr x updates)^2's counts as quadratic
QUADRATIC_WITHIN = 1.5
# a total within this share of the sum of its parts counts as adding up, whatever the seeds' spread
ADDS_WITHIN = 0.1


def arm_key(lr: float, staleness: int, variant: str) -> str:
    return f"lr{lr:g}/staleness{staleness}/{variant}"


def load_arms(runs_dir: Path) -> dict[str, dict]:
    """arm key -> {"lr", "staleness", "variant", "seeds": {seed: (rows, run.json)}} for every finished run."""
    arms: dict[str, dict] = {}
    for summary in sorted(runs_dir.glob("lr*/staleness*/*/seed*/run.json")):
        run = json.loads(summary.read_text())
        s = run["settings"]
        rows = [json.loads(line) for line in (summary.parent / "metrics.jsonl").read_text().splitlines() if line]
        arm = arms.setdefault(arm_key(s["lr"], s.get("staleness", 0), run["variant"]),
                              {"lr": s["lr"], "staleness": s.get("staleness", 0), "variant": run["variant"],
                               "seeds": {}})
        arm["seeds"][run["seed"]] = (rows, run)
    if not arms:
        raise SystemExit(f"no finished runs under {runs_dir}")
    return arms


def _shared_settings(arms: dict[str, dict]) -> dict:
    """The settings every run shares, lr and staleness aside (refuses a mix: the arms are compared as equals)."""
    common = None
    for key, arm in arms.items():
        for seed, (_, run) in arm["seeds"].items():
            s = {k: v for k, v in run["settings"].items() if k not in ("lr", "staleness")}
            if common is None:
                common = s
            elif s != common:
                raise SystemExit(f"{key} seed {seed} ran with other settings than the rest; rerun it or remove it")
    return common


def async_seed_statistics(rows: list[dict], settings: dict) -> dict:
    """One seed's study statistics plus the mismatch's parts and the share of tokens with w > C over the
    steps at the arm's full staleness (the first ``staleness`` steps roll out with the start's weights)."""
    out = seed_statistics(rows, settings["is_cap"], settings.get("max_grad_norm", 1.0))
    full = [r for r in train_rows(rows) if r.get("staleness", 0) == settings.get("staleness", 0)]
    for key in PARTS:
        values = [r[key] for r in full if key in r]
        out[key] = statistics.fmean(values) if values else float("nan")
    out["w_frac_above_c_stale"] = statistics.fmean(r["w_frac_above_c"] for r in full) if full else float("nan")
    # KL does not add: how the measured total compares with the sum of its parts, per seed
    out["kl_total_minus_parts"] = out["kl_total"] - out["kl_staleness"] - out["kl_quantization"]
    return out


def summarise(arms: dict[str, dict], settings: dict) -> dict[str, dict]:
    questions = {"val": settings.get("n_val", 0), "train": settings.get("n_train", 0)}
    out = {}
    for key, arm in arms.items():
        per_seed = {seed: async_seed_statistics(rows, run["settings"]) for seed, (rows, run) in arm["seeds"].items()}
        summary = variant_summary(per_seed, questions if all(questions.values()) else None)
        for k in (*PARTS, "w_frac_above_c_stale", "kl_total_minus_parts"):
            summary[k], summary[f"{k}_se"] = mean_se([s[k] for s in per_seed.values()])
        out[key] = {"lr": arm["lr"], "staleness": arm["staleness"], "variant": arm["variant"], **summary}
    return out


def _verdict_size(d: float, se: float, more: str, less: str, same: str) -> str:
    if not beyond_noise(d, se):
        return same if not math.isnan(se) else f"{same} (one seed: no noise estimate)"
    return more if d > 0 else less


def claim_checks(s: dict[str, dict]) -> list[dict]:
    """The issue's questions, per learning rate and staleness where they apply, each with its verdict."""
    checks = []

    def add(claim, measure, verdict):
        checks.append({"claim": claim, "measure": measure, "verdict": verdict})

    def get(lr, k, v):
        return s.get(arm_key(lr, k, v))

    lrs = sorted({a["lr"] for a in s.values()})
    stale_ks = sorted({a["staleness"] for a in s.values() if a["staleness"] > 0})
    # staleness's KL against the weights' movement: about (lr x updates)^2 for small steps, checked in each factor
    growth: dict[str, list] = {"updates": [], "learning rate": []}
    low, high = (lrs[0], lrs[-1]) if len(lrs) > 1 else (None, None)

    def grew(factor, what, big, small, want):
        if big and small and small["kl_staleness"] > 0:
            growth[factor].append((what, big["kl_staleness"] / small["kl_staleness"], want))

    if low:
        grew("learning rate", f"lr ×{high / low:g} at staleness 1", get(high, 1, "tis"), get(low, 1, "tis"),
             (high / low) ** 2)
    for lr in lrs:
        for k in stale_ks[1:]:
            grew("updates", f"staleness 1 → {k} at lr {lr:g}", get(lr, k, "tis"), get(lr, 1, "tis"), k ** 2)
    for factor, found in growth.items():
        if found:
            within = all(1 / QUADRATIC_WITHIN <= got / want <= QUADRATIC_WITHIN for _, got, want in found)
            add(f"staleness's KL grows as the square of the {factor}, W{{b}}A8 + TIS",
                "; ".join(f"{what}: ×{got:.1f} (quadratic: ×{want:g})" for what, got, want in found),
                f"yes, within ×{QUADRATIC_WITHIN:g} of quadratic" if within else
                f"no: not within ×{QUADRATIC_WITHIN:g} of quadratic")
    for lr in lrs:
        stale_bf16, quant_fresh = get(lr, 1, "bf16_tis"), get(lr, 0, "tis")
        if stale_bf16 and quant_fresh:
            a, b = stale_bf16["kl_staleness"], quant_fresh["kl_quantization"]
            d, se = a - b, math.hypot(stale_bf16["kl_staleness_se"], quant_fresh["kl_quantization_se"])
            add(f"lr {lr:g}: one step of staleness moves the behaviour policy as much as W{{b}}A8 does",
                f"KL staleness part (BF16, staleness 1) {a:.2e} ± {stale_bf16['kl_staleness_se']:.1e}; quantization "
                f"part (W{{b}}A8, staleness 0) {b:.2e} ± {quant_fresh['kl_quantization_se']:.1e}; ratio {a / b:.2f}",
                _verdict_size(d, se, "staleness larger beyond seed noise", "quantization larger beyond seed noise",
                              "the same within seed noise"))
        for k in stale_ks:
            arm = get(lr, k, "tis")
            if arm:
                d, se = arm["kl_total_minus_parts"], arm["kl_total_minus_parts_se"]
                parts = arm["kl_staleness"] + arm["kl_quantization"]
                ratio = arm["kl_total"] / parts
                add(f"lr {lr:g}, staleness {k}: the parts add (total ≈ staleness + quantization), W{{b}}A8 + TIS",
                    f"total {arm['kl_total']:.2e}, staleness + quantization {parts:.2e}, total − sum "
                    f"{fmt_difference(d, se, '.1e')} (ratio {ratio:.2f})",
                    f"add to within {ADDS_WITHIN:.0%}" if abs(ratio - 1) <= ADDS_WITHIN else
                    _verdict_size(d, se, "total above the sum beyond seed noise (they compound)",
                                  "total below the sum beyond seed noise (they partly cancel)", "add within seed noise"))
            for variant in ("bf16_tis", "tis"):
                fresh, stale = get(lr, 0, variant), get(lr, k, variant)
                if not (fresh and stale):
                    continue
                name = VARIANT_LABELS[variant]
                d, se = difference(stale, fresh, "w_frac_above_c_stale")
                da, sea = difference(stale, fresh, FINAL_ACCURACY)
                add(f"lr {lr:g}: staleness {k} raises the share of tokens with w > C, {name}",
                    f"share staleness {k} − 0 {fmt_difference(d, se, '.1e')} ({stale['w_frac_above_c_stale']:.1e} "
                    f"against {fresh['w_frac_above_c_stale']:.1e})",
                    _verdict_size(d, se, "yes, beyond seed noise", "no: lower beyond seed noise",
                                  "no difference beyond seed noise"))
                add(f"lr {lr:g}: staleness {k} costs accuracy, {name}",
                    f"final accuracy staleness {k} − 0 {fmt_difference(da, sea)}",
                    _verdict_size(-da, sea, "yes, beyond seed noise", "no: higher beyond seed noise",
                                  "no difference beyond seed noise"))
            for quantized, bf16 in SAME_CORRECTION_BF16.items():
                q, b = get(lr, k, quantized), get(lr, k, bf16)
                if q and b:
                    d, se = difference(q, b, FINAL_ACCURACY)
                    add(f"lr {lr:g}, staleness {k}: quantized rollout still pays off ({VARIANT_LABELS[quantized]} "
                        f"reaches {VARIANT_LABELS[bf16]}'s accuracy)",
                        f"final accuracy W{{b}}A8 − BF16 {fmt_difference(d, se)}",
                        _verdict_size(d, se, "yes: above BF16 beyond seed noise", "no: below BF16 beyond seed noise",
                                      "yes, within seed noise"))
            tis, acr, tis_fresh = get(lr, k, "tis"), get(lr, k, "acr_no_uaq"), get(lr, 0, "tis")
            if tis and acr:
                d, se = difference(acr, tis, FINAL_ACCURACY)
                share = tis["w_frac_above_c_stale"]
                tis_degrades = bool(tis_fresh) and (lambda dd, ss: dd < 0 and beyond_noise(dd, ss))(
                    *difference(tis, tis_fresh, FINAL_ACCURACY))
                if share == 0:
                    verdict = "not testable (no w > C: ACR is TIS)"
                elif d > 0 and beyond_noise(d, se):
                    verdict = "reproduced: ACR above TIS beyond seed noise"
                elif not tis_degrades:
                    verdict = "not testable (TIS holds under this staleness; ACR and TIS agree within noise)" \
                        if not beyond_noise(d, se) else "not reproduced: ACR below TIS beyond seed noise"
                else:
                    verdict = "not reproduced"
                add(f"lr {lr:g}, staleness {k}: ACR holds a stale W{{b}}A8 rollout where TIS does not",
                    f"final accuracy ACR − TIS {fmt_difference(d, se)}; tokens with w > C (TIS) {share:.1e}; "
                    f"TIS below its staleness-0 accuracy beyond noise: {'yes' if tis_degrades else 'no'}", verdict)
    return checks


def markdown(s: dict[str, dict], checks: list[dict], settings: dict, cpu: dict, bits: int) -> str:
    lines = [
        "# Staleness x quantization: results (generated by `python -m qurl_recipes.study_async_report`)",
        "",
        f"Weight bits {bits}, {settings['steps']} steps, {settings['prompts_per_step']} prompts × "
        f"{settings['group_size']} samples, {settings['mini_batches']} updates per rollout, C = {settings['is_cap']:g}. "
        f"CPU: {cpu_name(cpu)}. Values: mean ± standard error across seeds; the KL parts and the share of "
        "tokens with w > C over the steps at the arm's full staleness. KL parts (exact over the vocabulary at the "
        "positions the rollout visited): staleness = KL(BF16 copy of the rollout's weights ‖ BF16 copy of the "
        "current ones), quantization = KL(rollout policy ‖ BF16 copy of its own weights), total = "
        "KL(rollout policy ‖ fp32 current). Differences count beyond seed noise above "
        f"{SIGNIFICANCE:g} standard errors.",
        "",
        "| lr | staleness | rollout | correction | seeds | KL total | KL staleness | KL quantization | total / sum "
        "| tokens with w > C | max w | reward last | train acc end | val acc end | step s |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in sorted(s, key=lambda k: (s[k]["lr"], s[k]["staleness"], PRECISION[s[k]["variant"]] != "bf16",
                                        CORRECTION[s[k]["variant"]])):
        a = s[key]
        parts = a["kl_staleness"] + a["kl_quantization"]
        ratio = f"{a['kl_total'] / parts:.2f}" if parts > 0 else "n/a"
        rollout = "BF16" if PRECISION[a["variant"]] == "bf16" else f"W{bits}A8"
        lines.append(
            f"| {a['lr']:g} | {a['staleness']} | {rollout} | {CORRECTION[a['variant']].upper()} | {len(a['seeds'])} | "
            f"{cell(a['kl_total'], a['kl_total_se'], '.2e')} | {cell(a['kl_staleness'], a['kl_staleness_se'], '.2e')} | "
            f"{cell(a['kl_quantization'], a['kl_quantization_se'], '.2e')} | {ratio} | "
            f"{cell(a['w_frac_above_c_stale'], a['w_frac_above_c_stale_se'], '.1e')} | {a['w_max']:.2f} | "
            f"{cell(a['reward_last'], a['reward_last_se'], '.3f')} | "
            f"{cell(a['train_acc_full_last'], a['train_acc_full_last_se'], '.3f')} | "
            f"{cell(a['val_acc_full_last'], a['val_acc_full_last_se'], '.3f')} | {a['step_s']:.2f} |")
    lines += ["", "| claim | measure | verdict |", "|---|---|---|"]
    lines += [f"| {c['claim'].format(b=bits)} | {c['measure'].format(b=bits)} | {c['verdict']} |" for c in checks]
    return "\n".join(lines) + "\n"


def plot(arms: dict[str, dict], s: dict[str, dict], out_dir: Path, bits: int) -> list[Path]:
    """Two figures: the KL parts per arm (bars, log scale) above the final accuracy, and the parts per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = sorted(s, key=lambda k: (s[k]["lr"], s[k]["staleness"], PRECISION[s[k]["variant"]] != "bf16",
                                    CORRECTION[s[k]["variant"]]))
    labels = [f"lr {s[k]['lr']:g}\nk={s[k]['staleness']}\n"
              f"{'BF16' if PRECISION[s[k]['variant']] == 'bf16' else f'W{bits}A8'} "
              f"{CORRECTION[s[k]['variant']].upper()}" for k in keys]
    x = np.arange(len(keys))
    fig, (ax_kl, ax_acc) = plt.subplots(2, 1, figsize=(max(8.0, 0.75 * len(keys)), 7.5), dpi=110, sharex=True)
    for i, (part, color) in enumerate((("kl_staleness", "tab:blue"), ("kl_quantization", "tab:orange"),
                                       ("kl_total", "tab:gray"))):
        drawn = [j for j, k in enumerate(keys) if s[k][part] > 0]  # a part that is 0 by definition has no bar
        values = np.array([s[keys[j]][part] for j in drawn])
        errors = np.array([0.0 if math.isnan(s[keys[j]][f"{part}_se"]) else s[keys[j]][f"{part}_se"] for j in drawn])
        ax_kl.bar(x[drawn] + (i - 1) * 0.27, values, 0.27, yerr=errors, color=color, label=part.replace("kl_", "KL "))
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("KL per response token (exact)")
    ax_kl.legend(fontsize=8)
    ax_kl.set_title("The mismatch's parts: staleness (BF16 stale ‖ BF16 current), quantization "
                    "(rollout ‖ its BF16 copy), total", fontsize=9)
    acc = np.array([s[k][FINAL_ACCURACY] for k in keys])
    acc_se = np.array([0.0 if math.isnan(s[k][f"{FINAL_ACCURACY}_se"]) else s[k][f"{FINAL_ACCURACY}_se"] for k in keys])
    ax_acc.bar(x, acc, 0.6, yerr=acc_se, color=["tab:blue" if PRECISION[s[k]["variant"]] == "bf16" else "tab:red"
                                                for k in keys])
    ax_acc.set_ylabel("final training-question accuracy\n(greedy, trained fp32 weights)")
    ax_acc.set_xticks(x, labels, fontsize=7)
    fig.tight_layout()
    written = [out_dir / "staleness_quantization.png"]
    fig.savefig(written[0])
    plt.close(fig)

    # the parts per step of the TIS arms (moving average over SMOOTH steps, mean over seeds): staleness's grows
    # with lr and k, quantization's stays where it starts
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.0), dpi=110, sharey=True)
    shades = {}
    for key in (k for k in keys if CORRECTION[s[k]["variant"]] == "tis"):
        a = s[key]
        style = "--" if PRECISION[a["variant"]] == "bf16" else "-"
        color = shades.setdefault((a["lr"], a["staleness"]), f"C{len(shades)}")
        label = labels[keys.index(key)].replace("\n", " ")
        for ax, part in zip(axes, ("kl_staleness", "kl_quantization")):
            curves = [[r[part] for r in train_rows(rows)] for rows, _ in arms[key]["seeds"].values()]
            n = min(len(c) for c in curves)
            mean = np.array([c[:n] for c in curves], dtype=float).mean(0)
            if mean.max() > 0:
                ax.plot(range(n), moving_average(list(mean), SMOOTH), style, color=color, lw=1.2, label=label)
    for ax, title in zip(axes, ("staleness part", "quantization part")):
        ax.set_yscale("log")
        ax.set_xlabel("GRPO step")
        ax.set_title(f"{title} (TIS arms; {SMOOTH}-step moving average, mean over seeds)", fontsize=8)
    axes[0].set_ylabel("KL per response token (exact)")
    axes[0].legend(fontsize=6)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    written.append(out_dir / "kl_parts_per_step.png")
    fig.savefig(written[1])
    plt.close(fig)
    return written


def build_report(runs_dir: Path, out_dir: Path) -> dict:
    arms = load_arms(runs_dir)
    settings = _shared_settings(arms)
    first_run = next(iter(next(iter(arms.values()))["seeds"].values()))[1]
    summaries = summarise(arms, settings)
    checks = claim_checks(summaries)
    out_dir.mkdir(parents=True, exist_ok=True)
    bits = settings["weight_bits"]
    figures = plot(arms, summaries, out_dir, bits)
    result = {"settings": settings, "cpu": first_run["cpu"], "significance": SIGNIFICANCE, "arms": summaries,
              "claims": checks, "figures": [p.name for p in figures]}
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, sort_keys=True, default=float) + "\n")
    (out_dir / "results.md").write_text(markdown(summaries, checks, settings, first_run["cpu"], bits))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Tables, verdicts and figures of the staleness x quantization study.")
    ap.add_argument("--runs", required=True, type=Path, help="OUT/runs of recipes/tiny_cpu/study_async/run.sh")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    result = build_report(a.runs, a.out)
    for c in result["claims"]:
        print(f"[study-async] {c['claim']}: {c['verdict']}")


if __name__ == "__main__":
    main()
