"""Published QuRL, verl and NeMo-RL rollout speed-ups against the roofline, with why they differ."""
from __future__ import annotations

from roofline_bytes import capacity_bound, compare_setups, decode_step_bytes, kv_bytes_per_token, weight_bytes_read_per_step
from roofline_shapes import ACCELERATORS, GB, MODEL_SHAPES, SETUP_BY_NAME, ModelShape, model_shape

# Set-ups of published speed-ups, each with its source (the publication); where a publication does not state a
# value the roofline needs, the entry says which value was assumed.
PUBLISHED = [
    {
        "name": "QuRL paper, INT8 rollout, 7B",
        "claim": "INT8 vs BF16 rollout throughput 1.2-1.3x for 7B (single A6000/A100/H100)",
        "source": "QuRL arXiv 2602.13953, Fig. 8",
        "published_low": 1.2, "published_high": 1.3, "setup": "w8a8",
        "model": "Qwen/Qwen2.5-7B", "tp": 1, "requested_seqs": 256, "max_num_seqs": 256,
        "max_prompt_length": 2048, "max_response_length": 8192, "gpu_memory_utilization": 0.9,
        "assumed": "batch, lengths and memory share not published (the paper does not state them): the dapo recipe's "
                   "lengths, verl's max_num_seqs, vLLM's default gpu_memory_utilization; H100 SXM",
    },
    {
        "name": "QuRL paper, INT8 rollout, 14B",
        "claim": "INT8 vs BF16 rollout throughput 1.3-1.6x for 14B",
        "source": "QuRL arXiv 2602.13953, Fig. 8",
        "published_low": 1.3, "published_high": 1.6, "setup": "w8a8",
        "model": "Qwen/Qwen2.5-14B", "tp": 1, "requested_seqs": 256, "max_num_seqs": 256,
        "max_prompt_length": 2048, "max_response_length": 8192, "gpu_memory_utilization": 0.9,
        "assumed": "as for 7B; one GPU",
    },
    {
        "name": "QuRL paper, INT8 rollout, 32B at TP 2",
        "claim": "INT8 vs BF16 rollout throughput 1.7x on A100, about 1.83x on H100, 32B at TP=2",
        "source": "QuRL arXiv 2602.13953, Fig. 8",
        "published_low": 1.7, "published_high": 1.83, "setup": "w8a8",
        "model": "Qwen/Qwen2.5-32B", "tp": 2, "requested_seqs": 256, "max_num_seqs": 256,
        "max_prompt_length": 2048, "max_response_length": 8192, "gpu_memory_utilization": 0.9,
        "assumed": "as for 7B; TP 2 as published",
    },
    {
        "name": "verl FP8 rollout (linear layers), Qwen3-8B-Base",
        "claim": "FP8 rollout about 12% (CUDA 12.6) to 18% (CUDA 12.9) faster, Qwen3-8B-Base DAPO, 20K response, "
                 "8xH100; over 35% for the MoE Qwen3-30B-A3B (not modelled here)",
        "source": "verl docs/low_precision/fp8.md",
        "published_low": 1.12, "published_high": 1.18, "setup": "w8a8",
        "model": "Qwen/Qwen3-8B-Base", "tp": 1, "requested_seqs": 192, "max_num_seqs": 256,
        "max_prompt_length": 2048, "max_response_length": 20480, "gpu_memory_utilization": 0.9,
        "assumed": "TP 1; 32 x 3 x 16 sequences over 8 engines as in verl PR #4435 (same model and recipe); "
                   "prompt length of the DAPO recipe; vLLM's default gpu_memory_utilization",
    },
    {
        "name": "NeMo-RL FP8 linear + FP8 KV cache, Qwen3-8B-Base",
        "claim": "FP8 linear + FP8 KV cache/attention about 48% faster rollout than BF16, the KV cache adding "
                 "about 30% over FP8 linear alone (Qwen3-8B-Base, vLLM + Megatron, token-level TIS)",
        "source": "NVIDIA-NeMo/RL PR #1212 (NVIDIA blog 'Run High-Throughput RL Training with "
                  "End-to-End FP8': ~48% with FP8 KV + attention)",
        "published_low": 1.48, "published_high": 1.48, "setup": "w8a8_fp8kv",
        "model": "Qwen/Qwen3-8B-Base", "tp": 1, "requested_seqs": 192, "max_num_seqs": 256,
        "max_prompt_length": 2048, "max_response_length": 20480,
        # per engine, from vLLM's log lines quoted in the PR ("GPU KV cache size")
        "kv_capacity_tokens": {"bf16": 249952, "w8a8": 299344, "w8a8_fp8kv": 598672},
        "published_kv_gain_over_linear": 1.30,  # "an additional ~30% rollout speedup over FP8 Linear only"
        "assumed": "KV capacities as the PR reports them; lengths and concurrency as for the verl row",
    },
]

