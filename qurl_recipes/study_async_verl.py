"""Summary of the staleness x quantization runs through verl itself (recipes/tiny_cpu/study_async/verl_runs.sh).

Each run is the tiny CPU recipe under ``trainer.v1.trainer_mode=colocate_async``, which keeps a second batch in
flight: a step trains either on rollouts of the policy it updates (staleness 0) or on rollouts generated one
update earlier (staleness 1), as verl's ``trajectory_staleness`` metric reports it step by step. The rollout
mismatch of a stale step carries quantization and staleness together; splitting the steps by that metric and
comparing the ``bf16`` preset (staleness only) with ``int8`` (both) says how much each adds. Pure Python:
reads the ``metrics.jsonl`` verl's file logger writes (one ``{"step": n, "data": {...}}`` line per step) and
the rollout dumps (``trainer.rollout_data_dir``), and imports neither verl nor vLLM.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

from qurl_recipes.study_statistics import beyond_noise, difference, fmt_difference, mean_se, window
from qurl_recipes.study_tables import cell

STALENESS_MEAN = "training/off_policy/trajectory_staleness/mean"
STALENESS_MAX = "training/off_policy/trajectory_staleness/max"
REWARD = "critic/score/mean"
STEP_S = "timing_s/step"
# name in the tables -> the logged key: the rollout mismatch. verl's two KL(pi_rollout || pi_old) estimators (rollout_corr_helper: k1,
# which can cancel below zero on a batch, and k3 = E[r - 1 - log r] >= 0 token by token), qurl's k3 of the
# same quantity from inside the loss, the largest weight w = pi_old / pi_rollout of a step and the share of
# tokens whose w ACR truncates at C. The qurl keys exist only for a preset with the qurl loss (int8, not bf16).
MISMATCH = {"rollout_corr_kl": "rollout_corr/kl", "rollout_corr_k3_kl": "rollout_corr/k3_kl",
            "qurl_kl_k3": "actor/qurl/kl_behav_prox_k3", "qurl_w_max": "actor/qurl/w_max",
            "qurl_w_frac_above_c": "actor/qurl/w_frac_above_c"}
SPLITS = ("stale0", "stale1")  # steps at staleness 0, steps at staleness >= 1
PER_SEED = (*(f"{k}_{s}" for k in MISMATCH for s in SPLITS), *(f"{k}_stale_gain" for k in MISMATCH), "staleness_mean",
            "staleness_max", "reward_first", "reward_last", "first_step_s", "step_s", "wall_s")
COMPARED = ("rollout_corr_kl", "rollout_corr_k3_kl")  # the KLs both presets log: int8 - bf16 in each split
# what verl_runs.sh sets from a run's seed k (the seeds of verl's config that reach this run)
SEED_KEYS = ("data.seed", "actor_rollout_ref.rollout.seed", "actor_rollout_ref.actor.data_loader_seed",
             "actor_rollout_ref.actor.fsdp_config.seed")
NAN = float("nan")


def read_run(folder: Path, steps: int) -> list[dict]:
    """The run's per-step rows, steps 1..``steps``, refused with the missing steps named if any is absent (a
    run cut short would otherwise pass for a shorter one)."""
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no metrics file (the run did not start or wrote elsewhere)")
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if STEP_S in rec["data"]:  # a training step (not a validation row)
                rows[rec["step"]] = {"step": rec["step"], **rec["data"]}
    missing = [s for s in range(1, steps + 1) if s not in rows]
    if missing:
        raise ValueError(f"{path}: {len(rows)} of {steps} steps logged, missing steps {_ranges(missing)}")
    return [rows[s] for s in range(1, steps + 1)]


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 2 and steps[-1] - steps[0] == len(steps) - 1 else str(steps)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else NAN


def run_statistics(rows: list[dict], wall_s: float = NAN) -> dict:
    """One run's numbers. A step counts as stale when any of its trajectories is (max staleness >= 1)."""
    stale = [r for r in rows if r[STALENESS_MAX] >= 1]
    fresh = [r for r in rows if r[STALENESS_MAX] == 0]
    out: dict = {"steps": len(rows), "steps_stale0": len(fresh), "steps_stale1": len(stale),
                 # the per-step series, for figures: staleness, each mismatch quantity logged, the reward
                 "by_step": {"staleness": [r[STALENESS_MAX] for r in rows], "reward": [r[REWARD] for r in rows],
                             **{name: [r[key] for r in rows] for name, key in MISMATCH.items() if key in rows[0]}}}
    for name, key in MISMATCH.items():
        for split, part in zip(SPLITS, (fresh, stale), strict=True):
            out[f"{name}_{split}"] = _mean([r[key] for r in part if key in r])
        out[f"{name}_stale_gain"] = out[f"{name}_stale1"] - out[f"{name}_stale0"]
    w = window(len(rows))
    out.update(staleness_mean=_mean([r[STALENESS_MEAN] for r in rows]),
               staleness_max=max(r[STALENESS_MAX] for r in rows),
               reward_first=_mean([r[REWARD] for r in rows[:w]]), reward_last=_mean([r[REWARD] for r in rows[-w:]]),
               # step 1 carries the engine's first generation (warm-up); the steady per-step time is the rest
               first_step_s=rows[0][STEP_S], step_s=_mean([r[STEP_S] for r in rows[1:]]), wall_s=wall_s)
    return out


