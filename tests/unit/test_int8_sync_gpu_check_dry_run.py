"""The ``qurl_int8`` GPU check's CPU dry run (``tests/gpu/check_qurl_int8_sync.py --dry-run``), run as a user runs it.

The script is what a user with 2 GPUs runs first for the disaggregated 8-bit sync; its own code (the two Ray actors
that build the engine through verl's registry, the manager's call order, the direct quantization on the rollout
side, the checksums, the JSON result and the exit code) otherwise runs nowhere before that. The dry run is the same
script over the engine's gloo transport with CPU-only actors.

It runs on the 0.24 stack only: that stack's torch (2.11, a CUDA build) is the one GPU users run with verl 0.9.1's
vLLM, and the engine's group constructors (``TCPStore``, ``ProcessGroupGloo``) are torch's; the 0.32 stack's torch
runs the engine in ``test_int8_checkpoint_engine.py`` and ``test_int8_engine_manager.py``.

One run: 3 syncs, the trainer sends one weight negated from sync 3 on (``--perturb-sent-weight``; the reference
quantizes the true weights). Syncs 1-2 must pass every check (the flow works and the reference agrees), sync 3 must
fail the bit comparison and the checksum against the direct quantization while the checksum of what arrived still
matches the sender's (the checks can fail, and tell the transport from the sender), and the run exits 1. Measured on
2 shared cores: 17-30 s, most of it Ray's start. A run on a machine without 2 GPUs and without ``--dry-run``
prints SKIPPED and exits 0; one without verl says it cannot run and exits 2.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from qurl_verl import versions

pytestmark = [pytest.mark.both_stacks, pytest.mark.skipif(
    versions.vllm_release(versions.installed_vllm_version()) != (0, 24),
    reason="the qurl_int8 GPU check's dry run runs on the 0.24 stack, GPU users' torch")]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "gpu" / "check_qurl_int8_sync.py"
PERTURBED = "model.layers.1.mlp.down_proj.weight"


def run_script(tmp_path: Path, *args: str, timeout: int, **env_vars: str) -> subprocess.CompletedProcess:
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short (socket paths) and private: no other test's
    # ray.init() without an address joins this cluster
    env = {**os.environ, "RAY_TMPDIR": ray_tmp,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), **env_vars}
    try:
        return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=timeout)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_dry_run_passes_until_the_trainer_sends_a_wrong_weight(tmp_path):
    out = tmp_path / "result.json"
    proc = run_script(tmp_path, "--dry-run", "--syncs", "3", "--perturb-sent-weight", PERTURBED,
                      "--perturb-from-sync", "3", "--out", str(out), timeout=180)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS ", "FAIL "))]
    print("\n".join(lines))
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert "error" not in result, result.get("traceback")
    verdicts = {(c["check"], c["sync"]): c["ok"] for c in result["checks"]}
    per_sync = ("bits", "checksum_sent", "checksum_direct", "codes_changed")
    assert verdicts == {**{(check, s): True for check in per_sync for s in (1, 2)},
                        ("bits", 3): False, ("checksum_sent", 3): True, ("checksum_direct", 3): False,
                        ("codes_changed", 3): True}, verdicts
    # the lines say it too, in order
    assert [line.split(":")[0] for line in lines] == [
        f"{'FAIL' if (check, s) in {('bits', 3), ('checksum_direct', 3)} else 'PASS'} {check} sync {s}"
        for s in (1, 2, 3) for check in per_sync] + ["FAIL qurl_int8 sync check (dry run, cpu)"], lines
    [bad] = [c for c in result["checks"] if c["check"] == "bits" and not c["ok"]]
    assert bad["problems"] == [f"{PERTURBED}: other bytes"], bad  # the one weight, nothing else
    # what the engine got and sent: built through verl's registry, the gloo transport, the rest in bf16
    assert result["engine_class"] == "QurlInt8CheckpointEngine"
    assert {a["engine_class"] for a in result["actors"].values()} == {
        "qurl_verl.checkpoint_engine.int8_engine.QurlInt8CheckpointEngine"}
    # tie_word_embeddings as the driver fills it from the tiny model's config.json (which ties)
    assert result["engine_kwargs"] == {"quantization": "int8", "rest_dtype": "bfloat16", "tie_word_embeddings": True,
                                       "device": "cpu", "timeout_s": 300.0}
    model = result["model"]
    assert model["tie_word_embeddings"] is True
    for sync in result["syncs"]:
        # the state_dict's tensors, a weight_scale per decoder linear (2 layers x 7), the tied lm_head not sent
        assert sync["received_tensors"] == model["tensors"] + 14 - 1
        assert sync["tied_lm_head_received"] is False
        assert sync["metrics"]["qurl_sync/payload_bytes"] > 0
    assert [s["perturbed"] for s in result["syncs"]] == [None, None, PERTURBED]
    assert result["ok"] is False and proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])


def test_without_two_gpus_it_says_skipped_and_exits_0(tmp_path):
    proc = run_script(tmp_path, "--out", str(tmp_path / "result.json"), timeout=120, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("SKIPPED: this check needs 2 CUDA GPUs, 0 visible"), proc.stdout
    assert not (tmp_path / "result.json").exists()


def test_without_verl_it_says_it_cannot_run_and_exits_2(tmp_path):
    hide_verl = ("import runpy, sys\nsys.modules['verl'] = None\nsys.argv = [sys.argv[1], '--dry-run']\n"
                 "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", hide_verl, str(SCRIPT)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-3000:])
    assert proc.stdout.startswith("CANNOT RUN: verl not installed"), proc.stdout
