"""quantize(): scales, codes and round-trip error against float64 references written from the formats' definitions."""
from __future__ import annotations

import math

import pytest
import torch

from qurl_verl.quant import FP8_CHANNEL, FP8_E4M3, INT8, INT8_CHANNEL, parse_scheme, quantize
from qurl_verl.quant.quantizer import MIN_SCALE

pytestmark = pytest.mark.both_stacks  # torch behaviour whose version differs between the stacks

QWEN_05B_SHAPES = [(896, 4864), (128, 896)]  # Qwen2-0.5B down_proj and k/v_proj


def randw(*shape, seed=0, std=0.02, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g, dtype=torch.float64) * std
    # heavy-tailed rows, as in trained LLM weights
    w.view(-1, shape[-1])[0, :3] = torch.tensor([0.5, -0.3, 0.2], dtype=torch.float64)
    return w.to(dtype)


def ref_round_half_even(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties to even, written without torch.round."""
    f = torch.floor(v)
    frac = v - f
    up = (frac > 0.5) | ((frac == 0.5) & (torch.remainder(f, 2) == 1))
    return f + up.to(v.dtype)


def ref_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the E4M3 grid (3 mantissa bits, min normal 2^-6, max 448), ties to even."""
    a = v.abs().clamp(max=448.0)
    exp = torch.floor(torch.log2(a.clamp(min=2.0**-6))).clamp(min=-6)
    ulp = torch.exp2(exp - 3)
    return torch.sign(v) * (ref_round_half_even(a / ulp) * ulp).clamp(max=448.0)


def expand_blocks(scale: torch.Tensor, n: int, k: int, b: int = 128) -> torch.Tensor:
    return scale.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]


def ref_block_scales(w64: torch.Tensor, qmax: float, b: int = 128) -> torch.Tensor:
    n, k = w64.shape
    out = torch.empty(math.ceil(n / b), math.ceil(k / b), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = w64[i * b : (i + 1) * b, j * b : (j + 1) * b].abs().max() / qmax
    return out


def not_near_tie(v: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    return ((v - torch.floor(v)) - 0.5).abs() > tol


@pytest.mark.parametrize(
    "shape,dtype",
    [((37, 53), torch.float32), ((37, 53), torch.bfloat16), ((128, 896), torch.bfloat16)]
    + [(s, torch.float32) for s in QWEN_05B_SHAPES],
)
def test_int8_channel_matches_float64_reference(shape, dtype):
    w = randw(*shape, dtype=dtype)
    q = quantize(w, INT8_CHANNEL)
    w64 = w.to(torch.float64)
    scale_ref = w64.abs().amax(dim=1, keepdim=True) / 127
    assert q.data.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.scale.shape == (shape[0], 1)
    torch.testing.assert_close(q.scale.to(torch.float64), scale_ref, rtol=2**-23, atol=0)
    v = w64 / q.scale.to(torch.float64)
    codes_ref = ref_round_half_even(v).clamp(-127, 127)
    ok = not_near_tie(v)
    assert torch.equal(torch.where(ok, q.data.to(torch.float64), codes_ref), codes_ref)
    assert q.data.abs().amax(dim=1).eq(127).all()  # each row's absmax lands on the edge of the grid
    err = (q.dequantize(torch.float64) - w64).abs()
    assert (err <= q.scale.to(torch.float64) / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("shape", [(37, 53), (896, 4864)])
def test_fp8_channel_codes_and_error_bound(shape):
    w = randw(*shape, seed=1)
    w[1, 10:30] = torch.linspace(-3e-6, 3e-6, 20)  # codes in E4M3's subnormal range
    q = quantize(w, FP8_CHANNEL)
    w64 = w.to(torch.float64)
    scale = q.scale.to(torch.float64)
    torch.testing.assert_close(scale, w64.abs().amax(dim=1, keepdim=True) / 448, rtol=2**-23, atol=0)
    assert q.data.dtype == torch.float8_e4m3fn
    v = w64 / scale
    codes = q.data.to(torch.float64)
    # Same grid point as an independent E4M3 rounding, or (at a tie) an adjacent one within half a step.
    ulp_at_v = torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))).clamp(min=-6) - 3)
    assert ((codes - ref_e4m3(v)).abs() <= ulp_at_v * 1e-3).float().mean() > 0.999
    assert ((codes - v).abs() <= ulp_at_v / 2 * (1 + 1e-5)).all()
    # The format bound: 2^-4 relative for normal codes, half a subnormal step (2^-10) absolute below 2^-6.
    err = (q.dequantize(torch.float64) - w64).abs()
    normal = v.abs() >= 2.0**-6
    assert normal.any() and (~normal).any()
    assert (err[normal] <= 2.0**-4 * w64.abs()[normal] * (1 + 1e-5)).all()
    assert (err[~normal] <= (2.0**-10 * scale.expand_as(v))[~normal] * (1 + 1e-5)).all()