def prompts_by_step(folder: Path, steps: int) -> list[list[str]] | None:
    """Each step's prompts (sorted, one per GRPO group) from verl's rollout dump; None without a dump."""
    dump = Path(folder) / "rollouts"
    if not all((dump / f"{s}.jsonl").is_file() for s in range(1, steps + 1)):
        return None
    return [sorted({json.loads(line)["input"] for line in (dump / f"{s}.jsonl").read_text().splitlines() if line})
            for s in range(1, steps + 1)]


def _compare(a: list[list[str]], b: list[list[str]]) -> dict:
    """Steps with the same prompts, and the share of the run's prompts the two runs have in common. In
    colocate_async a step trains on the first groups to finish, so the same prompt stream can be cut into
    steps differently: the share says whether the stream is the same."""
    common = Counter(p for step in a for p in step) & Counter(p for step in b for p in step)
    return {"same_steps": sum(x == y for x, y in zip(a, b, strict=True)),
            "shared_prompts": sum(common.values()) / max(1, sum(map(len, a)))}


def data_order(order: dict[str, dict[int, list[list[str]] | None]]) -> dict:
    """The same seed under both presets (should share its prompt stream), and two seeds under one preset
    (should share only what a random draw of the training set would)."""
    presets, seeds = list(order), sorted({s for runs in order.values() for s in runs})
    out = {}
    for seed in seeds:
        for p, q in zip(presets, presets[1:], strict=False):
            if order[p].get(seed) and order[q].get(seed):
                out[f"seed {seed}: {p} vs {q}"] = _compare(order[p][seed], order[q][seed])
    for p in presets:
        for a, b in zip(seeds, seeds[1:], strict=False):
            if order[p].get(a) and order[p].get(b):
                out[f"{p}: seed {a} vs {b}"] = _compare(order[p][a], order[p][b])
    return out


def preset_summary(per_seed: dict[int, dict]) -> dict:
    out: dict = {"seeds": sorted(per_seed)}
    for key in PER_SEED:
        out[key], out[f"{key}_se"] = mean_se([s[key] for s in per_seed.values()])
    return out


