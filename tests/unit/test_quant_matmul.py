"""W8A8 matmuls and the W8A8Linear stand-in against integer / float64 references."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from qurl_verl.quant import (
    INT8_CHANNEL,
    INT8_TOKEN,
    W8A8Linear,
    fp8_scaled_matmul,
    int8_matmul_accumulate,
    parse_scheme,
    quantize,
    quantize_linear_modules_,
    quantize_state_dict,
    w8a8_linear,
    w8a8_linear_reference,
)

pytestmark = pytest.mark.both_stacks  # torch behaviour whose version differs between the stacks


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rand_codes(*shape, seed=0):
    return torch.randint(-127, 128, shape, generator=gen(seed), dtype=torch.int8)


def rand(*shape, seed=0, std=1.0):
    return torch.randn(*shape, generator=gen(seed)) * std


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (3, 7, 5), (17, 2000, 100), (4, 896, 4864)])
def test_int8_accumulator_is_exact(m, k, n):
    a, b = rand_codes(m, k, seed=1), rand_codes(n, k, seed=2)
    acc = int8_matmul_accumulate(a, b)
    assert acc.dtype == torch.int32
    assert torch.equal(acc.to(torch.int64), a.to(torch.int64) @ b.to(torch.int64).t())


def test_int8_accumulator_at_the_edge_of_the_grid():
    k = 4864  # 127 * 127 * 4864 = 78.4M: past float32's exact-integer range, well inside int32
    a = torch.full((2, k), 127, dtype=torch.int8)
    a[1] = -127
    b = torch.full((3, k), 127, dtype=torch.int8)
    acc = int8_matmul_accumulate(a, b)
    assert torch.equal(acc.to(torch.int64), a.to(torch.int64) @ b.to(torch.int64).t())
    assert int(acc[0, 0]) == 127 * 127 * k


@pytest.mark.parametrize("rowwise", [True, False], ids=["rowwise_scales", "per_tensor_build"])
def test_fp8_scaled_matmul_matches_float64_product_of_codes(monkeypatch, rowwise):
    """Both paths: a build whose ``_scaled_mm`` takes row-wise scales, and one that takes per-tensor
    scales only (CPU before torch 2.13; forced here whatever this build does)."""
    import qurl_verl.quant.matmul as matmul

    if rowwise and not matmul.rowwise_scaled_mm_supported("cpu"):
        pytest.skip(f"torch {torch.__version__} takes per-tensor scales only on CPU")
    monkeypatch.setattr(matmul, "rowwise_scaled_mm_supported", lambda device_type: rowwise)
    a = rand(5, 96, seed=3, std=50).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = rand(24, 96, seed=4, std=50).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa, sb = rand(5, 1, seed=5).abs() + 0.1, rand(24, 1, seed=6).abs() + 0.1
    out = fp8_scaled_matmul(a, b, sa, sb)
    # float32 accumulation of exact fp8 products, two float32 scalings: a few ulps of the largest term
    ref = (a.double() @ b.double().t()) * sa.double() * sb.double().t()
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def elementwise_error_bound(q, exact64):
    """Per-element |Q(v) - v| bound: half a step for INT8, 2^-4 relative (+ subnormal step) for FP8."""
    scale = q.expanded_scale(torch.float64).expand_as(exact64)
    if q.fmt.name == "int8":
        return scale / 2
    return 2.0**-4 * exact64.abs() + 2.0**-10 * scale


CASES = [("int8", "channel"), ("int8", "block"), ("fp8", "channel"), ("fp8", "block")]


@pytest.mark.parametrize("fmt,granularity", CASES)
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (6, 300, 200), (3, 896, 256)])
def test_fast_path_matches_reference_and_unquantized_product(fmt, granularity, m, k, n):
    x, w, bias = rand(2, m, k, seed=7), rand(n, k, seed=8, std=0.02), rand(n, seed=9, std=0.1)
    qw = quantize(w, parse_scheme(fmt, granularity))
    out = w8a8_linear(x, qw, bias=bias)
    ref = w8a8_linear_reference(x, qw, bias=bias)
    assert out.shape == (2, m, n) and out.dtype == torch.float32
    # Same codes on both sides: they differ only by float32 accumulation and rescaling.
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6 * ref.abs().max().item())

    # Against the unquantized float64 product: |x^ w^ - x w| <= sum_k |ex||w| + |x||ew| + |ex||ew|.
    x64, w64 = x.double(), w.double()
    qx = quantize(x, parse_scheme(fmt, "token" if granularity == "channel" else "group"))
    ex, ew = elementwise_error_bound(qx, x64), elementwise_error_bound(qw, w64)
    bound = ex @ w64.abs().t() + x64.abs() @ ew.t() + ex @ ew.t()
    exact = x64 @ w64.t() + bias.double()
    assert ((out.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-6).all()
    assert (out.double() - exact).abs().max() > 0  # it really is quantized


def test_output_dtype_follows_input_and_zero_tokens_give_bias():
    w, bias = rand(32, 64, seed=10, std=0.02), rand(32, seed=11)
    x = rand(4, 64, seed=12).to(torch.bfloat16)
    x[2] = 0
    out = w8a8_linear(x, quantize(w, INT8_CHANNEL), bias=bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[2], bias.to(torch.bfloat16))
    with pytest.raises(ValueError, match="features"):
        w8a8_linear(rand(4, 63), quantize(w, INT8_CHANNEL))


def vllm_w8a8_int8(x, w, bias):
    """vLLM's W8A8 INT8 written out: per-token dynamic symmetric activations, per-channel weights, fp32 epilogue."""
    x32, w32 = x.float(), w.float()
    xs = x32.abs().amax(-1, keepdim=True) / 127
    ws = w32.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(x32 / xs).clamp(-127, 127).to(torch.int64)
    wq = torch.round(w32 / ws).clamp(-127, 127).to(torch.int64)
    return (xq @ wq.t()).double() * xs.double() * ws.double().t() + bias.double()


