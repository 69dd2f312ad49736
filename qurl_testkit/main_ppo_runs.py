"""verl's own ``python -m verl.trainer.main_ppo`` (or another of its entry points) on CPU, through the tiny CPU
recipe, under a deadline.

Every run has a deadline well under CI's 90 minutes. The recipe runs in a session of its own;
when the deadline passes, or once the recipe has exited, every process left in that session or
below the recipe (the driver, the Ray cluster its ``ray.init()`` started, Ray's workers, vLLM
engine processes) is ended: SIGTERM, then SIGKILL after a grace period. Ray may move the driver
into a process group of its own (``setpgrp`` before starting its reaper, on kernels without
fate-sharing), so a ``killpg`` of the recipe's group is not enough: the session holds them all.
``ray stop --force`` is not used: it ends every Ray process on the machine, other runs' included.

``RecipeInputs``: the tiny model and the arithmetic data, built once and shared by every run of a test
session (``MODEL_DIR`` / ``DATA_DIR``), with one UAQ cache (``QURL_CACHE_DIR``), so each run pays only for
what is its own.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "recipes" / "tiny_cpu" / "run.sh"
TERM_GRACE_S = 15
LOG_TAIL_CHARS = 6000
MAIN_PPO = "verl.trainer.main_ppo"
# verl 0.9.1's other entry points, with their own Hydra configs (the recipe's MAIN_MODULE)
ONE_STEP_OFF_POLICY = "verl.experimental.one_step_off_policy.main_ppo"
FULLY_ASYNC_POLICY = "verl.experimental.fully_async_policy.fully_async_main"


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
        import pytest

        pytest.fail(
            f"{' '.join(cmd)} ran past its {timeout:.0f} s deadline and was ended "
            f"({time.monotonic() - start:.0f} s).\n--- stdout tail ---\n{stdout[-LOG_TAIL_CHARS:]}"
            f"\n--- stderr tail ---\n{stderr[-LOG_TAIL_CHARS:]}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_recipe(out: Path, steps: int, *overrides: str, preset: str = "int8", timeout: int = 900,
               inputs: RecipeInputs | None = None,
               main_module: str = MAIN_PPO) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``recipes/tiny_cpu/run.sh`` with ``overrides``, its outputs in ``out``; (the process, the metrics rows).
    ``inputs``: a model, data and UAQ cache built earlier (the recipe builds its own under ``out`` otherwise;
    a ``MODEL_DIR`` in the environment still wins). ``main_module``: verl's entry point the recipe runs."""
    env = {**os.environ, "OUT": str(out), "STEPS": str(steps), "PRESET": preset, "PYTHON": sys.executable,
           "MAIN_MODULE": main_module}
    if inputs is not None:
        env = {**inputs.env(), **env}
    proc = run_in_own_session(["bash", str(RUN), *overrides], env, out, timeout)
    (out / "run.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    metrics_file = out / "metrics.jsonl"
    rows = [json.loads(line)["data"] for line in metrics_file.read_text().splitlines() if line.strip()] if metrics_file.exists() else []
    return proc, rows


@dataclass(frozen=True)
class RecipeInputs:
    """The recipe's default model and data, and a UAQ cache, under ``root``, built once."""

    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def build(self) -> RecipeInputs:
        """What ``run.sh`` would build under its ``OUT`` (same modules, same arguments)."""
        if not (self.model_dir / "config.json").exists():
            subprocess.run([sys.executable, "-m", "qurl_recipes.tiny_model", "--out", str(self.model_dir)],
                           check=True, stdout=subprocess.DEVNULL, timeout=600)
        if not (self.data_dir / "train.parquet").exists():
            subprocess.run([sys.executable, "-m", "qurl_recipes.data.arithmetic", "--out", str(self.data_dir)],
                           check=True, stdout=subprocess.DEVNULL, timeout=600)
        return self

    def env(self) -> dict[str, str]:
        return {"MODEL_DIR": str(self.model_dir), "DATA_DIR": str(self.data_dir),
                "QURL_CACHE_DIR": str(self.root / "cache")}