def summarize(root: Path, presets: list[str], seeds: list[int], steps: int, task: str = "arithmetic") -> dict:
    runs, order = {}, {}
    for preset in presets:
        runs[preset], order[preset] = {}, {}
        for seed in seeds:
            folder = Path(root) / preset / f"seed{seed}"
            wall = folder / "wall_s"
            stats = run_statistics(read_run(folder, steps), float(wall.read_text()) if wall.is_file() else NAN)
            runs[preset][seed] = stats
            order[preset][seed] = prompts_by_step(folder, steps)
    summary = {p: preset_summary(runs[p]) for p in presets}
    diffs = {}
    if "bf16" in summary and "int8" in summary:
        for key in (f"{name}_{split}" for name in COMPARED for split in reversed(SPLITS)):
            d, se = difference(summary["int8"], summary["bf16"], key)
            diffs[key] = {"diff": d, "se": se, "beyond_noise": beyond_noise(d, se)}
    gains = {p: {k: beyond_noise(summary[p][f"{k}_stale_gain"], summary[p][f"{k}_stale_gain_se"]) for k in MISMATCH}
             for p in presets}
    model, flags = _cpu()
    return {"trainer_mode": "colocate_async", "task": task, "steps": steps, "seeds": seeds, "presets": presets,
            "cpu": {"model": model, "class": flags}, "versions": _versions(), "seed_keys": SEED_KEYS, "keys": {**MISMATCH,
            "staleness": [STALENESS_MEAN, STALENESS_MAX], "reward": REWARD, "step_s": STEP_S},
            "runs": {p: {str(s): v for s, v in r.items()} for p, r in runs.items()}, "summary": summary,
            "int8_minus_bf16": diffs, "stale_gain_beyond_noise": gains, "data_order": data_order(order)}


