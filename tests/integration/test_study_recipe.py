"""`make study` end to end at toy size: SFT, seeds side by side, the report from what they logged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_study_recipe_runs_seeds_in_parallel_and_reports_and_the_long_horizon_adds_its_section(tmp_path):
    """`make study` at toy size, run twice (the second keeps the finished runs), then `make study-long`
    (LONG_HORIZON=1) into the same REPORT_DIR: its own runs, and a section added to the existing report."""
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"), REPORT_DIR=str(tmp_path / "report"),
               STEPS="2", SFT_STEPS="4", VARIANTS="bf16 acr_uaq acr_per_group_lr", SEEDS="1 2")
    small = ["--n-val", "4", "--prompts-per-step", "2", "--group-size", "2", "--max-response-tokens", "8",
             "--n-train", "4"]
    proc = subprocess.run(["bash", str(REPO / "recipes/tiny_cpu/study/run.sh"), *small], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "report" / "results.json").read_text())
    assert set(result["variants"]) == {"bf16", "acr_uaq", "acr_per_group_lr"}
    assert all(v["seeds"] == [1, 2] and v["steps"] == 2 for v in result["variants"].values())
    assert result["settings"]["steps"] == 2 and result["cpu"]["isa"]
    assert any(c["claim"].startswith("UAQ ≈ per-group") for c in result["claims"])
    # a second call keeps the finished runs and only redraws
    again = subprocess.run(["bash", str(REPO / "recipes/tiny_cpu/study/run.sh"), *small], env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0
    assert "finished earlier, kept" in (tmp_path / "out" / "seed1.log").read_text()

    # LONG_HORIZON=1 (`make study-long`): its own runs, and a section added to the report in REPORT_DIR
    before = json.loads((tmp_path / "report" / "results.json").read_text())
    md_before = (tmp_path / "report" / "results.md").read_text()
    long = subprocess.run(["bash", str(REPO / "recipes/tiny_cpu/study/run.sh"), *small],
                          env=dict(env, LONG_HORIZON="1", OUT=str(tmp_path / "out_long"), STEPS="3", VARIANTS=""),
                          capture_output=True, text=True, timeout=600)
    assert long.returncode == 0, long.stdout[-3000:] + long.stderr[-3000:]
    # the long-horizon default variants ran, each for the long runs' own number of steps
    assert {p.parent.parent.name for p in (tmp_path / "out_long" / "runs").glob("*/seed1/run.json")} == \
        {"bf16", "tis", "acr_no_uaq"}
    after = json.loads((tmp_path / "report" / "results.json").read_text())
    long_horizon = after.pop("long_horizon")
    assert after == before  # the 200-step part is left as it was
    assert long_horizon["settings"]["steps"] == 3 and set(long_horizon["variants"]) == {"bf16", "tis", "acr_no_uaq"}
    assert long_horizon["verdicts"][0]["verdict"].startswith("not testable (runs have 3 steps")
    md_after = (tmp_path / "report" / "results.md").read_text()
    assert md_after.startswith(md_before) and "## Long horizon" in md_after[len(md_before):]


def test_study_async_recipe_runs_the_staleness_grid_and_reports(tmp_path):
    """`make study-async` at toy size (CI's smoke test of the staleness setting; the study itself is not run
    here): a 2 x 2 grid (BF16 / W5A8 + TIS x staleness 0 / 1) for two seeds side by side, then a third seed for
    the arms at MORE_SEEDS_LRS, then the report; a second call keeps every run."""
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"), REPORT_DIR=str(tmp_path / "report"),
               STEPS="3", SFT_STEPS="4", SEEDS="1 2", MORE_SEEDS="3", MORE_SEEDS_LRS="1e-4")
    args = ["--lrs", "1e-4", "--staleness-grid", "0", "1", "--variants", "bf16_tis", "tis", "--also",
            "--n-val", "4", "--prompts-per-step", "2", "--group-size", "2", "--max-response-tokens", "8", "--n-train", "4"]
    script = str(REPO / "recipes/tiny_cpu/study_async/run.sh")
    proc = subprocess.run(["bash", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "report" / "results.json").read_text())
    assert set(result["arms"]) == {f"lr0.0001/staleness{k}/{v}" for k in (0, 1) for v in ("bf16_tis", "tis")}
    assert all(a["seeds"] == [1, 2, 3] and a["steps"] == 3 for a in result["arms"].values())
    rows = [json.loads(line) for line in
            (tmp_path / "out/runs/lr0.0001/staleness1/tis/seed1/metrics.jsonl").read_text().splitlines()]
    assert [r["staleness"] for r in rows[:-1]] == [0, 1, 1]
    assert result["arms"]["lr0.0001/staleness0/bf16_tis"]["kl_quantization"] == 0
    assert result["arms"]["lr0.0001/staleness0/tis"]["kl_quantization"] > 0
    assert any(c["claim"].startswith("lr 0.0001: one step of staleness") for c in result["claims"])
    assert (tmp_path / "report" / "staleness_quantization.png").stat().st_size > 0
    again = subprocess.run(["bash", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0
    assert (tmp_path / "out" / "seed1.log").read_text().count("finished earlier, kept") == 4
    assert (tmp_path / "out" / "seed3.log").read_text().count("finished earlier, kept") == 4
