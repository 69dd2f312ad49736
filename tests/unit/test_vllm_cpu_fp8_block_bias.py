"""vLLM-CPU's block-FP8 AMX kernel and a biased linear (``patches/vllm_cpu_worker/vllm_cpu_fp8_block_bias``).

vLLM's own ``CPUFp8BlockScaledMMKernel.apply_weights`` runs on a layer of Qwen2's shape (a bias, bf16
activations), with its op replaced by a pure-torch stand-in that keeps the real op's dtype contract (float32
scales and bias, "expected scalar type Float but found BFloat16" otherwise, as measured on the real op), so
both halves run on any CPU: stock, the call fails; patched, the output is the float64 product of the
dequantized block-FP8 weight plus the bias, within one bf16 rounding of the output. Where this machine's
vLLM library has the real op (AMX CPUs), the patched kernel also runs it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_fp8_block_bias

cpu_kernels = pytest.importorskip("vllm.model_executor.kernels.linear.scaled_mm.cpu")
pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

N, K, BLOCK = 256, 128, 128


def problem():
    gen = torch.Generator().manual_seed(0)
    codes = (torch.randn(N, K, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(N // BLOCK, K // BLOCK, generator=gen) * 0.1 + 0.01
    x = torch.randn(4, K, generator=gen).to(torch.bfloat16)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16)
    return codes, scale, x, bias


def dequantized(codes, scale):
    return codes.double() * scale.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)


def stand_in_op(x, weight, scale, block, bias, out_dtype, is_vnni):
    """``fp8_scaled_mm_cpu`` on an unpacked weight, with the real op's dtype checks."""
    if scale.dtype != torch.float32:
        raise RuntimeError("fp8_scaled_mm_cpu: expect scales2 to be float32.")
    if bias is not None and bias.dtype != torch.float32:
        raise RuntimeError("expected scalar type Float but found BFloat16")
    out = x.double() @ dequantized(weight, scale).t()
    return (out if bias is None else out + bias.double()).to(out_dtype)


def run_kernel(codes, scale, x, bias):
    """vLLM's ``apply_weights`` (patched or not, as the class holds it now) on a layer of these tensors."""
    params = SimpleNamespace(weight=codes, weight_scale_inv=scale, weight_scale=None)
    kernel = SimpleNamespace(_get_layer_params=lambda layer: params, weight_group_shape=(BLOCK, BLOCK))
    return cpu_kernels.CPUFp8BlockScaledMMKernel.apply_weights(kernel, torch.nn.Module(), x, bias)


@pytest.fixture
def restore_kernel(monkeypatch):
    kernel = cpu_kernels.CPUFp8BlockScaledMMKernel
    monkeypatch.setattr(kernel, "apply_weights", getattr(kernel.apply_weights, "__wrapped__", kernel.apply_weights))


def test_stock_kernel_fails_a_biased_bf16_linear_and_the_patch_runs_it(restore_kernel, monkeypatch):
    monkeypatch.setattr(torch.ops._C, "fp8_scaled_mm_cpu", stand_in_op, raising=False)
    codes, scale, x, bias = problem()
    with pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"):
        run_kernel(codes, scale, x, bias)
    assert vllm_cpu_fp8_block_bias.apply()
    assert vllm_cpu_fp8_block_bias.apply() == ""  # once per process
    out = run_kernel(codes, scale, x, bias)
    want = x.double() @ dequantized(codes, scale).t() + bias.double()
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), want, rtol=2**-8, atol=0), (out - want).abs().max()
    assert torch.equal(run_kernel(codes, scale, x, None), stand_in_op(x, codes, scale, None, None, torch.bfloat16, True))


def test_patched_kernel_runs_the_real_op_where_this_cpu_has_it(restore_kernel):
    from vllm import _custom_ops

    if not getattr(_custom_ops, "_supports_cpu_fp8_w8a16", False) or not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU's vLLM library has no block-FP8 AMX op (AMX CPUs only)")
    codes, scale, x, bias = problem()
    packed = torch.ops._C.convert_weight_packed(codes)
    assert vllm_cpu_fp8_block_bias.apply() in ("", "wrapped CPUFp8BlockScaledMMKernel.apply_weights")
    out = run_kernel(packed, scale, x, bias)
    want = x.double() @ dequantized(codes, scale).t() + bias.double()
    # bf16 activations in a float32 AMX accumulation, one bf16 rounding of the output
    assert torch.allclose(out.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max()), (out - want).abs().max()
