"""W8A8 matmuls: a float64 reference and the 8-bit paths vLLM's kernels compute.

Every path quantizes the activations dynamically (``token`` for channel weights, 1 x block
``group`` for block weights) with the same format as the weight, multiplies 8-bit codes, and
rescales the accumulator in float32: ``out = (x_q @ w_q^T) * x_scale * w_scale + bias``.
For block weights the K dimension is split into blocks, each block's product is rescaled by
its own scales and the partial results are summed in float32, as block-scaled GEMMs do.
"""
from __future__ import annotations

import functools

import torch

from .formats import Granularity
from .quantizer import QuantizedTensor, quantize
from .scheme import QuantScheme


def w8a8_linear_reference(
    x: torch.Tensor,
    qw: QuantizedTensor,
    activations: QuantScheme | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 result of quantize(x) @ dequantize(w)^T (+ bias): the ground truth for the fast paths.
    ``activations``: how ``x`` is quantized; default the weight's codes at the paired activation granularity."""
    qx = quantize(x, activations or qw.scheme.at(qw.granularity.activation))
    out = qx.dequantize(torch.float64) @ qw.dequantize(torch.float64).t()
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out


def int8_matmul_accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int32 ``a @ b^T`` for int8 ``a`` [M, K] and ``b`` [N, K] via ``torch._int_mm``.

    On CPU ``_int_mm`` accepts any shape; on CUDA it needs M > 16 and K, N multiples of 8.
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8 operands expected, got {a.dtype} and {b.dtype}")
    return torch._int_mm(a.contiguous(), b.contiguous().t())


def fp8_scaled_matmul(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> torch.Tensor:
    """float32 ``(a @ b^T) * scale_a * scale_b`` for float8 ``a`` [M, K], ``b`` [N, K] via ``torch._scaled_mm``.

    ``scale_a`` is [M, 1] and ``scale_b`` [N, 1] (row-wise). Fast on Hopper-class GPUs; on CPU it
    is emulated and about 45x slower than a bf16 matmul of the same shape, so use it there for
    correctness only (``W8A8Linear(fake=True)`` is the quick CPU stand-in). Where the build takes
    only per-tensor scales (CPU before torch 2.13), the codes are multiplied with unit scales and
    the float32 product rescaled after, as a row-wise kernel's epilogue does.
    """
    scale_a = scale_a.to(torch.float32).reshape(-1, 1).contiguous()
    scale_b = scale_b.to(torch.float32).reshape(1, -1).contiguous()
    if not rowwise_scaled_mm_supported(a.device.type):
        one = torch.ones((), dtype=torch.float32, device=a.device)
        product = torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return product * scale_a * scale_b
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                            out_dtype=torch.float32)


@functools.cache
def rowwise_scaled_mm_supported(device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` takes row-wise scales on this device type (CPU: torch >= 2.13;
    the CUDA builds that run FP8 take them). Probed once with a 2 x 16 x 2 product (two scales a side:
    one each would pass as per-tensor)."""
    if device_type != "cpu":
        return True
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def _int8_rescaled(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return int8_matmul_accumulate(xq, wq).to(torch.float32) * xs * ws.reshape(1, -1)


def _fp8_rescaled(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return fp8_scaled_matmul(xq, wq, xs, ws)


def w8a8_linear(
    x: torch.Tensor,
    qw: QuantizedTensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """8-bit W8A8 linear on real codes: ``_int_mm`` for INT8, ``_scaled_mm`` for FP8.

    ``x`` is [..., K]; the result is [..., N] in ``out_dtype`` (default ``x.dtype``). On CPU the
    INT8 path is faster than a bf16 matmul for decode-sized batches, while FP8 ``_scaled_mm`` is
    emulated (~45x slower than bf16): use it there to check numbers, not for speed.
    """
    if x.shape[-1] != qw.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {qw.shape[1]}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rescaled = _int8_rescaled if qw.fmt.dtype == torch.int8 else _fp8_rescaled
    qx = quantize(x2, qw.scheme.activations)
    if qw.granularity is Granularity.CHANNEL:
        out = rescaled(qx.data, qx.scale, qw.data, qw.scale)
    else:
        b, n = qw.block_size, qw.shape[0]
        out = None
        for kb in range(qw.scale.shape[1]):
            cols = slice(kb * b, (kb + 1) * b)
            w_scale = qw.scale[:, kb].repeat_interleave(b)[:n]
            part = rescaled(qx.data[:, cols], qx.scale[:, kb : kb + 1], qw.data[:, cols], w_scale)
            out = part if out is None else out.add_(part)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype or x.dtype).reshape(*lead, qw.shape[0])
