"""vLLM's CUDA INT8 and FP8 linear kernels in a vLLM-CPU engine: vLLM's own selector chooses them, vLLM's own
post-processing and Python wrappers run, and pure-torch stand-ins take the place of the GPU code underneath. INT8:
``CutlassInt8ScaledMMLinearKernel``, ``TritonInt8ScaledMMLinearKernel``; FP8: ``CutlassFP8ScaledMMLinearKernel``
(per-channel weights, per-token activations), ``CutlassFp8BlockScaledMMKernel`` and ``TritonFp8BlockScaledMMKernel``
(128 x 128 weight blocks, 1 x 128 activation groups; Triton's is what vLLM gives an Ada GPU, sm89).

How the choice is forced (``force_choice``, ``force_fp8_choice``), as narrowly as the selector allows:

* vLLM's selector (``choose_scaled_mm_linear_kernel``) tries ``_POSSIBLE_INT8_KERNELS[current_platform._enum]``
  (``_POSSIBLE_FP8_KERNELS``, ``_POSSIBLE_FP8_BLOCK_KERNELS`` for FP8), the CPU lists here: the classes go to their
  front, the INT8 ones in the order of vLLM's CUDA list (Cutlass, then Triton). Everything else of the selection
  runs as written: ``VLLM_DISABLED_KERNELS``, the compute capability it asks the platform for (``None`` on a CPU;
  none of the classes reads it), each class's ``is_supported`` and ``can_implement``.
* Each class's ``is_supported`` asks ``current_platform.is_cuda()`` (Cutlass INT8, Cutlass FP8 on vLLM 0.24) or
  ``.is_cuda_alike()`` (Triton) through the ``current_platform`` name of its own module (``scaled_mm/cutlass.py``,
  ``scaled_mm/triton.py``). That name, in those two modules only, becomes a view of the real CPU platform that
  answers these two questions as a CUDA platform does and delegates everything else. The block FP8 class reads
  ``CUTLASS_BLOCK_FP8_SUPPORTED`` and vLLM 0.32's per-channel one calls ``cutlass_fp8_supported()``: the names
  ``scaled_mm/cutlass.py`` imported from ``w8a8_utils``, where they ask the CUDA library; they answer yes in that
  module only. No other module sees a CUDA platform: the selector, the model, attention, ``QuantFP8``,
  ``_custom_ops`` (whose ``cutlass_scaled_mm`` asks ``is_rocm()``: False on both).
* Triton's block FP8 class (``force_fp8_triton_block_choice``) goes to the front of the block list behind Cutlass's,
  in vLLM's CUDA order; ``CUTLASS_BLOCK_FP8_SUPPORTED`` keeps this machine's answer, no, which is an Ada GPU's
  (vLLM's Cutlass block FP8 needs 9.0), so the selector passes over Cutlass to Triton, whose ``is_supported`` asks
  ``current_platform.is_cuda_alike()`` of ``scaled_mm/triton.py``: the view above.

The stand-ins (``install_ops``), for the GPU code the classes reach through vLLM's wrappers:

* ``torch.ops._C.cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias)``, what ``_custom_ops.cutlass_scaled_mm``
  calls after its own checks (output bf16/fp16, bias of the output dtype; B's sides multiples of 16, else it
  takes Triton). It asserts what the CUDA op's entry point checks (``csrc/quantization/w8a8/cutlass/
  scaled_mm_entry.cu``): 2-D A row-major and B **column-major** (``b.stride(0) == 1``: the ``weight.t()`` vLLM's
  post-processing leaves, or the ``weight.T`` the block class passes), both int8 or both float8_e4m3fn,
  row-major out, 16-byte aligned leading dimensions, float32 scales, a contiguous 1-D bias of N elements. The
  scales choose the path as the op's dispatch (``c3x/scaled_mm_helper.hpp``) does: 1 or M elements (A) and 1
  or N (B), contiguous, per tensor, token, channel; otherwise block-scaled, which takes float8 codes, no bias,
  A's scales [M, K / 128] M-major and B's [K / 128, N / 128] K-major (``stride(0) == 1``, or a contiguous
  vector: what the sm90 block kernel checks, ``c3x/scaled_mm_blockwise_sm90_fp8_dispatch.cuh``; the sm100 one
  reads the same layout). ``CALLS`` counts its calls by path;
* the Triton kernel launch inside ``triton_scaled_mm`` (``scaled_mm_kernel[grid](...)``): vLLM's wrapper runs
  with its asserts (shapes, dtypes, ``is_weak_contiguous``) and tile heuristic (``triton.next_power_of_2``, which
  vLLM's Triton placeholder lacks, is given to it); the stand-in reads A and B through the pointers and strides
  the launch passes, as the kernel does, so a weight whose strides do not say its layout computes garbage.
* the Triton kernel launch inside ``fp8_utils.w8a8_triton_block_scaled_mm`` (``_w8a8_triton_block_scaled_mm[grid]
  (...)``), which ``TritonFp8BlockScaledMMKernel`` reaches through vLLM's ``w8a8_triton_block_scaled_mm_func`` op:
  vLLM's wrapper runs with its asserts (A contiguous, the scales' block counts) and its default tile (no tuned
  config for this device), and the stand-in reads A [M, K], B (the [N, K] weight, as [K, N]) and both scales through
  the pointers and strides the launch passes, as the kernel does; it asserts float8 codes and that a K tile of the
  launch stays within one scale group (the kernel loads one scale per tile). ``CALLS`` counts them too;
* ``_custom_ops.scaled_int8_quant`` is not stood in for: vLLM-CPU's library has ``dynamic_scaled_int8_quant``.
  Nor is FP8's activation quantization: vLLM's ``QuantFP8`` runs its ``forward_native`` on a CPU (on a GPU its
  CUDA kernels, the same absmax recipe).

All compute exactly: int8 codes multiplied with int64 accumulation, float8 codes in float64 (exact sums, see
``_exact``), the scales (and bias) applied in float64 (per K-block before summing the blocks, for block scales),
one rounding to the output dtype. A test's tolerance then states the output's rounding only. (The real kernels
rescale in float32; Triton on vLLM 0.24 adds the bias after rounding to the output dtype, and so does vLLM's block
FP8 wrapper, around the op.)
"""
from __future__ import annotations