@pytest.mark.parametrize("fmt,qmax", [("int8", 127.0), ("fp8", 448.0)])
@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (896, 896)])
def test_block_scales_and_partial_edge_blocks(fmt, qmax, shape):
    w = randw(*shape, seed=2)
    q = quantize(w, parse_scheme(fmt, "block"))
    w64 = w.to(torch.float64)
    scale_ref = ref_block_scales(w64, qmax)
    assert q.data.shape == shape and q.scale.shape == scale_ref.shape
    torch.testing.assert_close(q.scale.to(torch.float64), scale_ref, rtol=2**-23, atol=0)
    scale = expand_blocks(q.scale.to(torch.float64), *shape)
    err = (q.dequantize(torch.float64) - w64).abs()
    if fmt == "int8":
        assert (err <= scale / 2 * (1 + 1e-5)).all()
    else:
        v = w64 / scale
        normal = v.abs() >= 2.0**-6
        assert (err[normal] <= 2.0**-4 * w64.abs()[normal] * (1 + 1e-5)).all()
        assert (err[~normal] <= 2.0**-10 * scale[~normal] * (1 + 1e-5)).all()


@pytest.mark.parametrize("fmt,qmax", [("int8", 127.0), ("fp8", 448.0)])
def test_activation_token_and_group_granularities(fmt, qmax):
    x = randw(3, 5, 200, seed=3, std=1.0)
    x64 = x.to(torch.float64)
    qt = quantize(x, parse_scheme(fmt, "token"))
    assert qt.data.shape == x.shape and qt.scale.shape == (3, 5, 1)
    torch.testing.assert_close(qt.scale.to(torch.float64), x64.abs().amax(-1, keepdim=True) / qmax, rtol=2**-23, atol=0)
    qg = quantize(x, parse_scheme(fmt, "group"))
    assert qg.scale.shape == (3, 5, 2)  # 200 = one full group of 128 + a partial group of 72
    torch.testing.assert_close(qg.scale[..., 0].to(torch.float64), x64[..., :128].abs().amax(-1) / qmax, rtol=2**-23, atol=0)
    torch.testing.assert_close(qg.scale[..., 1].to(torch.float64), x64[..., 128:].abs().amax(-1) / qmax, rtol=2**-23, atol=0)
    for q in (qt, qg):
        err = (q.dequantize(torch.float64) - x64).abs()
        bound = q.expanded_scale(torch.float64) / 2 if fmt == "int8" else 2.0**-4 * x64.abs() + 2.0**-10 * q.expanded_scale(torch.float64)
        assert (err <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_zero_and_tiny_groups_give_exact_zeros_and_finite_scales(fmt, granularity):
    w = randw(256, 256, seed=4)
    w[5] = 0.0  # a zero row
    w[128:, 128:] = 0.0  # a zero 128x128 block
    w[7] = 1e-41  # subnormal float32: absmax / qmax underflows to 0
    q = quantize(w, parse_scheme(fmt, granularity))
    deq = q.dequantize(torch.float32)
    assert torch.isfinite(q.scale).all() and (q.scale >= MIN_SCALE).all()
    assert (deq[5] == 0).all() and (q.data[5].to(torch.float32) == 0).all()
    assert (deq[128:, 128:] == 0).all()
    assert torch.isfinite(deq).all()
    assert ((deq[7].double() - 1e-41).abs() <= MIN_SCALE).all()
    # Untouched rows quantize exactly as they would alone.
    alone = quantize(w[:5].clone(), parse_scheme(fmt, granularity)) if granularity == "channel" else None
    if alone is not None:
        assert torch.equal(q.data[:5].view(torch.uint8), alone.data.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["channel", "block", "token", "group"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_raise_with_the_tensor_name(granularity, bad):
    w = randw(16, 160)
    w[3, 150] = bad
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        quantize(w, parse_scheme("int8", granularity), name="model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.parametrize("shape", [(64,), (2, 8, 16)])
def test_weight_granularities_reject_non_2d(granularity, shape):
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(*shape), parse_scheme("int8", granularity), name="w")


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="format"):
        quantize(torch.randn(4, 4), parse_scheme("int3", "channel"))
    with pytest.raises(ValueError, match="granularity"):
        quantize(torch.randn(4, 4), parse_scheme("int8", "row"))
    with pytest.raises(TypeError):
        quantize(torch.ones(4, 4, dtype=torch.int32), INT8_CHANNEL)
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.randn(0, 4), INT8_CHANNEL)


def test_scales_come_from_the_float32_upcast_of_low_precision_inputs():
    w = randw(64, 96, seed=5)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        low = w.to(dtype)
        a, b = quantize(low, INT8_CHANNEL), quantize(low.to(torch.float32), INT8_CHANNEL)
        assert torch.equal(a.scale, b.scale) and torch.equal(a.data, b.data)


def test_int8_grid_is_symmetric():
    w = randw(50, 70, seed=6)
    assert torch.equal(quantize(-w, INT8_CHANNEL).data, -quantize(w, INT8_CHANNEL).data)
    assert quantize(w, INT8_CHANNEL).data.min() >= -127


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("granularity", ["channel", "block", "token"])
def test_scale_equivariance(fmt, granularity):
    """Q(w / s) has the codes of Q(w) and scale / s: why UAQ leaves the quantized forward unchanged."""
    w = randw(256, 320, seed=7)
    base = quantize(w, parse_scheme(fmt, granularity))
    # Power of two: dividing is exact in float32, so codes and scales match bit for bit.
    halved = quantize(w / 2, parse_scheme(fmt, granularity))
    assert torch.equal(halved.data.view(torch.uint8), base.data.view(torch.uint8))
    assert torch.equal(halved.scale * 2, base.scale)
    # s = 1.5: w / s and absmax / s each round once, so a code can differ only where w/scale sits
    # within a float32 ulp of a rounding tie; scales agree to float32 precision.
    s = 1.5
    scaled = quantize(w / s, parse_scheme(fmt, granularity))
    torch.testing.assert_close(scaled.scale.double() * s, base.scale.double(), rtol=3e-7, atol=0)
    mismatch = (scaled.data.view(torch.uint8) != base.data.view(torch.uint8)).double().mean().item()
    assert mismatch < 1e-4


def test_quant_package_imports_only_torch_and_safetensors():
    """The numerics must stay importable without verl, vLLM or transformers."""
    import ast
    from pathlib import Path

    import qurl_verl.quant as pkg

    allowed = {"torch", "safetensors", "__future__", "argparse", "collections", "dataclasses", "enum", "functools", "json", "math",
               "re", "shutil", "sys", "pathlib", "time", "typing"}
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"


@pytest.mark.parametrize("bits", [4, 5, 6, 7, 8])
def test_b_bit_codes_match_a_float64_reference(bits):
    """W{b}A8 weights: codes round(w / s) within ±(2^(b-1)-1), s = absmax / (2^(b-1)-1), stored as int8."""
    w = randw(48, 80, seed=bits)
    q = quantize(w, parse_scheme(f"int{bits}", "channel"))
    qmax = 2 ** (bits - 1) - 1
    w64 = w.double()
    scale = w64.abs().amax(dim=1, keepdim=True) / qmax
    torch.testing.assert_close(q.scale.double(), scale, rtol=2 ** -23, atol=0)  # one float32 rounding
    expected = torch.round(w64 / q.scale.double()).clamp(-qmax, qmax)
    assert q.data.dtype == torch.int8 and int(q.data.abs().max()) == qmax
    assert torch.equal(q.data.double(), expected)
    assert ((q.dequantize(torch.float64) - w64).abs() <= q.scale.double() / 2 * (1 + 2 ** -20)).all()


def test_b_bit_activations_stay_8_bit():
    """In W{b}A8 only the weight grid shrinks: the activation format of any integer weight is INT8."""
    from qurl_verl.quant import activation_format, int_format

    assert all(activation_format(int_format(b)) is INT8 for b in range(4, 9))
    assert activation_format(FP8_E4M3) is FP8_E4M3
    with pytest.raises(ValueError, match="4..8 bits"):
        int_format(9)


def test_one_scheme_type_strings_only_through_parse_scheme():
    """``QuantScheme`` is the one argument of the quant API: typed codes and granularity, names read by
    ``parse_scheme`` alone (command lines, config values)."""
    from qurl_verl.quant import FP8_BLOCK, FP8_GROUP, INT8_TOKEN, Granularity, QuantScheme, int_format

    assert parse_scheme("int8") == INT8_CHANNEL == QuantScheme(INT8, Granularity.CHANNEL)
    assert parse_scheme("FP8_E4M3", "block") == FP8_BLOCK and parse_scheme(INT8, "token") == INT8_TOKEN
    assert parse_scheme("int5").codes == int_format(5) and parse_scheme("fp8", "block", 64).block_size == 64
    assert FP8_BLOCK.activations == FP8_GROUP and parse_scheme("int4").activations == INT8_TOKEN  # W{b}A8
    with pytest.raises(ValueError, match="activation granularity"):
        _ = INT8_TOKEN.activations
    with pytest.raises(TypeError, match="parse_scheme"):
        QuantScheme("int8")
    with pytest.raises(TypeError, match="parse_scheme"):
        QuantScheme(INT8, "channel")
    with pytest.raises(ValueError, match="block_size"):
        QuantScheme(INT8, Granularity.BLOCK, 0)
    with pytest.raises(TypeError, match="QuantScheme"):
        quantize(torch.randn(4, 4), "int8")
    q = quantize(torch.randn(4, 4), FP8_CHANNEL)
    assert (q.scheme, q.fmt, q.granularity, q.block_size) == (FP8_CHANNEL, FP8_E4M3, Granularity.CHANNEL, 128)
    assert str(FP8_BLOCK) == "fp8 per block, block_size=128" and hash(FP8_BLOCK) == hash(parse_scheme("fp8", "block"))
