"""Bytes one decode step reads per GPU, the memory-bound step time, and how many sequences fit in the KV cache."""
from __future__ import annotations

import math

from roofline_shapes import ACCELERATORS, OTHER_WEIGHT_BYTES, SETUPS, Accelerator, ModelShape, Setup


def kv_heads_per_rank(m: ModelShape, tp: int) -> int:
    """vLLM splits KV heads over the TP ranks, and replicates them when there are fewer heads than ranks."""
    if m.num_kv_heads >= tp:
        if m.num_kv_heads % tp:
            raise ValueError(f"{m.num_kv_heads} KV heads do not split over TP {tp}")
        return m.num_kv_heads // tp
    if tp % m.num_kv_heads:
        raise ValueError(f"TP {tp} is not a multiple of {m.num_kv_heads} KV heads")
    return 1


def linear_layers_per_rank(m: ModelShape, tp: int) -> list[tuple[str, int, int, bool]]:
    """(name, output rows, input columns, has bias) of one decoder layer's linears on one TP rank."""
    q_rows = m.num_heads * m.head_dim
    kv_rows = kv_heads_per_rank(m, tp) * m.head_dim
    return [
        ("q_proj", q_rows // tp, m.hidden_size, m.qkv_bias),
        ("k_proj", kv_rows, m.hidden_size, m.qkv_bias),
        ("v_proj", kv_rows, m.hidden_size, m.qkv_bias),
        ("o_proj", m.hidden_size, q_rows // tp, False),  # row-parallel: the input is split
        ("gate_proj", m.intermediate_size // tp, m.hidden_size, False),
        ("up_proj", m.intermediate_size // tp, m.hidden_size, False),
        ("down_proj", m.hidden_size, m.intermediate_size // tp, False),
    ]


def weight_bytes_per_rank(m: ModelShape, setup: Setup, tp: int) -> dict[str, float]:
    """Bytes of each weight group one TP rank holds (the vocabulary split evenly over ranks)."""
    linear = scales = biases = 0
    for _, rows, cols, has_bias in linear_layers_per_rank(m, tp):
        linear += rows * cols * setup.linear_weight_bytes
        scales += rows * setup.linear_scale_bytes
        biases += rows * OTHER_WEIGHT_BYTES if has_bias else 0
    norms_per_layer = 2 * m.hidden_size + (2 * m.head_dim if m.qk_norm else 0)
    vocab_matrix = m.vocab_size / tp * m.hidden_size * OTHER_WEIGHT_BYTES
    return {
        "linear": linear * m.num_layers,
        "linear_scales": scales * m.num_layers,
        "biases": biases * m.num_layers,
        "norms": (norms_per_layer * m.num_layers + m.hidden_size) * OTHER_WEIGHT_BYTES,
        "embedding": vocab_matrix,
        "lm_head": 0.0 if m.tie_word_embeddings else vocab_matrix,
    }


def weight_bytes_read_per_step(m: ModelShape, setup: Setup, tp: int, seqs: float) -> float:
    """A decode step reads every decoder weight and the lm_head matrix once, but of the input
    embedding only the rows of the ``seqs`` tokens it embeds (a tied model reads its one matrix as lm_head)."""
    held = weight_bytes_per_rank(m, setup, tp)
    decoder = held["linear"] + held["linear_scales"] + held["biases"] + held["norms"]
    lm_head = held["embedding"] if m.tie_word_embeddings else held["lm_head"]
    embedded_rows = seqs * m.hidden_size * OTHER_WEIGHT_BYTES / tp  # each token's row lives on one rank
    return decoder + lm_head + embedded_rows


def stored_weight_bytes(m: ModelShape, setup: Setup, tp: int) -> float:
    """What one rank keeps resident, which the KV cache cannot use."""
    return sum(weight_bytes_per_rank(m, setup, tp).values())


def kv_bytes_per_token(m: ModelShape, setup: Setup, tp: int) -> int:
    """K and V of one token, every layer, on one TP rank."""
    return m.num_layers * 2 * kv_heads_per_rank(m, tp) * m.head_dim * setup.kv_bytes


def decode_step_bytes(m: ModelShape, setup: Setup, tp: int, seqs_per_engine: float, mean_context: float) -> dict:
    """Bytes one rank reads in one decode step of ``seqs_per_engine`` sequences of mean context ``mean_context``."""
    weights = weight_bytes_read_per_step(m, setup, tp, seqs_per_engine)
    kv = seqs_per_engine * mean_context * kv_bytes_per_token(m, setup, tp)
    return {"weight_bytes": weights, "kv_bytes": kv, "total_bytes": weights + kv}


def step_seconds(total_bytes: float, acc: Accelerator) -> float:
    return total_bytes / acc.bandwidth_bytes_per_s


def compare_setups(m: ModelShape, tp: int, seqs_per_engine: float, mean_context: float) -> dict:
    """Every set-up's bytes, step time per card and speed-up over BF16 (= the ratio of bytes)."""
    out = {}
    for s in SETUPS:
        b = decode_step_bytes(m, s, tp, seqs_per_engine, mean_context)
        b["step_ms"] = {a.name: 1e3 * step_seconds(b["total_bytes"], a) for a in ACCELERATORS}
        out[s.name] = b
    for s in SETUPS:
        out[s.name]["speedup_over_bf16"] = out["bf16"]["total_bytes"] / out[s.name]["total_bytes"]
    return out


def kv_capacity_tokens(m: ModelShape, setup: Setup, tp: int, acc: Accelerator, gpu_memory_utilization: float) -> float:
    """Tokens of KV cache one engine can hold: the memory vLLM may use less the resident weights
    (activations and CUDA graphs, which vLLM also reserves, are not subtracted: an upper bound)."""
    free = acc.memory_bytes * gpu_memory_utilization - stored_weight_bytes(m, setup, tp)
    return max(free, 0.0) / kv_bytes_per_token(m, setup, tp)


def capacity_bound(m: ModelShape, tp: int, acc: Accelerator, requested_seqs: float, max_num_seqs: int,
                   mean_context: float, gpu_memory_utilization: float | None = None,
                   kv_capacity: dict[str, float] | None = None) -> dict:
    """Sequences that run at once when the engine caps them (max_num_seqs) and the KV cache does
    (capacity / mean context), and the decode tokens/s per GPU that follow; speed-up in tokens/s.
    ``kv_capacity`` (tokens per set-up) replaces the computed capacity where a publication gives it."""
    requested = math.floor(requested_seqs)
    out = {}
    for s in SETUPS:
        cap = kv_capacity[s.name] if kv_capacity else kv_capacity_tokens(m, s, tp, acc, gpu_memory_utilization)
        running = min(requested, max_num_seqs, math.floor(cap / mean_context))
        if running < 1:
            out[s.name] = {"kv_capacity_tokens": cap, "running_seqs": 0, "tokens_per_s_per_gpu": 0.0}
            continue
        total = decode_step_bytes(m, s, tp, running, mean_context)["total_bytes"]
        out[s.name] = {"kv_capacity_tokens": cap, "running_seqs": running,
                       "limited_by": ("requested" if running == requested else
                                      "max_num_seqs" if running == max_num_seqs else "kv_capacity"),
                       "tokens_per_s_per_gpu": running / step_seconds(total, acc) / tp}
    base = out["bf16"]["tokens_per_s_per_gpu"]
    for s in SETUPS:
        out[s.name]["speedup_over_bf16"] = out[s.name]["tokens_per_s_per_gpu"] / base if base else None
    return out