def _cpu() -> tuple[str, str]:
    from qurl_verl.platform.cpu_features import cpu_class, cpu_model_and_flags

    model, flags = cpu_model_and_flags()
    return model, cpu_class(flags)


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("vllm", "verl", "torch", "qurl-verl"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def markdown(res: dict) -> str:
    s, presets = res["summary"], res["presets"]
    head = "| | " + " | ".join(f"`{p}`" for p in presets) + " |\n|---|" + "---|" * len(presets) + "\n"

    def row(label: str, key: str, spec: str = ".2e") -> str:
        return f"| {label} | " + " | ".join(cell(s[p][key], s[p][f"{key}_se"], spec, missing="—") for p in presets) + " |\n"

    n = res["steps"]
    text = (f"# verl `colocate_async`: staleness beside quantized rollout\n\n"
            f"CPU: {res['cpu']['model']} (`{res['cpu']['class']}`); vLLM {res['versions']['vllm']}, "
            f"verl {res['versions']['verl']}, torch {res['versions']['torch']}.\n\n"
            f"The tiny CPU recipe (task `{res['task']}`) through `verl.trainer.main_ppo` with "
            f"`trainer.v1.trainer_mode=colocate_async`, {n} steps, seeds {', '.join(map(str, res['seeds']))} (`recipes/tiny_cpu/study_async/verl_runs.sh`, "
            f"`make study-async-verl`). Mean ± standard error across seeds; a step is at staleness ≥ 1 when verl's "
            f"`{STALENESS_MAX}` is. KL(π_rollout ‖ π_old): verl's `rollout_corr/kl` (k1) and `rollout_corr/k3_kl` "
            f"(k3), qurl's `actor/qurl/kl_behav_prox_k3` (k3 inside the loss; the `int8` preset only), and "
            f"`actor/qurl/w_max` (a step's largest weight w = π_old / π_rollout, averaged over steps) and "
            f"`actor/qurl/w_frac_above_c` (the share of tokens whose w ACR truncates at C). "
            f"A seed k sets {', '.join(f'`{key}`' for key in res['seed_keys'])}.\n\n")
    text += head + "| steps at staleness 0 / ≥ 1 | " + " | ".join(
        f"{_steps(res, p, 'steps_stale0')} / {_steps(res, p, 'steps_stale1')}" for p in presets) + " |\n"
    text += row(f"`{STALENESS_MEAN}`, mean over steps", "staleness_mean", ".2f")
    text += row(f"`{STALENESS_MAX}`, max over steps", "staleness_max", ".0f")
    for name, key in MISMATCH.items():
        if name == "qurl_w_max":
            text += row(f"`{key}`, staleness 0", f"{name}_stale0", ".3f")
            text += row(f"`{key}`, staleness ≥ 1", f"{name}_stale1", ".3f")
            continue
        text += row(f"`{key}`, staleness 0", f"{name}_stale0")
        text += row(f"`{key}`, staleness ≥ 1", f"{name}_stale1")
        text += row(f"`{key}`, ≥ 1 minus 0", f"{name}_stale_gain")
    w = window(n)
    text += row(f"`{REWARD}`, first {w} step(s)", "reward_first", ".3f")
    text += row(f"`{REWARD}`, last {w} step(s)", "reward_last", ".3f")
    text += row(f"`{STEP_S}`, step 1 (s)", "first_step_s", ".1f")
    text += row(f"`{STEP_S}`, steps 2-{n} (s)", "step_s", ".2f")
    text += row("run wall time (s)", "wall_s", ".0f")
    text += "\nverl's staleness step by step (`" + STALENESS_MAX + "`):\n\n"
    for p in presets:
        for seed, run in res["runs"][p].items():
            text += f"- `{p}` seed {seed}: {' '.join(map(str, run['by_step']['staleness']))}\n"
    text += "\n## Verdicts (beyond seed noise: more than 2 standard errors)\n\n"
    for key, d in res["int8_minus_bf16"].items():
        name, split = key.rsplit("_", 1)
        text += (f"- `int8` − `bf16`, `{MISMATCH[name]}` at staleness {'≥ 1' if split == 'stale1' else '0'}: "
                 f"{fmt_difference(d['diff'], d['se'], '.2e')}: "
                 f"{'beyond' if d['beyond_noise'] else 'within'} seed noise\n")
    for p in presets:
        for name, key in MISMATCH.items():
            if not math.isnan(s[p][f"{name}_stale_gain"]):
                text += (f"- `{p}`, `{key}`, staleness ≥ 1 minus 0: "
                         f"{fmt_difference(s[p][f'{name}_stale_gain'], s[p][f'{name}_stale_gain_se'], '.2e')}: "
                         f"{'beyond' if res['stale_gain_beyond_noise'][p][name] else 'within'} seed noise\n")
    text += ("\n## Data order (verl's rollout dumps)\n\nSteps with the same prompts, and the share of the run's "
             "prompts the two runs have in common (a step trains on the first groups to finish):\n\n")
    for pair, c in res["data_order"].items():
        text += f"- {pair}: {c['same_steps']} of {n} steps, {c['shared_prompts']:.0%} of the prompts\n"
    return text


def _steps(res: dict, preset: str, key: str) -> str:
    counts = sorted({r[key] for r in res["runs"][preset].values()})
    return "/".join(map(str, counts))


def _no_nan(value):
    """NaN (a quantity a preset does not log, a standard error from one seed) as JSON null."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def is_complete(folder: Path, steps: int) -> bool:
    try:
        read_run(folder, steps)
    except ValueError as err:
        print(err, file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, help="OUT_ROOT of verl_runs.sh: <root>/<preset>/seed<k>/metrics.jsonl")
    ap.add_argument("--presets", nargs="+", default=["bf16", "int8"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--task", default="arithmetic", help="the runs' TASK, recorded with the results")
    ap.add_argument("--out-dir", type=Path, default=Path("recipes/tiny_cpu/study_async"))
    ap.add_argument("--complete", type=Path, help="only check that this run folder has all steps (exit 0 / 1)")
    a = ap.parse_args(argv)
    if a.complete is not None:
        return 0 if is_complete(a.complete, a.steps) else 1
    if a.root is None:
        ap.error("--root is required")
    try:
        res = summarize(a.root, a.presets, a.seeds, a.steps, a.task)
    except ValueError as err:
        print(f"[study-async-verl] {err}", file=sys.stderr)
        return 1
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "verl_colocate_async.json").write_text(json.dumps(_no_nan(res), indent=1, allow_nan=False) + "\n")
    (a.out_dir / "verl_colocate_async.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
