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


# Every name cpu_class gives, best first. ``avx512_vnni`` is AVX-512 VNNI with AVX512_BF16 (AMD Zen 4/5,
# Intel Cooper Lake): the class of the committed ``*_avx512_vnni`` results.
CPU_CLASSES = ("amx", "avx512_vnni", "avx512_vnni_no_bf16", "avx512_bf16", "avx512", "avx2_vnni", "avx2")
# What torch's ``torch.cpu._is_avx512_supported()`` asks for (vLLM-CPU picks its library by it).
TORCH_AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})


def cpu_class(flags: set[str] | frozenset[str]) -> str:
    """The x86 class that decides torch's, oneDNN's and vLLM-CPU's kernels, as result files are named.

    AVX-512 is split by VNNI (oneDNN's int8 dot product) and by AVX512_BF16 (a native bf16 dot product;
    without it vLLM-CPU loads ``_C_AVX512`` instead of ``_C``, see ``vllm_cpu_library``): Intel Ice Lake,
    Tiger Lake and Rocket Lake are ``avx512_vnni_no_bf16``, Skylake-SP ``avx512``."""
    if "amx_int8" in flags:
        return "amx"
    if "avx512f" in flags:
        vnni, bf16 = "avx512_vnni" in flags, "avx512_bf16" in flags
        if vnni:
            return "avx512_vnni" if bf16 else "avx512_vnni_no_bf16"
        return "avx512_bf16" if bf16 else "avx512"
    return "avx2_vnni" if "avx_vnni" in flags else "avx2"


def vllm_cpu_library(flags: set[str] | frozenset[str]) -> str:
    """The kernel library vLLM-CPU 0.32 loads on x86 (``CpuPlatform.import_kernels``): ``_C`` with AVX-512
    BF16, the only one that registers the sgl-kernel ops (``convert_weight_packed``, ``weight_packed_linear``,
    ...); ``_C_AVX512`` on other AVX-512 CPUs; ``_C_AVX2`` below. All three register oneDNN's GEMMs."""
    if TORCH_AVX512 <= flags:
        return "_C" if "avx512_bf16" in flags else "_C_AVX512"
    return "_C_AVX2"