@pytest.mark.parametrize("fake", [False, True])
def test_w8a8_linear_module_mimics_vllm_int8(fake):
    linear = nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight.copy_(rand(40, 96, seed=13, std=0.05))
        linear.bias.copy_(rand(40, seed=14, std=0.1))
    layer = W8A8Linear.from_linear(linear, INT8_CHANNEL, fake=fake)
    x = rand(3, 7, 96, seed=15)
    ref = vllm_w8a8_int8(x, linear.weight.detach(), linear.bias.detach())
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    sd = layer.state_dict()
    assert sd["weight"].dtype == torch.int8 and sd["weight_scale"].shape == (40, 1)

    # A weight sync re-quantizes in place.
    new_weight = linear.weight.detach() * 1.1
    layer.load_weight_(new_weight)
    ref = vllm_w8a8_int8(x, new_weight, linear.bias.detach())
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("fmt,granularity", CASES[1:])
def test_w8a8_linear_module_real_and_fake_agree(fmt, granularity):
    linear = nn.Linear(200, 136, bias=False)
    real = W8A8Linear.from_linear(linear, parse_scheme(fmt, granularity))
    fake = W8A8Linear.from_linear(linear, parse_scheme(fmt, granularity), fake=True)
    x = rand(5, 200, seed=16)
    a, b = real(x).double(), fake(x).double()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def test_module_swap_matches_compressed_tensors_emission(tiny_causal_lm):
    model = tiny_causal_lm("qwen2")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ignore = ("lm_head", "model.layers.1.mlp.down_proj")
    quantize_linear_modules_(model, INT8_CHANNEL, ignore=ignore)
    swapped = {n for n, m in model.named_modules() if isinstance(m, W8A8Linear)}
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    expected = {
        f"model.layers.{i}.{'self_attn' if p in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{p}"
        for i in range(2)
        for p in projections
    } - {"model.layers.1.mlp.down_proj"}
    assert swapped == expected
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, W8A8Linear)
    emitted = dict(quantize_state_dict(original, INT8_CHANNEL, ignore=ignore))
    state = model.state_dict()
    assert set(emitted) == set(state)
    for name, tensor in emitted.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


@pytest.mark.parametrize("bits", [4, 7])
def test_b_bit_weights_through_the_int8_kernel_equal_the_exact_product(bits):
    """A W{b}A8 linear is the INT8 kernel on narrower codes: exact int32 accumulation, then the two scales."""
    from qurl_verl.quant import w8a8_linear

    g = torch.Generator().manual_seed(bits)
    w, x = torch.randn(24, 64, generator=g), torch.randn(5, 64, generator=g)
    qw = quantize(w, parse_scheme(f"int{bits}", "channel"))
    qx = quantize(x, INT8_TOKEN)  # activations stay 8-bit
    exact = (qx.data.double() @ qw.data.double().T) * qx.scale.double() * qw.scale.double().T
    out = w8a8_linear(x, qw, out_dtype=torch.float64)
    # float32 rescaling of an exact int32 sum: two float32 roundings relative to the output
    torch.testing.assert_close(out, exact, rtol=4 * 2 ** -24, atol=1e-30)
