"""What every CPU benchmark records and writes the same way: the machine it ran on, its time budget, its results.

A result is only comparable with another when both say on which CPU class, under what load and with
which torch / vLLM / verl they were measured, so every script takes that record from here, under the
same key names. The load average is always stored under ``loadavg`` (``loadavg_<when>`` where a script
reads it more than once: ``_start``/``_end`` of the run, ``_before``/``_after`` of a block); results
written before this module existed used other names, which ``loadavg_of`` still reads.

Imported first by every script of ``bench/``: see the ``sys.path`` note below.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The scripts are run by path (``python bench/<script>.py``), which puts only bench/ on sys.path. The
# repository root goes first so that qurl_testkit and qurl_recipes (never installed) import, and so that
# this checkout's qurl_verl is the one measured rather than another installed copy. The only place in
# bench/ that edits sys.path.
if sys.path[:1] != [str(REPO)]:
    sys.path.insert(0, str(REPO))

from qurl_verl.platform.cpu_features import cpu_class, cpu_model_and_flags  # noqa: E402

RESULTS = REPO / "bench" / "results"

# Older result files' names for the same readings, by the ``when`` of ``loadavg_<when>``.
LEGACY_LOADAVG_KEYS = {
    "": ("load_avg", "load_average"),
    "start": ("load_avg_start", "load_start"),
    "end": ("load_avg_end", "load_end"),
    "before": ("load_before", "load_average_before"),
    "after": ("load_after", "load_average_after"),
}


def loadavg() -> tuple[float, float, float] | None:
    """The 1 / 5 / 15-minute load averages now; None where the OS has none."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def loadavg_key(when: str = "") -> str:
    return f"loadavg_{when}" if when else "loadavg"


def loadavg_of(record: dict, when: str = "", default=None):
    """A load reading of a result, new or old: ``loadavg_<when>`` or the name it had before."""
    for key in (loadavg_key(when), *LEGACY_LOADAVG_KEYS.get(when, ())):
        if key in record:
            return record[key]
    return default


def package_version(name: str) -> str | None:
    """Installed version without importing the package (vLLM and verl take seconds to import)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(cls: str | None = None) -> dict:
    """The one environment record of every result. ``cls`` overrides the CPU class where a script names
    an emulated one (``bench_rollout_throughput.results_class``)."""
    import torch

    model, flags = cpu_model_and_flags()
    return {
        "cpu_model": model,
        "cpu_class": cls or cpu_class(flags),
        "cores": os.cpu_count(),
        "loadavg": loadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": package_version("vllm"),
        "verl": package_version("verl"),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class TimeBudget:
    """Wall seconds a run may spend before it starts no new block (a block already started finishes)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def exhausted(self) -> bool:
        return self.elapsed() > self.seconds


def write_json(path: Path, report: dict, indent: int = 1) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent) + "\n")
    return path


def write_result(stem: Path, report: dict, markdown: str | None = None, indent: int = 1) -> None:
    """``<stem>.json`` and, given its text, ``<stem>.md``: rewritten after every block by the long scripts,
    so a run cut short still leaves what it measured."""
    stem = Path(stem)
    write_json(stem.with_suffix(".json"), report, indent)
    if markdown is not None:
        stem.with_suffix(".md").write_text(markdown)
