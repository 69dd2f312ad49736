"""Plots, table and claim checks of the small-scale reproduction (recipes/tiny_cpu/report).

Reads verl's file-logger metrics of one GRPO run per variant and writes one PNG per metric (all
variants overlaid), `results.md` (table + the paper's claims checked against this run's numbers)
and `results.json`. Every number in the report is computed here from the metrics files, so the
report regenerates exactly from the runs. Pure Python + matplotlib: no verl or vLLM import.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from qurl_recipes.run_summary import read_metrics

VARIANT_LABELS = {
    "bf16": "BF16 rollout (reference)",
    "naive_int8": "naive INT8 (Eq. 3)",
    "tis_int8": "INT8 + TIS",
    "int8_no_uaq": "INT8 + ACR, no UAQ",
    "int8": "INT8 + ACR + UAQ (QuRL)",
}
# one colour per variant in every figure, whichever variants a figure has data for
VARIANT_COLORS = {"bf16": "tab:blue", "naive_int8": "tab:orange", "tis_int8": "tab:green",
                  "int8_no_uaq": "tab:red", "int8": "tab:purple"}

# figure name -> (candidate metric keys, first present wins; y label; log y?)
CURVES = {
    "reward": (("critic/score/mean",), "train reward = sampled accuracy", False),
    "val_accuracy": ((), "validation accuracy (greedy, rollout engine)", False),
    "mismatch_kl": (("actor/qurl/kl_behav_prox_k3", "rollout_corr/k3_kl"), "KL(behav || prox), k3", True),
    "max_w": (("actor/qurl/w_max", "rollout_corr/rollout_is_max"), "max w = pi_prox / pi_behav", True),
    "changed_code_frac": (("actor/qurl/update/changed_code_frac",), "share of INT8 codes changed by the step", False),
    "update_to_error": (("actor/qurl/update/update_to_error_ratio",), "|dW| / |Q(W) - W| per step", True),
    "clipfrac": (("actor/pg_clipfrac",), "PPO clip fraction", False),
}
STEP_TIME = "timing_s/step"
GEN_TIME = "timing_s/gen"
SYNC_TIME = "actor/qurl/sync/total_s"
SMOOTH = 5  # moving-average window for noisy per-step curves


def val_accuracy_key(row: dict) -> str | None:
    """verl logs validation as val-core/<data_source>/<reward key>/mean@<n>; take the `acc` one."""
    keys = sorted(k for k in row if k.startswith("val-core/") and "/acc/" in k)
    return keys[0] if keys else None


def series(rows: list[dict], keys: tuple[str, ...]) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in rows:
        for k in keys:
            v = r.get(k)
            if isinstance(v, (int, float)) and math.isfinite(v):
                steps.append(r["step"])
                values.append(float(v))
                break
    return steps, values


def val_series(rows: list[dict]) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in rows:
        k = val_accuracy_key(r)
        if k is not None:
            steps.append(r["step"])
            values.append(float(r[k]))
    return steps, values


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (0 for fewer than two values)."""
    if not values:
        return float("nan"), float("nan")
    m = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return m, se


def summarize_run(rows: list[dict], tail: int = 10) -> dict:
    """One variant's table row: start/end reward, accuracy, mismatch, code changes, times."""
    train = [r for r in rows if "critic/score/mean" in r]
    if not train:
        raise ValueError("no training step with a reward was logged")
    _, reward = series(train, CURVES["reward"][0])
    _, val = val_series(rows)
    _, kl = series(train, CURVES["mismatch_kl"][0])
    _, w = series(train, CURVES["max_w"][0])
    _, codes = series(train, CURVES["changed_code_frac"][0])
    _, clip = series(train, CURVES["clipfrac"][0])
    _, u2e = series(train, CURVES["update_to_error"][0])
    # the first step carries start-up work (compilation, first sync), so times skip it; medians,
    # since a step that shares the CPU with another job can stall for many seconds
    timed = train[1:] or train
    step_s = [r[STEP_TIME] for r in timed if STEP_TIME in r]
    gen_s = [r[GEN_TIME] for r in timed if GEN_TIME in r]
    sync_s = [r[SYNC_TIME] for r in timed if SYNC_TIME in r]
    head_m, head_se = mean_and_se(reward[:tail])
    tail_m, tail_se = mean_and_se(reward[-tail:])
    half = len(kl) // 2
    return {
        "steps": len(train),
        "reward_first": head_m, "reward_first_se": head_se,
        "reward_last": tail_m, "reward_last_se": tail_se,
        "val_acc_start": val[0] if val else None,
        "val_acc_end": val[-1] if len(val) > 1 else None,
        "kl_mean": statistics.fmean(kl) if kl else None,
        "kl_first_half": statistics.fmean(kl[:half]) if half else None,
        "kl_second_half": statistics.fmean(kl[half:]) if half else None,
        "w_max": max(w) if w else None,
        "clipfrac_mean": statistics.fmean(clip) if clip else None,
        "changed_code_frac_mean": statistics.fmean(codes) if codes else None,
        "update_to_error_mean": statistics.fmean(u2e) if u2e else None,
        "step_s_median": statistics.median(step_s) if step_s else None,
        "gen_s_median": statistics.median(gen_s) if gen_s else None,
        "sync_s_median": statistics.median(sync_s) if sync_s else None,
    }


