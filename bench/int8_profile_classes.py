"""What the INT8 batch-1 profile runs over: the CPU classes (native and AVX2 emulations), the mid model's
linear shapes, and how many weight copies stream from memory rather than the cache.
"""
from __future__ import annotations

import os
from pathlib import Path

from bench_models import SPECS

from qurl_verl.platform.cpu_features import cpu_class, cpu_model_and_flags

MS = (1, 8, 32)
OPS = ("quant", "int8_gemm", "split_gemm", "split_add", "int8_7bit_gemm", "bf16_linear", "w8a16_int8pack",
       "avx2_packed_gemm")
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX2_FULL_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# in-process engine (the profiler sees it) on one thread, as the rollout bench's engine computes on one core
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


def layer_shapes(model: str = "mid") -> list[dict]:
    """(name, N, K, bias) of the four quantized linears of one Qwen2 decoder layer (lm_head stays BF16)."""
    spec = SPECS[model]
    hidden, inter = spec["hidden_size"], spec["intermediate_size"]
    head_dim = hidden // spec["num_heads"]
    qkv = (spec["num_heads"] + 2 * spec["num_kv_heads"]) * head_dim
    return [
        {"name": "qkv_proj", "n": qkv, "k": hidden, "bias": True},
        {"name": "o_proj", "n": hidden, "k": hidden, "bias": False},
        {"name": "gate_up_proj", "n": 2 * inter, "k": hidden, "bias": False},
        {"name": "down_proj", "n": hidden, "k": inter, "bias": False},
    ]


def cpu_info() -> dict:
    model, flags = cpu_model_and_flags()
    return {"model": model, "cores": os.cpu_count(), "flags": sorted(flags)}


def last_level_cache_bytes() -> int:
    """L3 size: the timed weights must exceed it to come from memory, as in decode."""
    path = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    text = path.read_text().strip() if path.exists() else "32768K"
    return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)


def weight_copies(shape: dict, stream_bytes: int) -> int:
    """Copies of a [N, K] weight whose int8 codes together hold at least ``stream_bytes``."""
    return max(1, -(-stream_bytes // (shape["n"] * shape["k"])))


def cpu_classes(flags: list[str]) -> list[dict]:
    """The native class, plus the AVX2 emulations where this CPU is above AVX2."""
    native = {"name": cpu_class(set(flags)), "env": {}, "avx2_kernels": False,
              "what": "native: every kernel uses this CPU's ISA"}
    if native["name"] in ("avx2", "avx2_vnni"):
        return [native]
    return [
        native,
        {"name": "avx2_onednn_emulated", "env": AVX2_ENV, "avx2_kernels": False,
         "what": "ONEDNN_MAX_CPU_ISA=AVX2: oneDNN runs its AVX2 kernels (no VNNI, no AVX-512 BF16); vLLM's own "
                 "kernels (vllm._C) and torch's keep this CPU's AVX-512"},
        {"name": "avx2_emulated", "env": AVX2_FULL_ENV, "avx2_kernels": True,
         "what": "ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2 and vLLM's _C_AVX2 library (what vLLM "
                 "loads without AVX-512): every kernel on the AVX2 code path; cores, clocks, caches and "
                 "memory remain this machine's"},
    ]
