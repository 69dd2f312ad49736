"""verl's own `python -m verl.trainer.main_ppo` on CPU, through the tiny CPU recipe.

Every run has a deadline well under CI's 90 minutes. The recipe runs in a session of its own;
when the deadline passes, or once the recipe has exited, every process left in that session or
below the recipe (the driver, the Ray cluster its ``ray.init()`` started, Ray's workers, vLLM
engine processes) is ended: SIGTERM, then SIGKILL after a grace period. Ray may move the driver
into a process group of its own (``setpgrp`` before starting its reaper, on kernels without
fate-sharing), so a ``killpg`` of the recipe's group is not enough: the session holds them all.
``ray stop --force`` is not used: it ends every Ray process on the machine, other runs' included.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "recipes" / "tiny_cpu" / "run.sh"
TERM_GRACE_S = 15
LOG_TAIL_CHARS = 6000


def processes_of_run(root: psutil.Process | None, session_id: int) -> list[psutil.Process]:
    """Everything still alive in the run's session or below its root process, never this process."""
    found: dict[int, psutil.Process] = {}
    if root is not None:
        try:
            found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        except psutil.NoSuchProcess:
            pass
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == session_id:
                found[p.pid] = p
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    found.pop(os.getpid(), None)
    return [p for p in found.values() if p.is_running()]


def end_processes(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM, then SIGKILL whatever is left after ``grace_s``."""
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def run_in_own_session(cmd: list[str], env: dict, log_dir: Path, timeout: float,
                       grace_s: float = TERM_GRACE_S) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a new session with output in files; fail the test with the log tails if it
    outlives ``timeout``. Whatever it leaves behind is ended either way."""
    out_path, err_path = log_dir / "stdout.log", log_dir / "stderr.log"
    start = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    session_id = proc.pid  # the session leader's pid is the session id
    try:
        root = psutil.Process(proc.pid)
    except psutil.NoSuchProcess:
        root = None
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        leftovers = processes_of_run(root, session_id)  # before the root dies and orphans reparent
        end_processes(leftovers, grace_s)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        leftovers = processes_of_run(None, session_id)
        if leftovers:
            end_processes(leftovers, grace_s)
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    if timed_out:
        pytest.fail(
            f"{' '.join(cmd)} ran past its {timeout:.0f} s deadline and was ended "
            f"({time.monotonic() - start:.0f} s).\n--- stdout tail ---\n{stdout[-LOG_TAIL_CHARS:]}"
            f"\n--- stderr tail ---\n{stderr[-LOG_TAIL_CHARS:]}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_recipe(out: Path, steps: int, *overrides: str, preset: str = "int8", timeout: int = 900) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {**os.environ, "OUT": str(out), "STEPS": str(steps), "PRESET": preset, "PYTHON": sys.executable}
    proc = run_in_own_session(["bash", str(RUN), *overrides], env, out, timeout)
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
    assert_int8_acr_uaq_run(proc, rows, steps=3)


def assert_int8_acr_uaq_run(proc, rows: list[dict], steps: int) -> None:
    """What every step of a `+qurl=int8` run logs, and what it must show."""
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert len(rows) == steps
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


STUBBORN_DRIVER = """
import os, signal, sys, time
os.setpgrp()  # what Ray's driver does: out of the recipe's process group, still in its session
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("driver", os.getpid(), flush=True)
time.sleep(600)
"""


def test_a_run_past_its_deadline_fails_and_leaves_nothing_behind(tmp_path):
    """The no-hang guarantee itself (seconds): a driver that left the group and ignores SIGTERM."""
    (tmp_path / "driver.py").write_text(STUBBORN_DRIVER)
    script = f"{sys.executable} {tmp_path / 'driver.py'} & sleep 600; wait"
    with pytest.raises(pytest.fail.Exception, match="deadline") as failure:
        run_in_own_session(["bash", "-c", script], dict(os.environ), tmp_path, timeout=3, grace_s=1)
    driver_pid = int((tmp_path / "stdout.log").read_text().split()[1])
    assert "driver" in str(failure.value)
    assert not psutil.pid_exists(driver_pid) or psutil.Process(driver_pid).status() == psutil.STATUS_ZOMBIE