REASONS = {
    "lengths": "Mean context. The roofline's recipe mean (max prompt + half the max response) is an upper bound: "
               "real prompts are shorter than the limit and most responses end before it, so a real step holds less "
               "KV than at the recipe mean, and 8-bit weights win more; the per-step rows at short contexts and few "
               "sequences show how much.",
    "tail": "Draining batch. A rollout is not one step: sequences finish, and the last steps run a few long "
            "sequences, where the weights dominate. A measured speed-up averages over that changing mix, which the "
            "per-step rows bracket (all sequences at once vs the fixed small concurrency).",
    "compute": "Compute. Prefill, and decode GEMMs at large batch, are compute-bound, where INT8/FP8 tensor cores "
               "double the rate: a gain the memory model does not count, and larger models at larger batches have "
               "more of it. Where a publication beats the capacity-bound roofline, this is the first candidate.",
    "overheads": "Parts that do not shrink. Sampling and the logits, the scheduler and other CPU work, the prefill "
                 "and the weight sync do not get faster with 8-bit weights or KV, and attention kernels (an FP8 cache "
                 "is dequantized or read by FP8 attention) reach less of peak bandwidth than GEMMs: all of it pulls a "
                 "measured speed-up below the byte ratio.",
    "capacity": "Capacity. Memory caps the sequences that run at once: smaller weights leave room for more KV, an "
                "8-bit cache doubles the tokens that fit. Where the cache is the limit, more sequences share one read "
                "of the weights, so the capacity-bound speed-up exceeds the per-step one; it is also the only view in "
                "which the two cards differ.",
    "moe": "Not modelled. The MoE figure quoted with it reads a batch-dependent share of the experts per step, "
           "which this dense model does not count.",
}

EXPLANATIONS = {
    "QuRL paper, INT8 rollout, 7B": ("lengths", "compute", "capacity"),
    "QuRL paper, INT8 rollout, 14B": ("lengths", "compute", "capacity"),
    "QuRL paper, INT8 rollout, 32B at TP 2": ("compute", "capacity", "lengths"),
    "verl FP8 rollout (linear layers), Qwen3-8B-Base": ("overheads", "tail", "capacity", "moe"),
    "NeMo-RL FP8 linear + FP8 KV cache, Qwen3-8B-Base": ("overheads", "tail", "capacity"),
}


def kv_share_for_speedup(m: ModelShape, tp: int, seqs: float, setup_name: str, speedup: float) -> float | None:
    """Share of a BF16 step's bytes that must be KV for the per-step roofline to give ``speedup``, or None
    where no context or batch does (the set-up's speed-up runs from the weights' byte ratio at no KV to the
    KV byte ratio at all KV). Solves (W + K) / (W_s + c K) = speedup for K, c = KV bytes of the set-up / BF16's."""
    setup = SETUP_BY_NAME[setup_name]
    w_bf16 = weight_bytes_read_per_step(m, SETUP_BY_NAME["bf16"], tp, seqs)
    w_setup = weight_bytes_read_per_step(m, setup, tp, seqs)
    c = setup.kv_bytes / SETUP_BY_NAME["bf16"].kv_bytes
    if speedup * c == 1:
        return None
    kv = (w_bf16 - speedup * w_setup) / (speedup * c - 1)
    return kv / (w_bf16 + kv) if kv >= 0 else None


