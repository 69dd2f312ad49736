"""What every CPU benchmark records and writes the same way: the machine it ran on, its time budget, its results.

A result is only comparable with another when both say on which CPU class, under what load and with
which torch / vLLM / verl they were measured, so every script takes that record from here, under the
same key names: a result's ``environment`` is ``environment()``. The load average is always stored
under ``loadavg``: ``environment["loadavg"]`` at the start of the run, ``loadavg_<when>`` for later readings
(``loadavg_end`` of the run, ``loadavg_before``/``loadavg_after`` of a block). Results written before
this module existed used other names, which ``loadavg_of`` and ``start_loadavg`` still read.

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
# this checkout's qurl_verl is the one measured rather than another installed copy. The only sys.path
# edit of the CPU benchmarks (gpu/ adds its own folders: see the scripts there).
if sys.path[:1] != [str(REPO)]:
    sys.path.insert(0, str(REPO))

from qurl_verl.platform.cpu_features import cpu_class, cpu_model_and_flags  # noqa: E402

RESULTS = REPO / "bench" / "results"

# Older result files' names for the same readings, by the ``when`` of ``loadavg_<when>``.
LEGACY_LOADAVG_KEYS = {
    "end": ("load_avg_end",),
    "before": ("load_before", "load_average_before"),
    "after": ("load_after", "load_average_after"),
}
# Where older results kept the reading at the start of the run: (sub-record or None, key).
LEGACY_START_LOADAVG = ((None, "loadavg_start"), (None, "load_avg_start"), ("machine", "loadavg_start"),
                        ("cpu", "loadavg_start"), (None, "load_avg_1m"))


def loadavg() -> tuple[float, float, float] | None:
    """The 1 / 5 / 15-minute load averages now; None where the OS has none."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def loadavg_of(record: dict, when: str, default=None):
    """A later load reading of a result or block, new or old: ``loadavg_<when>`` or the name it had before."""
    for key in (f"loadavg_{when}", *LEGACY_LOADAVG_KEYS.get(when, ())):
        if key in record:
            return record[key]
    return default


def start_loadavg(report: dict, default=None):
    """The load average at the start of a run: ``environment["loadavg"]``, or where an older result kept it."""
    if "loadavg" in report.get("environment", {}):
        return report["environment"]["loadavg"]
    for sub, key in LEGACY_START_LOADAVG:
        record = report.get(sub, {}) if sub else report
        if isinstance(record, dict) and key in record:
            return record[key]
    return default


def package_version(name: str) -> str | None:
    """Installed version without importing the package (vLLM and verl take seconds to import)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def results_class(flags: frozenset[str]) -> str:
    """The CPU class of the results (``cpu_features.cpu_class``), as result files are named. An ``ONEDNN_MAX_CPU_ISA`` cap is named too:
    ``<cap>_onednn_on_<native>`` when it caps oneDNN alone (torch's and sgl-kernel's kernels keep the native
    ISA), ``<cap>_emulated_on_<native>`` when ``ATEN_CPU_CAPABILITY`` caps torch's kernels to the same ISA."""
    native = cpu_class(flags)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().lower()
    if not cap or cap == "all":
        return native
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return f"{cap}_emulated_on_{native}" if aten == cap else f"{cap}_onednn_on_{native}"


def environment(cls: str | None = None) -> dict:
    """The one environment record of every result (``cls``: the CPU class, by default ``results_class``)."""
    import torch

    model, flags = cpu_model_and_flags()
    return {
        "cpu_model": model,
        "cpu_class": cls or results_class(flags),
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


def recorded_args(args) -> dict:
    """A run's arguments as its results file keeps them: ``--out`` relative to the repository, never this
    machine's path (results files are committed)."""
    out = Path(args.out).resolve()
    return {**vars(args), "out": str(out.relative_to(REPO)) if out.is_relative_to(REPO) else out.name}


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
