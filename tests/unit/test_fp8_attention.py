"""The GPU check's reference of CUDA's FP8 attention (``qurl_testkit.fp8_attention``): softmax(q k^T) @ v with the
probabilities rounded to E4M3 as Triton (scale 1) or FlashAttention 3 (scale 2^-8) round them, the row sum
unrounded. References: torch's own scaled_dot_product_attention, and the same formula in float64 on the E4M3 grid
enumerated from its bit patterns."""
from __future__ import annotations

import pytest
import torch

from qurl_testkit.fp8_attention import PROBABILITY_SCALES, attention_with_fp8_probabilities, sdpa_with_fp8_probabilities
from qurl_verl.quant.kv_cache import FP8_KV_MAX

pytestmark = pytest.mark.both_stacks  # transformers' attention dispatch differs between the stacks


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest finite E4M3 value in float64 (ties to the even code), saturating; x >= 0 here."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    grid = torch.unique(values[torch.isfinite(values)])
    x = x.clamp(-FP8_KV_MAX, FP8_KV_MAX)
    idx = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    even_hi = hi.to(torch.float8_e4m3fn).view(torch.uint8) % 2 == 0
    return torch.where(((hi - x) < (x - lo)) | (((hi - x) == (x - lo)) & even_hi), hi, lo)


def qkv(seed: int, queries: int = 7, keys: int = 7):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, queries, 32, generator=gen) * 3
    k = torch.randn(1, 2, keys, 32, generator=gen) * 3  # grouped-query: 2 K/V heads for 4 query heads
    v = torch.randn(1, 2, keys, 32, generator=gen)
    return q, k, v


def test_without_rounding_it_is_torchs_causal_grouped_query_attention():
    """Float32 against float32: the two differ by summation order only (bound: 1e-5 of outputs of order 1)."""
    q, k, v = qkv(0)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.2)
    torch.testing.assert_close(attention_with_fp8_probabilities(q, k, v, None, 0.2, None), expected, rtol=0, atol=1e-5)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(attention_with_fp8_probabilities(q, k, v, causal, 0.2, None), expected, rtol=0, atol=1e-5)
    additive = torch.zeros(7, 7).masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(attention_with_fp8_probabilities(q, k, v, additive, 0.2, None), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", sorted(PROBABILITY_SCALES))
def test_probabilities_are_rounded_to_e4m3_and_the_row_sum_is_not(backend):
    """Against the float64 formula: P = exp(s - max) rounded to E4M3 with the backend's scale for P @ V, divided
    by the sum of the unrounded P. Bound 1e-5: float32 scores and sums; a probability of the float32 path that
    lands on the other side of an E4M3 rounding boundary would miss it by far (none does for these inputs)."""
    scale = PROBABILITY_SCALES[backend]
    q, k, v = qkv(1, queries=3, keys=9)  # the last 3 of 9 positions: a decode-like causal window
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.25
    s = s.masked_fill(~torch.ones(3, 9, dtype=torch.bool).tril(6), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    expected = (e4m3_round(p / scale) * scale) @ v.double().repeat_interleave(2, 1) / p.sum(-1, keepdim=True)
    got = attention_with_fp8_probabilities(q, k, v, None, 0.25, scale)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)
    unrounded = attention_with_fp8_probabilities(q, k, v, None, 0.25, None)
    assert (got - unrounded).abs().max() > 1e-3  # the rounding is there to see


def test_fa3s_offset_keeps_the_small_probabilities_triton_flushes():
    """One key dominates and the others sit 2^-12 below it: under Triton's scale 1 they are below E4M3's
    smallest subnormal (2^-9) and count nothing in P @ V, though they count in the row sum; FA3's 2^8 offset
    keeps them normal (2^-12 x 256 = 2^-4)."""
    q = torch.ones(1, 1, 1, 1)
    k = torch.tensor([0.0, 0.0, 0.0, 12 * torch.log(torch.tensor(2.0))]).reshape(1, 1, 4, 1)  # scores: 0,0,0,12 ln2
    v = torch.tensor([1.0, 1.0, 1.0, 0.0]).reshape(1, 1, 4, 1)
    exact = 3 * 2.0**-12 / (1 + 3 * 2.0**-12)
    triton = attention_with_fp8_probabilities(q, k, v, torch.ones(1, 4, dtype=torch.bool), 1.0, 1.0)
    fa3 = attention_with_fp8_probabilities(q, k, v, torch.ones(1, 4, dtype=torch.bool), 1.0, 2.0**-8)
    assert float(triton) == 0.0
    assert float(fa3) == pytest.approx(exact, rel=1e-5)


def test_a_model_attends_through_it_inside_the_block_only():
    """A small Qwen2 in float32: inside the block with no rounding, the same logits as its sdpa (summation order,
    1e-4 of logits of order 1); with Triton's rounding, other logits; after the block, sdpa's again."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        sdpa = model(ids).logits
        with sdpa_with_fp8_probabilities(None):
            unrounded = model(ids).logits
        with sdpa_with_fp8_probabilities(PROBABILITY_SCALES["TRITON_ATTN"]):
            rounded = model(ids).logits
        after = model(ids).logits
    torch.testing.assert_close(unrounded, sdpa, rtol=0, atol=1e-4)
    assert (rounded - sdpa).abs().max() > 1e-4
    torch.testing.assert_close(after, sdpa, rtol=0, atol=0)
