"""Avg@k and pass@k from scored generations, checked against direct enumeration."""
from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from qurl_recipes import evaluation as ev


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of all k-subsets of n samples (the first c correct) that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert ev.pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_against_binomials():
    for n, c, k in [(64, 3, 8), (32, 0, 32), (32, 32, 1), (100, 17, 50), (1000, 1, 10)]:
        assert ev.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), rel=1e-9)
    assert ev.pass_at_k(16, 5, 1) == pytest.approx(5 / 16)  # pass@1 is the accuracy
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 1, 5)


def _synthetic_dump(seed: int = 0):
    """verl validation-dump rows: 3 benchmarks, several problems, n samples each, uid = <prompt>_<session>_<sample>."""
    rng = random.Random(seed)
    truth: dict[str, list[tuple[int, int]]] = {}
    rows = []
    for bench, problems, n in [("deepscaler_aime2024", 5, 8), ("deepscaler_amc", 7, 8), ("deepscaler_math500", 4, 8)]:
        truth[bench] = []
        for p in range(problems):
            flags = [rng.random() < rng.random() for _ in range(n)]
            truth[bench].append((n, sum(flags)))
            uid = f"{bench}-uuid-{p}"
            for j, ok in enumerate(flags):
                rows.append({"input": f"problem {p}", "output": "...", "gts": "1", "score": float(ok), "step": 40,
                             "acc": ok, "pred": "1", "benchmark": bench, "uid": f"{uid}_0_{j}"})
    rng.shuffle(rows)
    return rows, truth


def test_avg_and_pass_at_k_per_benchmark_on_a_verl_dump():
    rows, truth = _synthetic_dump()
    results = {r.benchmark: r for r in ev.evaluate(rows)}
    assert set(results) == set(truth) | {ev.AVERAGE}
    for bench, counts in truth.items():
        r = results[bench]
        assert (r.problems, r.samples_min, r.samples_max) == (len(counts), 8, 8)
        assert r.avg == pytest.approx(sum(c / n for n, c in counts) / len(counts))
        assert sorted(r.pass_at) == [1, 2, 4, 8]
        for k, value in r.pass_at.items():
            assert value == pytest.approx(sum(brute_force_pass_at_k(n, c, k) for n, c in counts) / len(counts))
        assert r.pass_at[1] == pytest.approx(r.avg)
    avg = results[ev.AVERAGE]
    assert avg.avg == pytest.approx(sum(results[b].avg for b in truth) / 3)  # unweighted over benchmarks


def test_plain_rows_and_score_threshold():
    rows = [{"data_source": "aime", "index": i, "score": s} for i, scores in enumerate([[1, -1, -1, 1], [-1, -1, -1, -1]])
            for s in scores]
    (r,) = ev.evaluate(rows, ks=[1, 4])
    assert r.avg == pytest.approx((2 / 4 + 0) / 2)
    assert r.pass_at[4] == pytest.approx(0.5)
    rows_without_source = [{"uid": f"p{i}_0_{j}", "score": s} for i in range(2) for j, s in enumerate([0.0, 1.0])]
    (r,) = ev.evaluate(rows_without_source, source="aime2024")
    assert r.benchmark == "aime2024" and r.avg == 0.5 and r.pass_at[2] == 1.0


def test_errors_are_explicit(tmp_path):
    rows, _ = _synthetic_dump()
    with pytest.raises(ValueError, match="pass@16 needs at least 16 samples per problem"):
        ev.evaluate(rows, ks=[16])
    a, b = tmp_path / "40.jsonl", tmp_path / "60.jsonl"
    a.write_text(json.dumps({"score": 1, "uid": "x_0_0", "step": 40}) + "\n")
    b.write_text(json.dumps({"score": 1, "uid": "x_0_0", "step": 60}) + "\n")
    with pytest.raises(ValueError, match="mix validation steps"):
        ev.read_jsonl([a, b])


def test_cli_writes_markdown(tmp_path):
    rows, truth = _synthetic_dump(seed=3)
    dump = tmp_path / "40.jsonl"
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ev.main([str(dump), "--out", str(tmp_path / "t.md"), "--json", str(tmp_path / "t.json")]) == 0
    table = (tmp_path / "t.md").read_text()
    lines = table.splitlines()
    assert lines[0] == "| benchmark | problems | samples / problem | Avg@n | pass@1 | pass@2 | pass@4 | pass@8 |"
    aime = next(line for line in lines if line.startswith("| deepscaler_aime2024 |"))
    expected = 100 * sum(c / n for n, c in truth["deepscaler_aime2024"]) / 5
    assert aime.split(" | ")[1:4] == ["5", "8", f"{expected:.2f}"]
    assert any(line.startswith("| average | 16 |") for line in lines)
    assert json.loads((tmp_path / "t.json").read_text())[0]["benchmark"] == "deepscaler_aime2024"
