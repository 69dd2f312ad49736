"""verl's own `python -m verl.trainer.main_ppo` on CPU, through the tiny CPU recipe."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "recipes" / "tiny_cpu" / "run.sh"


def run_recipe(out: Path, steps: int, *overrides: str, preset: str = "int8", timeout: int = 1200) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {**os.environ, "OUT": str(out), "STEPS": str(steps), "PRESET": preset, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(RUN), *overrides], capture_output=True, text=True, env=env, timeout=timeout)
    (out / "run.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    metrics_file = out / "metrics.jsonl"
    rows = [json.loads(line)["data"] for line in metrics_file.read_text().splitlines() if line.strip()] if metrics_file.exists() else []
    return proc, rows


@pytest.mark.e2e
def test_grpo_with_stock_vllm_rollout(tmp_path):
    proc, rows = run_recipe(tmp_path, 2, preset="none")
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert len(rows) == 2
    assert all(r["actor/grad_norm"] > 0 for r in rows), [r["actor/grad_norm"] for r in rows]
    # after the first weight sync the bf16 engine must serve the trainer's weights
    assert rows[-1]["training/rollout_probs_diff_max"] < 0.05, rows[-1]["training/rollout_probs_diff_max"]
    assert "[summary] steps: 2" in proc.stdout


@pytest.mark.e2e
def test_bad_model_path_fails_in_the_driver_with_one_message(tmp_path):
    proc, rows = run_recipe(tmp_path, 1, f"actor_rollout_ref.model.path={tmp_path}/missing", timeout=300)
    assert proc.returncode != 0 and rows == []
    err = proc.stdout + proc.stderr
    assert f"actor_rollout_ref.model.path={tmp_path}/missing does not exist" in err
    assert "ray init kwargs" not in err  # failed before Ray started


@pytest.mark.e2e
def test_int8_rollout_with_acr_and_uaq(tmp_path):
    """The README's demo: `+qurl=int8` (INT8 W8A8 rollout re-quantized every step, ACR loss, UAQ)."""
    proc, rows = run_recipe(tmp_path, 3, preset="int8")
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert len(rows) == 3
    log = proc.stdout + proc.stderr
    assert "[qurl] UAQ (s=1.5, q_proj/k_proj/v_proj) applied" in log
    for r in rows:
        assert r["actor/grad_norm"] > 0
        # the mismatch between the INT8 behaviour policy and the bf16 proximal policy is measured and small
        assert 0 <= r["actor/qurl/kl_behav_prox_k3"] < 0.05
        assert 1.0 <= r["actor/qurl/w_max"] < 2.0
        # every step re-quantizes and reloads the engine, and says what it cost and what changed
        assert r["actor/qurl/sync/total_s"] > 0 and r["actor/qurl/sync/quantized"] > 0
    # verl logs what update_actor returns under actor/; from the second sync on (step 1's loss sees
    # only the initial sync) the code-change rate is there too
    for r in rows[1:]:
        assert 0.0 <= r["actor/qurl/update/changed_code_frac"] <= 1.0
    # after an optimizer step at lr 1e-3 some INT8 codes must move (the weight-update problem, measured)
    assert rows[-1]["actor/qurl/update/changed_code_frac"] > 0