def _diff(a: dict, b: dict) -> tuple[float, float]:
    """End-reward difference a - b and its standard error (independent runs)."""
    return a["reward_last"] - b["reward_last"], math.hypot(a["reward_last_se"], b["reward_last_se"])


def claim_checks(s: dict[str, dict]) -> list[dict]:
    """The paper's mechanisms (spec §2.1, §3.1, §5.6), each tested on this run's numbers.

    A difference counts only beyond two standard errors of the end-of-run reward means; within
    that, the check says the run cannot tell.
    """
    checks = []

    def verdict(d: float, se: float, want_negative: bool) -> str:
        if abs(d) <= 2 * se:
            return "not reproduced (within noise)"
        return "reproduced" if (d < 0) == want_negative else "opposite"

    if {"naive_int8", "bf16"} <= s.keys():
        d, se = _diff(s["naive_int8"], s["bf16"])
        checks.append({"claim": "naive quantized rollout degrades vs BF16",
                       "measure": f"end reward naive_int8 - bf16 = {d:+.3f} ± {se:.3f}", "verdict": verdict(d, se, True)})
    if {"tis_int8", "int8_no_uaq"} <= s.keys():
        d, se = _diff(s["tis_int8"], s["int8_no_uaq"])
        checks.append({"claim": "TIS alone drifts where ACR stays stable",
                       "measure": f"end reward tis_int8 - int8_no_uaq = {d:+.3f} ± {se:.3f}", "verdict": verdict(d, se, True)})
    if "tis_int8" in s and s["tis_int8"]["kl_first_half"]:
        t = s["tis_int8"]
        ratio = t["kl_second_half"] / t["kl_first_half"]
        checks.append({"claim": "KL(behav || prox) grows over training under TIS",
                       "measure": f"tis_int8 KL k3 second half / first half = {ratio:.2f}",
                       "verdict": "reproduced" if ratio > 2 else "not reproduced"})
    if {"int8", "int8_no_uaq"} <= s.keys() and s["int8_no_uaq"]["changed_code_frac_mean"]:
        ratio = s["int8"]["changed_code_frac_mean"] / s["int8_no_uaq"]["changed_code_frac_mean"]
        u_uaq, u_no = s["int8"]["update_to_error_mean"], s["int8_no_uaq"]["update_to_error_mean"]
        u2e = f"; update-to-error ratio int8 / int8_no_uaq = {u_uaq / u_no:.2f}" if u_uaq and u_no else ""
        checks.append({"claim": "UAQ makes more weight updates visible to the quantizer",
                       "measure": f"changed-code share int8 / int8_no_uaq = {ratio:.2f}{u2e}",
                       "verdict": "reproduced" if ratio > 1.05 else "not reproduced"})
    if {"int8", "int8_no_uaq", "bf16"} <= s.keys():
        gap_uaq, se_uaq = _diff(s["int8"], s["bf16"])
        gap_no, se_no = _diff(s["int8_no_uaq"], s["bf16"])
        closer = abs(gap_uaq) < abs(gap_no)
        noisy = max(abs(gap_uaq), abs(gap_no)) <= 2 * max(se_uaq, se_no)
        checks.append({"claim": "UAQ closes the gap to BF16",
                       "measure": f"end reward gap to bf16: int8 {gap_uaq:+.3f} ± {se_uaq:.3f}, "
                                  f"int8_no_uaq {gap_no:+.3f} ± {se_no:.3f}",
                       "verdict": "not reproduced (within noise)" if noisy else ("reproduced" if closer else "opposite")})
    return checks