def untouched_share(published: float, roofline: float) -> float | None:
    """Amdahl: the share of the BF16 rollout time that must stay as it is for a part that the roofline
    speeds up ``roofline``-fold to give ``published`` overall; None where the publication is faster."""
    if published >= roofline:
        return None
    return (1 / published - 1 / roofline) / (1 - 1 / roofline)


def published_comparison(ref: dict, fixed_contexts: list[int], fixed_seqs: int) -> dict:
    """The roofline for a published set-up: per-step speed-ups over contexts x concurrencies, the
    capacity-bound tokens/s speed-up at the mean context on H100 SXM, and two readings of the gap."""
    m, tp, setup = model_shape(ref["model"]), ref["tp"], ref["setup"]
    max_len = ref["max_prompt_length"] + ref["max_response_length"]
    mean_context = ref["max_prompt_length"] + ref["max_response_length"] / 2
    contexts = sorted({c for c in fixed_contexts if c <= max_len} | {mean_context})
    per_step = [compare_setups(m, tp, seqs, c)[setup]["speedup_over_bf16"]
                for c in contexts for seqs in (fixed_seqs, ref["requested_seqs"])]
    h100 = ACCELERATORS[0]
    cap = capacity_bound(m, tp, h100, ref["requested_seqs"], ref["max_num_seqs"], mean_context,
                         ref.get("gpu_memory_utilization"), ref.get("kv_capacity_tokens"))
    running = cap["bf16"]["running_seqs"]
    at_mean = decode_step_bytes(m, SETUP_BY_NAME["bf16"], tp, running, mean_context)
    published_mid = (ref["published_low"] + ref["published_high"]) / 2
    return {**ref, "mean_context": mean_context, "contexts": contexts,
            "concurrencies": [fixed_seqs, ref["requested_seqs"]],
            "per_step_speedup_min": min(per_step), "per_step_speedup_max": max(per_step),
            "capacity_bound_accelerator": h100.name, "capacity_bound_accelerator_label": h100.label,
            "capacity_bound": cap,
            "capacity_bound_speedup": cap[setup]["speedup_over_bf16"],
            "published_mid": published_mid,
            "kv_share_at_mean_context": at_mean["kv_bytes"] / at_mean["total_bytes"],
            "kv_share_matching_published": kv_share_for_speedup(m, tp, running, setup, published_mid),
            "untouched_share_of_bf16_time": untouched_share(published_mid, cap[setup]["speedup_over_bf16"]),
            "roofline_kv_gain_over_linear": cap["w8a8_fp8kv"]["tokens_per_s_per_gpu"] / cap["w8a8"]["tokens_per_s_per_gpu"],
            "explanations": [REASONS[k] for k in EXPLANATIONS[ref["name"]]]}


def issue_sanity_check() -> dict:
    """The issue's arithmetic: DeepScaleR, 128 sequences per GPU at a 3k mean context."""
    m, seqs, ctx = MODEL_SHAPES["deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"], 128, 3072
    rows = compare_setups(m, 1, seqs, ctx)
    return {"model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "seqs_per_gpu": seqs, "mean_context": ctx,
            "kv_kib_per_token_bf16": kv_bytes_per_token(m, SETUP_BY_NAME["bf16"], 1) / 2**10,
            "kv_gb_bf16": rows["bf16"]["kv_bytes"] / GB,
            "weights_gb": {s: rows[s]["weight_bytes"] / GB for s in ("bf16", "w8a8")},
            "speedup": {s: rows[s]["speedup_over_bf16"] for s in ("w8a8", "w8a8_fp8kv")}}
