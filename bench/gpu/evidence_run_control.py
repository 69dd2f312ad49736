"""Run control of gpu_evidence.py: per-step budgets, the hard time limit, the crash-safe JSON
writer and the device record. torch and the standard library only, as on the GPU machine.
"""
from __future__ import annotations

import gc
import json
import math
import os
import platform
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

STEP_NAMES = ("numerics", "w8a8_decode", "sync_cost", "acr_loss")
# Soft budgets (checked between iterations) sum to 285 s; the hard limit adds HARD_GRACE_S per step.
GPU_BUDGET_S = {"numerics": 40, "w8a8_decode": 140, "sync_cost": 70, "acr_loss": 35}
DRY_RUN_BUDGET_S = {"numerics": 30, "w8a8_decode": 30, "sync_cost": 30, "acr_loss": 30}
HARD_GRACE_S = 10

# ----------------------------------------------------------------------------- run control


class StepTimeout(Exception):
    """Raised by the hard limit when a step overruns its budget inside one long iteration."""


class Budget:
    """A step's soft wall-clock budget; loops ask ``expired()`` between iterations and stop early."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.truncated = False

    def expired(self) -> bool:
        if time.monotonic() > self.deadline:
            self.truncated = True
        return self.truncated


@contextmanager
def hard_time_limit(seconds: float):
    """SIGALRM backstop for a step stuck in one iteration; a no-op off the main thread or without SIGALRM."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise StepTimeout(f"step exceeded its hard limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def jsonable(obj):
    """Non-finite floats become strings so the file stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def write_json(path: Path, report: dict) -> None:
    """Atomic rewrite, so a kill during the write leaves the previous complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(jsonable(report), indent=1) + "\n")
    os.replace(tmp, path)


class Context:
    """What every step needs: the device, whether this is a dry run, and the sizes that follow from it."""

    def __init__(self, device: torch.device, dry_run: bool):
        self.device = device
        self.dry_run = dry_run
        self.cuda = device.type == "cuda"
        self.emulate_int_mm_limit = dry_run

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def environment(ctx: Context) -> dict:
    env = {
        "device": str(ctx.device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "dry_run": ctx.dry_run,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(
            device_name=props.name,
            capability=list(torch.cuda.get_device_capability(ctx.device)),
            total_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            l2_cache_bytes=getattr(props, "L2_cache_size", None),
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
            env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except Exception as exc:
            env["nvidia_smi"] = f"unavailable: {type(exc).__name__}"
    else:
        env.update(device_name=platform.processor() or platform.machine(), capability=None)
    return env
