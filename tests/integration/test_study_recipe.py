"""`make study` end to end at toy size: SFT, seeds side by side, the report from what they logged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_study_recipe_runs_seeds_in_parallel_and_reports(tmp_path):
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
