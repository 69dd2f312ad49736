"""This machine's x86 CPU as kernels see it: model name, feature flags, and the class that decides which
INT8/BF16 kernels vLLM-CPU, oneDNN and the packed AVX2 GEMM run. One reader for the package, the study
harness and the benchmarks, so that every result names its CPU class the same way."""
from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.lru_cache(maxsize=1)
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """``model name`` and ``flags`` of ``/proc/cpuinfo`` (the platform's processor name and no flags elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []

    def first(key: str) -> str | None:
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)

    return first("model name") or platform.processor() or platform.machine(), frozenset((first("flags") or "").split())


def cpu_flags() -> frozenset[str]:
    return cpu_model_and_flags()[1]


def cpu_class(flags: set[str] | frozenset[str]) -> str:
    """The x86 class that decides torch's, oneDNN's and vLLM-CPU's kernels, as result files are named."""
    if "amx_int8" in flags:
        return "amx"
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    if "avx512f" in flags:
        return "avx512"
    return "avx2_vnni" if "avx_vnni" in flags else "avx2"
