"""Exact W8A8 INT8 GEMM for x86 CPUs with AVX2 and no VNNI, on a weight packed once per sync.

On such CPUs oneDNN's int8 GEMM packs the weight on every call (and saturates on 8-bit codes,
see ``qurl_verl/kernels/cpu_int8_paths.py``), which makes INT8 rollout slower
than BF16 at decode batch sizes. ``cpu_int8_gemm_avx2.cpp`` computes the same integer dot
products with ``vpmaddubsw`` on |a| and sign(a)*w, which cannot saturate for weight codes in
[-127, 127]; see the file's header. It is built on first use with torch's C++ extension loader
(needs a C++ compiler; cached per user under ``TORCH_EXTENSIONS_DIR``), and the callers fall back
to oneDNN when it cannot be built.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qurl_verl.platform.cpu_features import cpu_flags  # module attribute: tests force other CPUs through it

logger = logging.getLogger("qurl_verl")

SOURCE = Path(__file__).with_name("cpu_int8_gemm_avx2.cpp")
BLOCK_ROWS = 4  # weight rows per packed block (kRows in the source)
CHUNK = 32  # int8 lanes of an AVX2 register (kChunk in the source)
WEIGHT_CODE_MAX = 127  # |w| <= 127 keeps every vpmaddubsw pair below 2**15 with |a| <= 128
_EXTENSION_NAME = "qurl_cpu_int8_gemm_avx2"
# Where oneDNN's int8 GEMM saturates: "auto" runs this kernel (oneDNN's split if it cannot be built),
# "onednn" keeps oneDNN's split (to compare, or to step around a problem with the kernel).
GEMM_CHOICE_ENV = "QURL_VERL_CPU_INT8_GEMM"
GEMM_CHOICES = ("auto", "onednn")


def gemm_choice() -> str:
    """The validated value of ``QURL_VERL_CPU_INT8_GEMM`` (default ``auto``)."""
    value = os.environ.get(GEMM_CHOICE_ENV, "").strip().lower() or "auto"
    if value not in GEMM_CHOICES:
        raise ValueError(f"{GEMM_CHOICE_ENV}={value!r}: expected 'auto' (the packed AVX2 INT8 GEMM on CPUs "
                         "whose oneDNN int8 GEMM saturates) or 'onednn' (oneDNN's exact split GEMM there)")
    return value


def cpu_int8_saturates(flags: set[str]) -> bool:
    """oneDNN's int8 GEMM saturates on x86 without VNNI or AMX (the worker confirms with a probe GEMM)."""
    return not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


def cpu_supports_kernel(flags: set[str]) -> bool:
    """The kernel uses AVX2 integer instructions only (vpsignb, vpmaddubsw, vpmaddwd)."""
    return "avx2" in flags


# torch's loader waits without limit on the lock file of a build in progress; one left behind by a killed
# build would hang every later load. A build takes ~15 s: a lock older than this is given up on.
BUILD_LOCK_WAIT_S = 300.0


def build_directory() -> Path:
    """Per user, Python and torch version (the .so links against both)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}"
    return Path(root) / tag / _EXTENSION_NAME


def wait_for_build_lock(lock: Path, timeout_s: float) -> bool:
    """True once no other build holds ``lock`` (at once if none does); False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while lock.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@functools.lru_cache(maxsize=1)
def load() -> bool:
    """Build (once per machine and torch version) and load the kernel; False, logged, if it cannot be."""
    if not cpu_supports_kernel(cpu_flags()):
        return False
    build_dir = build_directory()
    if not wait_for_build_lock(build_dir / "lock", BUILD_LOCK_WAIT_S):
        logger.warning("qurl-verl: %s has been locked for over %.0f s (a killed build leaves it behind); INT8 linears "
                       "stay on oneDNN. Delete the file to rebuild the AVX2 INT8 GEMM.", build_dir / "lock",
                       BUILD_LOCK_WAIT_S)
        return False
    try:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)

        try:  # the `ninja` wheel ships its binary outside PATH when the venv is not activated
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        cpp_extension.load(
            name=_EXTENSION_NAME,
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, read-only cache: the caller keeps oneDNN
        logger.warning("qurl-verl: cannot build the AVX2 INT8 GEMM (%s: %s); INT8 linears stay on oneDNN",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    global _fake_registered
    if not _fake_registered:  # shapes without data, for vLLM engines that trace the model (enforce_eager=false)
        torch.library.register_fake("qurl_cpu::int8_gemm_avx2")(_int8_gemm_shape)
        _fake_registered = True
    return True


_fake_registered = False


def _int8_gemm_shape(a_codes, a_scale, packed, w_scale, bias, n, out_dtype):
    return a_codes.new_empty((a_codes.shape[0], n), dtype=out_dtype)


def pack_weight(codes: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] codes -> the kernel's layout [ceil(N/4), ceil(K/32), 4, 32], zero padded."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"expected int8 [N, K] weight codes, got {codes.dtype} {tuple(codes.shape)}")
    if int(codes.amin()) < -WEIGHT_CODE_MAX:
        raise ValueError("weight code -128 found; the AVX2 kernel needs codes in [-127, 127]")
    n, k = codes.shape
    n_pad, k_pad = -n % BLOCK_ROWS, -k % CHUNK
    w = F.pad(codes, (0, k_pad, 0, n_pad))
    return w.reshape((n + n_pad) // BLOCK_ROWS, BLOCK_ROWS, (k + k_pad) // CHUNK, CHUNK).transpose(1, 2).contiguous()


def int8_gemm(a_codes: torch.Tensor, a_scale: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """(a_codes @ w_codes.T) * a_scale * w_scale.T (+ bias), integer products exact; [M, N] of out_dtype."""
    return torch.ops.qurl_cpu.int8_gemm_avx2(
        a_codes.contiguous(), a_scale.reshape(-1).float().contiguous(), packed,
        w_scale.reshape(-1).float().contiguous(), bias, n, out_dtype)
