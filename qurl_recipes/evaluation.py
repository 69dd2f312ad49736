"""Avg@k and pass@k per benchmark from scored generations, written as a markdown table.

    python -m qurl_recipes.evaluation outputs/deepscaler/int8/validation/100.jsonl --out results.md

Input is JSON lines, one scored sample per line, in either of two forms:

* verl's validation dump (`trainer.validation_data_dir`, one `<step>.jsonl` per validation):
  `score`, the reward's extra fields (`acc`, and `benchmark` from `qurl_verl.recipe_rewards.boxed_math`)
  and `uid` = `<prompt uuid>_<session>_<sample>`, whose first part groups the samples of one
  problem. Rows without a benchmark field (verl's own scorers) count under `--source`.
* plain rows `{"data_source": ..., "index": ..., "score": ...}` (or `acc` instead of `score`).

A sample is correct when `acc` is true, or, without `acc`, when `score > --threshold` (0: verl's
math scorers give 1 / 0 or 1 / -1).

Avg@k is the mean accuracy over each problem's k samples, averaged over problems (the paper's
metric). pass@k uses the unbiased estimator of Chen et al. 2021 (HumanEval): with n samples of
which c are correct, pass@k = 1 - C(n-c, k) / C(n, k); it needs k <= n for every problem.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

AVERAGE = "average"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k) / C(n, k) as a product, which stays exact-ish for large n (no huge binomials)
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


@dataclass
class BenchmarkResult:
    benchmark: str
    problems: int
    samples_min: int
    samples_max: int
    avg: float  # Avg@n: mean per-problem accuracy
    pass_at: dict[int, float]  # k -> mean pass@k over problems


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def _problem_key(row: dict) -> str:
    if row.get("index") is not None:
        return str(row["index"])
    if row.get("uid"):
        return str(row["uid"]).rsplit("_", 2)[0]
    if row.get("input") is not None:
        return str(row["input"])
    raise ValueError(f"row has neither index, uid nor input to tell its problem: {sorted(row)}")


def _correct(row: dict, threshold: float) -> bool:
    if row.get("acc") is not None:
        return bool(row["acc"]) if not isinstance(row["acc"], str) else row["acc"].lower() == "true"
    if row.get("score") is None:
        raise ValueError(f"row has neither acc nor score: {sorted(row)}")
    return float(row["score"]) > threshold


def group_samples(rows: Iterable[dict], source: str = "all", threshold: float = 0.0) -> dict[str, dict[str, list[bool]]]:
    """benchmark -> problem -> correctness of each sample."""
    grouped: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        bench = row.get("data_source") or row.get("benchmark") or source
        grouped[str(bench)][_problem_key(row)].append(_correct(row, threshold))
    return grouped


def evaluate(rows: Iterable[dict], ks: Iterable[int] | None = None, source: str = "all",
             threshold: float = 0.0) -> list[BenchmarkResult]:
    """One result per benchmark (sorted by name), then the unweighted average over benchmarks."""
    results = []
    for bench, problems in sorted(group_samples(rows, source, threshold).items()):
        counts = [(len(s), sum(s)) for s in problems.values()]
        n_min, n_max = min(n for n, _ in counts), max(n for n, _ in counts)
        use_ks = sorted(set(ks)) if ks else default_ks(n_min)
        too_big = [k for k in use_ks if k > n_min]
        if too_big:
            raise ValueError(f"{bench}: pass@{too_big[0]} needs at least {too_big[0]} samples per problem; "
                             f"the fewest any problem has is {n_min}")
        results.append(BenchmarkResult(
            benchmark=bench, problems=len(counts), samples_min=n_min, samples_max=n_max,
            avg=sum(c / n for n, c in counts) / len(counts),
            pass_at={k: sum(pass_at_k(n, c, k) for n, c in counts) / len(counts) for k in use_ks},
        ))
    if len(results) > 1:
        shared = sorted(set.intersection(*(set(r.pass_at) for r in results)))
        results.append(BenchmarkResult(
            benchmark=AVERAGE, problems=sum(r.problems for r in results),
            samples_min=min(r.samples_min for r in results), samples_max=max(r.samples_max for r in results),
            avg=sum(r.avg for r in results) / len(results),
            pass_at={k: sum(r.pass_at[k] for r in results) / len(results) for k in shared},
        ))
    return results


def markdown_table(results: list[BenchmarkResult]) -> str:
    ks = sorted({k for r in results for k in r.pass_at})
    head = ["benchmark", "problems", "samples / problem", "Avg@n"] + [f"pass@{k}" for k in ks]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        samples = str(r.samples_min) if r.samples_min == r.samples_max else f"{r.samples_min}-{r.samples_max}"
        cells = [r.benchmark, str(r.problems), samples, f"{100 * r.avg:.2f}"]
        cells += [f"{100 * r.pass_at[k]:.2f}" if k in r.pass_at else "–" for k in ks]
        lines.append("| " + " | ".join(cells) + " |")
    note = "Scores in %. Avg@n: mean accuracy over the n samples of each problem; pass@k: unbiased estimator (Chen et al. 2021)."
    if len(results) > 1 and results[-1].benchmark == AVERAGE:
        note += " `average`: unweighted mean over the benchmarks."
    return "\n".join(lines) + "\n\n" + note + "\n"


def read_jsonl(paths: Iterable[str | Path]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    steps = {r["step"] for r in rows if "step" in r}
    if len(steps) > 1:
        raise ValueError(f"the inputs mix validation steps {sorted(steps)}; evaluate one step's dump at a time")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Avg@k and pass@k per benchmark from scored generations (JSON lines).")
    ap.add_argument("inputs", nargs="+", help="verl validation dump(s) of one step, or rows of data_source/index/score")
    ap.add_argument("--k", type=int, action="append", help="pass@k values (default 1, 2, 4, ... n)")
    ap.add_argument("--source", default="all", help="benchmark name for rows that carry none (default: all)")
    ap.add_argument("--threshold", type=float, default=0.0, help="score above which a sample without `acc` is correct")
    ap.add_argument("--out", help="write the markdown table here (default: stdout)")
    ap.add_argument("--json", help="also write the results as JSON here")
    a = ap.parse_args(argv)
    try:
        results = evaluate(read_jsonl(a.inputs), a.k, a.source, a.threshold)
    except (ValueError, KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = markdown_table(results)
    if a.out:
        Path(a.out).write_text(table, encoding="utf-8")
        print(f"wrote {a.out}")
    else:
        print(table)
    if a.json:
        Path(a.json).write_text(json.dumps([r.__dict__ for r in results], indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
