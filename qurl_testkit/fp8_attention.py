"""A torch reference of the attention CUDA backends run with an FP8 KV cache and FP8 queries, for the GPU check's
reference model and ``bench/bench_fp8_query.py``.

With an FP8 query (``qurl_verl.quant.kv_cache.quantize_dequantize_query_fp8``) both of vLLM 0.24's CUDA backends
that take one also round the softmax probabilities to E4M3 for their P @ V product, while the row sum that
normalizes the output stays in float32:

* Triton attention (``v1/attention/ops/triton_unified_attention.py``): ``P.to(V.dtype)`` with V still the cache's
  E4M3, P = exp(s - m) in [0, 1]: probability scale 1;
* FlashAttention 3 on SM90 (``hopper/flash_fwd_kernel_sm90.h``, ``Softmax<..., Max_offset = 8>`` for FP8): the
  exponent shifted by 8, P in [0, 256]: probability scale 2^-8, so probabilities down to 2^-17 of the row's
  largest stay normal instead of 2^-9.

``m`` here is the row's maximum over every key. The kernels subtract the running maximum of the key tiles seen so
far (Triton: tiles of 16-32 keys; FA3: blocks of 128 or more, a row of fewer keys is one block), so the reference is
the kernels' arithmetic where one tile holds every key of a row, and the same kind of rounding elsewhere.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from qurl_verl.quant.kv_cache import quantize_dequantize_fp8

# The E4M3 scale each backend's probabilities go through (None: this reference does not know the backend's).
PROBABILITY_SCALES = {"TRITON_ATTN": 1.0, "FLASH_ATTN": 2.0**-8}


def attention_with_fp8_probabilities(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     attention_mask: torch.Tensor | None, scaling: float | None,
                                     probability_scale: float | None) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) @ v in float32, [batch, heads, queries, head_dim] in ``query``'s dtype,
    with the probabilities quantize-dequantized to E4M3 with ``probability_scale`` before P @ V (None: kept),
    and the row sum taken from the unquantized ones. K and V may have fewer heads (grouped-query attention).
    ``attention_mask``: None (causal, the queries being the last of the keys), boolean (True attends) or
    additive, as transformers' sdpa attention receives it."""
    groups = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(groups, 1)
    v = value.float().repeat_interleave(groups, 1)
    s = (query.float() @ k.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is None:
        q_len, k_len = s.shape[-2:]
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=s.device).tril(k_len - q_len)
        s = s.masked_fill(~causal, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        s = s.masked_fill(~attention_mask, float("-inf"))
    else:
        s = s + attention_mask.float()
    p = torch.exp(s - s.amax(-1, keepdim=True))
    weights = p if probability_scale is None else quantize_dequantize_fp8(p, probability_scale)
    return ((weights @ v) / p.sum(-1, keepdim=True)).to(query.dtype)


@contextmanager
def sdpa_with_fp8_probabilities(probability_scale: float | None):
    """Within the block, transformers' "sdpa" attention (the reference models') is
    ``attention_with_fp8_probabilities`` with this probability scale."""
    from transformers.modeling_utils import AttentionInterface

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        out = attention_with_fp8_probabilities(query, key, value, attention_mask, scaling, probability_scale)
        return out.transpose(1, 2).contiguous(), None

    mapping = AttentionInterface._global_mapping
    original = mapping["sdpa"]
    mapping["sdpa"] = attention
    try:
        yield
    finally:
        mapping["sdpa"] = original
