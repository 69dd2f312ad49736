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