from collections import Counter

import torch

CUTLASS = "CutlassInt8ScaledMMLinearKernel"
TRITON = "TritonInt8ScaledMMLinearKernel"
CUTLASS_FP8 = "CutlassFP8ScaledMMLinearKernel"
CUTLASS_FP8_BLOCK = "CutlassFp8BlockScaledMMKernel"
TRITON_FP8_BLOCK = "TritonFp8BlockScaledMMKernel"
BLOCK = 128  # the block-scaled GEMM's group: 1 x 128 of the activations, 128 x 128 of the weights
CALLS = Counter()  # the stand-in ops' calls in this process (Cutlass by scaling and code dtype, Triton block FP8)
TRITON_BLOCK_CALL = "triton block float8_e4m3fn"
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
    """scale_a * scale_b * (a @ b) + bias in float64 ([M, K] @ [K, N]; scales of 1, M or N elements): int64 sums of
    int8 codes, or float64 sums of float8 codes (exact: every product of two e4m3 values is a multiple of 2**-18
    below 2**18, so sums of fewer than 2**16 of them fit float64's 53 bits)."""
    wide = torch.int64 if a.dtype == torch.int8 else torch.float64
    acc = a.to(wide) @ b.to(wide)
    out = acc.double() * scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double().reshape(1, -1)
    return out


def _exact_blockwise(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     group_k: int = BLOCK, group_n: int = BLOCK) -> torch.Tensor:
    """sum over K-groups kb of scale_a[m, kb] * scale_b[kb, n // group_n] * (a[m, kb] @ b[kb, n]) in float64:
    activations scaled per (token, 1 x group_k group), weights per group_k x group_n block; each group's sum exact."""
    k, n = b.shape
    out = torch.zeros(a.shape[0], n, dtype=torch.float64)
    for kb, start in enumerate(range(0, k, group_k)):
        part = a[:, start:start + group_k].double() @ b[start:start + group_k].double()
        b_scale = scale_b[kb].double().repeat_interleave(group_n)[:n]
        out += part * scale_a[:, kb].double().reshape(-1, 1) * b_scale.reshape(1, -1)
    return out


def _is_contiguous_vector(t: torch.Tensor) -> bool:
    return t.is_contiguous() and (t.dim() == 1 or (t.dim() == 2 and min(t.shape) == 1))


def cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias=None) -> None:
    """``torch.ops._C.cutlass_scaled_mm``: out[M, N] = (a_scales * b_scales * (a @ b) + bias), in place; the
    scales per tensor, token (A) and channel (B), or, for float8 codes, per (token, 1 x 128 group) of A and per
    128 x 128 block of B, told apart by their element counts as the op tells them."""
    assert a.dim() == 2 and b.dim() == 2 and out.dim() == 2, (a.shape, b.shape, out.shape)
    assert out.shape[0] == a.shape[0] and a.shape[1] == b.shape[0] and b.shape[1] == out.shape[1], (
        a.shape, b.shape, out.shape)
    assert a.dtype == b.dtype and a.dtype in (torch.int8, torch.float8_e4m3fn), (a.dtype, b.dtype)
    assert out.dtype in (torch.bfloat16, torch.float16), out.dtype
    assert a.stride(1) == 1 and out.stride(1) == 1, ("A and out row-major", a.stride(), out.stride())
    assert b.stride(0) == 1, ("B column-major (vLLM's weight.t())", b.shape, b.stride())
    assert out.stride(0) % 16 == 0 and b.stride(1) % 16 == 0, ("16-byte alignment", out.stride(), b.stride())
    if bias is not None:
        assert bias.dim() == 1 and bias.numel() == b.shape[1] and bias.is_contiguous() and bias.dtype == out.dtype, (
            bias.shape, bias.dtype)
    (m, k), n = a.shape, b.shape[1]
    assert a_scales.dtype == torch.float32 and b_scales.dtype == torch.float32, (a_scales.dtype, b_scales.dtype)
    if a_scales.numel() in (1, m) and b_scales.numel() in (1, n):  # per tensor, token, channel
        assert a_scales.is_contiguous() and b_scales.is_contiguous(), (a_scales.stride(), b_scales.stride())
        CALLS["per-channel " + str(a.dtype).rpartition(".")[2]] += 1
        out.copy_(_exact(a, b, a_scales.reshape(-1), b_scales.reshape(-1), bias).to(out.dtype))
        return
    groups = -(-k // BLOCK)
    assert a.dtype == torch.float8_e4m3fn, ("block scales take float8 codes", a.dtype)
    assert a_scales.dim() == 2 and tuple(a_scales.shape) == (m, groups), ("A scales per 1 x 128 group", a_scales.shape)
    assert b_scales.dim() == 2 and tuple(b_scales.shape) == (groups, -(-n // BLOCK)), (
        "B scales per 128 x 128 block", b_scales.shape)
    assert bias is None, "no bias in the block-scaled GEMM"
    assert a_scales.stride(0) == 1 or _is_contiguous_vector(a_scales), ("A scales M-major", a_scales.stride())
    assert b_scales.stride(0) == 1 or _is_contiguous_vector(b_scales), ("B scales K-major", b_scales.stride())
    CALLS["block float8_e4m3fn"] += 1
    out.copy_(_exact_blockwise(a, b, a_scales, b_scales).to(out.dtype))


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


class TritonBlockScaledMMLaunch:
    """``_w8a8_triton_block_scaled_mm[grid](...)`` of ``w8a8_triton_block_scaled_mm``: C = sum over K groups of
    As[m, g] * Bs[g, n // group_n] * (A @ B)[group g], with A, B (the [N, K] weight read as [K, N]), the scales and
    C read and written through the pointers and strides of the launch."""

    def __getitem__(self, grid):
        return self.launch

    @staticmethod
    def launch(A, B, C, As, Bs, M, N, K, group_n, group_k, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
               stride_cn, stride_As_m, stride_As_k, stride_Bs_k, stride_Bs_n, **meta) -> None:  # noqa: N803 - vLLM's names
        assert A.dtype == torch.float8_e4m3fn and B.dtype == torch.float8_e4m3fn, (A.dtype, B.dtype)
        assert C.dtype in (torch.bfloat16, torch.float16, torch.float32), C.dtype
        assert group_k % meta["BLOCK_SIZE_K"] == 0, ("one scale group per K tile", group_k, meta)
        groups_k, groups_n = -(-K // group_k), -(-N // group_n)
        a = torch.as_strided(A, (M, K), (stride_am, stride_ak), A.storage_offset())
        b = torch.as_strided(B, (K, N), (stride_bk, stride_bn), B.storage_offset())
        a_s = torch.as_strided(As, (M, groups_k), (stride_As_m, stride_As_k), As.storage_offset())
        b_s = torch.as_strided(Bs, (groups_k, groups_n), (stride_Bs_k, stride_Bs_n), Bs.storage_offset())
        c = torch.as_strided(C, (M, N), (stride_cm, stride_cn), C.storage_offset())
        CALLS[TRITON_BLOCK_CALL] += 1
        c.copy_(_exact_blockwise(a, b, a_s, b_s, group_k, group_n).to(c.dtype))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def install_ops(setattr_=setattr) -> None:
    """The stand-ins, where vLLM's wrappers look them up at each call."""
    from vllm.model_executor.layers.quantization.compressed_tensors import triton_scaled_mm as triton_module
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    setattr_(torch.ops._C, "cutlass_scaled_mm", cutlass_scaled_mm)
    setattr_(triton_module, "scaled_mm_kernel", TritonScaledMMLaunch())
    setattr_(fp8_utils, "_w8a8_triton_block_scaled_mm", TritonBlockScaledMMLaunch())
    if not hasattr(triton_module.triton, "next_power_of_2"):  # vLLM's placeholder where Triton is not installed
        setattr_(triton_module.triton, "next_power_of_2", _next_power_of_2)


def _cuda_view_in_cutlass_module(setattr_) -> None:
    """``current_platform`` of ``scaled_mm/cutlass.py`` (what its classes' ``is_supported`` ask) seen as CUDA."""
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass as cutlass_module

    if not getattr(cutlass_module.current_platform, _FORCED, False):
        setattr_(cutlass_module, "current_platform", CudaPlatformView(cutlass_module.current_platform))


def _put_first(kernel_lists: dict, classes) -> list[str]:
    from vllm.platforms import current_platform

    kernels = kernel_lists.setdefault(current_platform._enum, [])
    added = [k for k in classes if k not in kernels]
    kernels[0:0] = added
    return [k.__name__ for k in added]


def _cuda_view_in_triton_module(setattr_) -> None:
    """``current_platform`` of ``scaled_mm/triton.py`` (what its classes' ``is_supported`` ask) seen as CUDA."""
    from vllm.model_executor.kernels.linear.scaled_mm import triton as triton_module

    if not getattr(triton_module.current_platform, _FORCED, False):
        setattr_(triton_module, "current_platform", CudaPlatformView(triton_module.current_platform))


def force_choice(setattr_=setattr) -> list[str]:
    """vLLM's selector may choose the two CUDA INT8 classes on this platform (see the module docstring); the
    class names put in its list."""
    from vllm.model_executor.kernels.linear import _POSSIBLE_INT8_KERNELS
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass as cutlass_module
    from vllm.model_executor.kernels.linear.scaled_mm import triton as triton_module

    _cuda_view_in_cutlass_module(setattr_)
    _cuda_view_in_triton_module(setattr_)
    return _put_first(_POSSIBLE_INT8_KERNELS, (cutlass_module.CutlassInt8ScaledMMLinearKernel,
                                               triton_module.TritonInt8ScaledMMLinearKernel))


def _fp8_gpu() -> bool:
    """``cutlass_fp8_supported()`` on a GPU of capability 8.9 or later."""
    return True


def force_fp8_choice(setattr_=setattr) -> list[str]:
    """vLLM's selector may choose the Cutlass FP8 classes on this platform: the per-channel one
    (``_POSSIBLE_FP8_KERNELS``; its ``is_supported`` asks ``current_platform.is_cuda()`` on vLLM 0.24, and
    ``cutlass_fp8_supported()`` on 0.32) and the block-scaled one (``_POSSIBLE_FP8_BLOCK_KERNELS``; its
    ``is_supported`` reads ``CUTLASS_BLOCK_FP8_SUPPORTED``). ``cutlass_fp8_supported`` and
    ``CUTLASS_BLOCK_FP8_SUPPORTED`` are the names ``scaled_mm/cutlass.py`` imported from ``w8a8_utils``, which asks the
    CUDA library for the GPU's capability (yes on sm89 and later; block: sm90 and later). All three answers change in
    ``scaled_mm/cutlass.py`` only, to what such a GPU answers; the class names put in the lists."""
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS, _POSSIBLE_FP8_KERNELS
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass as cutlass_module

    _cuda_view_in_cutlass_module(setattr_)
    if hasattr(cutlass_module, "cutlass_fp8_supported"):  # vLLM 0.32
        setattr_(cutlass_module, "cutlass_fp8_supported", _fp8_gpu)
    setattr_(cutlass_module, "CUTLASS_BLOCK_FP8_SUPPORTED", True)
    return (_put_first(_POSSIBLE_FP8_KERNELS, (cutlass_module.CutlassFP8ScaledMMLinearKernel,))
            + _put_first(_POSSIBLE_FP8_BLOCK_KERNELS, (cutlass_module.CutlassFp8BlockScaledMMKernel,)))


def force_fp8_triton_block_choice(setattr_=setattr) -> list[str]:
    """vLLM's selector may choose Triton's block FP8 class on this platform as on an Ada GPU: Cutlass's block class
    ahead of it, in vLLM's CUDA order, declines (``CUTLASS_BLOCK_FP8_SUPPORTED`` keeps this machine's no, an sm89's
    answer too), Triton's ``is_supported`` sees CUDA in ``scaled_mm/triton.py``; the class names put in the list."""
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass as cutlass_module
    from vllm.model_executor.kernels.linear.scaled_mm import triton as triton_module

    _cuda_view_in_triton_module(setattr_)
    return _put_first(_POSSIBLE_FP8_BLOCK_KERNELS, (cutlass_module.CutlassFp8BlockScaledMMKernel,
                                                    triton_module.TritonFp8BlockScaledMMKernel))


def install(setattr_=setattr) -> list[str]:
    install_ops(setattr_)
    return force_choice(setattr_)


def install_fp8(setattr_=setattr) -> list[str]:
    install_ops(setattr_)
    return force_fp8_choice(setattr_)


def install_fp8_triton_block(setattr_=setattr) -> list[str]:
    install_ops(setattr_)
    return force_fp8_triton_block_choice(setattr_)
