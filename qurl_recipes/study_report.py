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
from pathlib import Path

from qurl_recipes.study_claims import claim_checks
from qurl_recipes.study_figures import plot, plot_fp8_kv, plot_long
from qurl_recipes.study_long_horizon import (
    DRIFT_FACTOR,
    LONG_BASE,
    LONG_MIN_STEPS,
    LONG_SECTION,
    LONG_WINDOW,
    long_horizon_checks,
    long_seed_statistics,
    long_variant_summary,
)
from qurl_recipes.study_statistics import SIGNIFICANCE, VARIANT_LABELS, seed_statistics, variant_summary
from qurl_recipes.study_tables import long_markdown, markdown


def load_runs(runs_dir: Path, variants: list[str]) -> dict[str, dict[int, tuple[list[dict], dict]]]:
    """variant -> seed -> (per-step records, run.json) for every finished run under ``runs_dir``."""
    out: dict[str, dict[int, tuple[list[dict], dict]]] = {}
    for variant in variants:
        for summary in sorted((runs_dir / variant).glob("seed*/run.json")):
            run = json.loads(summary.read_text())
            rows = [json.loads(line) for line in (summary.parent / "metrics.jsonl").read_text().splitlines() if line]
            out.setdefault(variant, {})[run["seed"]] = (rows, run)
    return out


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