def plot_curves(runs: dict[str, list[dict]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, (keys, ylabel, logy) in CURVES.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        drawn = False
        for variant, rows in runs.items():
            steps, values = val_series(rows) if name == "val_accuracy" else series(rows, keys)
            if logy:
                steps, values = zip(*[(x, y) for x, y in zip(steps, values) if y > 0]) if any(v > 0 for v in values) else ((), ())
                steps, values = list(steps), list(values)
            if not values:
                continue
            drawn = True
            label = VARIANT_LABELS.get(variant, variant)
            color = VARIANT_COLORS.get(variant)
            if name in ("reward", "clipfrac") and len(values) > SMOOTH:
                ax.plot(steps, values, color=color, alpha=0.25, lw=0.8)
                ax.plot(steps, moving_average(values, SMOOTH), color=color, lw=1.8, label=label)
            else:
                ax.plot(steps, values, color=color, marker="o" if len(values) < 12 else None, ms=3, lw=1.5, label=label)
        if not drawn:
            plt.close(fig)
            continue
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        title = ylabel + (f" ({SMOOTH}-step moving average)" if name in ("reward", "clipfrac") else "")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(summaries: dict[str, dict], checks: list[dict], sft: dict | None, figures: list[Path]) -> str:
    lines = ["# Results (generated by `python -m qurl_recipes.repro_report`; do not edit)", ""]
    if sft:
        lines += [f"SFT warm start: {sft['settings']['steps']} steps, greedy accuracy {sft['greedy_acc']:.3f}, "
                  f"sampled (T=1) {sft['sampled_acc_t1']:.3f}, any of 4 samples correct {sft['any_of_4_correct_t1']:.3f} "
                  f"(on {sft['settings']['eval_prompts']} held-out questions).", ""]
    lines += [
        "| variant | steps | reward, first 10 | reward, last 10 | val acc start → end | mean KL k3 | max w | "
        "mean clipfrac | changed codes / step | step s | gen s | sync s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, s in summaries.items():
        lines.append(
            f"| {VARIANT_LABELS.get(v, v)} | {s['steps']} | {s['reward_first']:.3f} ± {s['reward_first_se']:.3f} | "
            f"{s['reward_last']:.3f} ± {s['reward_last_se']:.3f} | {_fmt(s['val_acc_start'], '.3f')} → "
            f"{_fmt(s['val_acc_end'], '.3f')} | {_fmt(s['kl_mean'], '.2e')} | {_fmt(s['w_max'], '.3f')} | "
            f"{_fmt(s['clipfrac_mean'], '.4f')} | {_fmt(s['changed_code_frac_mean'], '.3f')} | "
            f"{_fmt(s['step_s_median'], '.2f')} | {_fmt(s['gen_s_median'], '.2f')} | {_fmt(s['sync_s_median'], '.3f')} |"
        )
    lines += ["", "Rewards are means over steps ± their standard error; times are medians over steps 2..N.", "",
              "## The paper's claims, checked on this run", "", "| claim | measured | verdict |", "|---|---|---|"]
    lines += [f"| {c['claim']} | {c['measure']} | {c['verdict']} |" for c in checks]
    lines += ["", "## Figures", ""] + [f"![{p.stem}]({p.name})" for p in figures]
    return "\n".join(lines) + "\n"


def build_report(runs_dir: Path, variants: list[str], out_dir: Path, sft_record: Path | None = None) -> dict:
    runs = {}
    for v in variants:
        path = runs_dir / v / "metrics.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"variant {v!r} has no metrics at {path}; run recipes/tiny_cpu/report/run.sh first")
        runs[v] = read_metrics(path)
    summaries = {v: summarize_run(rows) for v, rows in runs.items()}
    checks = claim_checks(summaries)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = plot_curves(runs, out_dir)
    sft = json.loads(sft_record.read_text()) if sft_record and sft_record.exists() else None
    (out_dir / "results.md").write_text(markdown(summaries, checks, sft, figures))
    result = {"variants": summaries, "claims": checks, "sft": sft, "figures": [p.name for p in figures]}
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, type=Path, help="folder with one <variant>/metrics.jsonl per variant")
    ap.add_argument("--variants", nargs="+", default=list(VARIANT_LABELS))
    ap.add_argument("--sft", type=Path, default=None, help="qurl_tiny_sft.json of the warm start")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    result = build_report(a.runs, a.variants, a.out, a.sft)
    print((a.out / "results.md").read_text())
    print(f"[report] {len(result['figures'])} figures and results.md/json written to {a.out}")


if __name__ == "__main__":
    main()
