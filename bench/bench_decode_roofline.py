"""Bytes one decode step reads from accelerator memory, per recipe: a memory-bound roofline of rollout.

Why: a decode step of a large batch reads every weight once and the KV cache of every running
sequence. Quantizing only the linear weights (W8A8, what QuRL does) shrinks the first term; the KV
term, which grows with batch and context, stays in BF16 unless the KV cache is quantized as well
(FP8 KV). Counting both terms for the shapes and batch sizes of this project's recipes tells how
much of the rollout speed-up 8-bit weights can buy at all, and where an FP8 KV cache matters more.

Three rollout set-ups: ``bf16`` (weights and KV cache bf16), ``w8a8`` (every linear layer of the
decoder 1 byte per weight plus one fp32 scale per output channel; embeddings, lm_head, norms and
biases bf16, as the project keeps them), ``w8a8_fp8kv`` (the same with a 1-byte KV cache).

Model: step time = bytes read per GPU / memory bandwidth (H100 SXM, H200), with tensor parallelism
splitting weights and KV heads over the ranks of one engine. It ignores compute (GEMMs and attention
arithmetic, which INT8/FP8 tensor cores also speed up), attention-kernel efficiency, activations,
sampling and the logits, the prefill, weight sync and CPU overheads. Speed-ups are therefore the
same on both cards; the cards differ in memory capacity, which caps how many sequences fit in the KV
cache at once, so a second, capacity-bound view counts resident sequences and tokens/s.

    .venv/bin/python bench/bench_decode_roofline.py [--contexts 1024 3072 8192 16384] [--fixed-seqs 32]

Writes ``bench/results/decode_roofline.{json,md}``; the .md is rendered from the .json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO / "qurl_verl" / "hydra_configs" / "qurl_recipe"
DEFAULT_OUT = REPO / "bench" / "results" / "decode_roofline"
GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """The config.json numbers a decode step's byte count depends on."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has q/k/v biases, Qwen3 has none
    qk_norm: bool  # Qwen3 RMS-normalises q and k per head
    source: str


# From each model's public config.json (hidden_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, head_dim = hidden_size / num_attention_heads unless given, intermediate_size,
# vocab_size, tie_word_embeddings).
MODEL_SHAPES = {
    # DeepSeek-R1-Distill-Qwen-1.5B (the Qwen2.5-Math-1.5B shape): 1536, 28, 12, 2, 128, 8960, 151936,
    # untied (1.78B parameters with a separate lm_head)
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ModelShape(
        1536, 28, 12, 2, 128, 8960, 151936, False, True, False,
        "config.json of deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
    # Qwen2.5-0.5B-Instruct: 896, 24, 14, 2, 64, 4864, 151936, tied
    "Qwen/Qwen2.5-0.5B-Instruct": ModelShape(
        896, 24, 14, 2, 64, 4864, 151936, True, True, False, "config.json of Qwen/Qwen2.5-0.5B-Instruct"),
    # Qwen2.5-7B: 3584, 28, 28, 4, 128, 18944, 152064, untied
    "Qwen/Qwen2.5-7B": ModelShape(
        3584, 28, 28, 4, 128, 18944, 152064, False, True, False, "config.json of Qwen/Qwen2.5-7B"),
    # Qwen2.5-14B: 5120, 48, 40, 8, 128, 13824, 152064, untied
    "Qwen/Qwen2.5-14B": ModelShape(
        5120, 48, 40, 8, 128, 13824, 152064, False, True, False, "config.json of Qwen/Qwen2.5-14B"),
    # Qwen2.5-32B: 5120, 64, 40, 8, 128, 27648, 152064, untied
    "Qwen/Qwen2.5-32B": ModelShape(
        5120, 64, 40, 8, 128, 27648, 152064, False, True, False, "config.json of Qwen/Qwen2.5-32B"),
    # Qwen3-8B-Base (the Qwen3-8B shape): 4096, 36, 32, 8, head_dim 128, 12288, 151936, untied
    "Qwen/Qwen3-8B-Base": ModelShape(
        4096, 36, 32, 8, 128, 12288, 151936, False, False, True, "config.json of Qwen/Qwen3-8B-Base"),
}
TINY_MODEL = "qurl-tiny (qurl_recipes.tiny_model.TinyModelSpec defaults)"
# a recipe whose model path is not a hub name: the model the recipe's data step builds
RECIPE_MODEL_OVERRIDES = {"tiny_cpu": TINY_MODEL}


def tiny_model_shape() -> ModelShape:
    """The tiny CPU demo model (a Qwen2 shape) as ``recipes_check --write-data`` builds it."""
    from qurl_recipes.tiny_model import TinyModelSpec

    spec = TinyModelSpec()
    return ModelShape(spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                      spec.intermediate_size, spec.vocab_size, spec.tie_word_embeddings, True, False,
                      "qurl_recipes.tiny_model.TinyModelSpec()")


def model_shape(name: str) -> ModelShape:
    return tiny_model_shape() if name == TINY_MODEL else MODEL_SHAPES[name]


@dataclass(frozen=True)
class Setup:
    """Bytes per element of what a decode step reads, for one rollout precision."""

    name: str
    label: str
    linear_weight_bytes: int  # decoder linear layers (q, k, v, o, gate, up, down)
    linear_scale_bytes: int  # per output channel of those layers (fp32 scales of W8A8)
    kv_bytes: int  # per K or V element of the cache


OTHER_WEIGHT_BYTES = 2  # embeddings, lm_head, norms and biases stay bf16 in every set-up
SETUPS = (
    Setup("bf16", "BF16", 2, 0, 2),
    Setup("w8a8", "W8A8", 1, 4, 2),
    Setup("w8a8_fp8kv", "W8A8 + FP8 KV", 1, 4, 1),
)
SETUP_BY_NAME = {s.name: s for s in SETUPS}


@dataclass(frozen=True)
class Accelerator:
    name: str
    label: str
    bandwidth_bytes_per_s: float  # vendor peak HBM bandwidth
    memory_bytes: int  # total memory as nvidia-smi reports it (MiB)


ACCELERATORS = (
    Accelerator("h100_sxm", "H100 SXM", 3.35e12, 81559 * 2**20),
    Accelerator("h200", "H200", 4.8e12, 143771 * 2**20),
)


# ---------------------------------------------------------------------------------------------- bytes

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


# -------------------------------------------------------------------------------------------- recipes

RECIPE_KEYS = {
    "model_path": "actor_rollout_ref.model.path",
    "train_batch_size": "data.train_batch_size",
    "rollout_n": "actor_rollout_ref.rollout.n",
    "n_gpus_per_node": "trainer.n_gpus_per_node",
    "nnodes": "trainer.nnodes",
    "max_prompt_length": "data.max_prompt_length",
    "max_response_length": "data.max_response_length",
    "tensor_model_parallel_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "max_num_seqs": "actor_rollout_ref.rollout.max_num_seqs",
}
# verl 0.9.1's defaults for a key a recipe leaves out (verl/trainer/config/_generated_ppo_trainer.yaml)
VERL_DEFAULTS = {
    "train_batch_size": 1024, "rollout_n": 1, "n_gpus_per_node": 8, "nnodes": 1, "max_prompt_length": 512,
    "max_response_length": 512, "tensor_model_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_num_seqs": 256,
}
# environment variables the recipes read; unset while resolving, so the defaults after the comma apply
RECIPE_ENV = ("QURL_DATA_DIR", "QURL_OUTPUT_DIR", "MODEL_PATH", "NNODES", "NGPUS_PER_NODE")


@contextlib.contextmanager
def recipe_defaults_environment():
    """Resolve a recipe as written: its ``${oc.env:VAR,default}`` take the default, not this shell's value."""
    saved = {k: os.environ.pop(k) for k in RECIPE_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def load_recipe(path: Path):
    """The recipe merged over its Hydra ``defaults`` (sibling files, ``_self_`` where listed, else last)."""
    from omegaconf import OmegaConf

    own = OmegaConf.load(path)
    defaults = list(own.pop("defaults", []) or [])
    if "_self_" not in defaults:
        defaults.append("_self_")
    parts = [own if d == "_self_" else load_recipe(path.parent / f"{d}.yaml") for d in defaults]
    return OmegaConf.merge(*parts)


def home_relative(value):
    """A local path under the home directory written as ``~/...``: the result files name no machine's home."""
    home = str(Path.home())
    if isinstance(value, str) and (value == home or value.startswith(home + os.sep)):
        return "~" + value[len(home):]
    return value


def recipe_inputs(path: Path) -> dict:
    """What the roofline needs from one recipe, and which values came from verl's defaults."""
    from omegaconf import OmegaConf

    cfg = load_recipe(path)
    values, defaults_taken = {}, []
    with recipe_defaults_environment():
        for key, dotted in RECIPE_KEYS.items():
            value = OmegaConf.select(cfg, dotted, default=None)
            if value is None:
                value = VERL_DEFAULTS.get(key)
                defaults_taken.append(f"{dotted} = {value} (verl default)")
            values[key] = value
    values["model_path"] = home_relative(values["model_path"])
    name = OmegaConf.select(cfg, "qurl_recipe.name", default=path.stem)
    values["model"] = RECIPE_MODEL_OVERRIDES.get(name, values["model_path"])
    values["num_gpus"] = values["n_gpus_per_node"] * values["nnodes"]
    values["sequences_per_step"] = values["train_batch_size"] * values["rollout_n"]
    values["seqs_per_gpu"] = values["sequences_per_step"] / values["num_gpus"]
    values["seqs_per_engine"] = values["seqs_per_gpu"] * values["tensor_model_parallel_size"]
    values["recipe_mean_context"] = values["max_prompt_length"] + values["max_response_length"] / 2
    return {"name": name, "file": str(path.relative_to(REPO)), "inputs": values, "defaults_taken": defaults_taken}


def recipe_roofline(recipe: dict, fixed_contexts: list[int], fixed_seqs: int) -> dict:
    """Rows of (context, concurrency) for one recipe, and the capacity-bound view at its mean context."""
    v = recipe["inputs"]
    m, tp = model_shape(v["model"]), v["tensor_model_parallel_size"]
    max_len = v["max_prompt_length"] + v["max_response_length"]
    contexts = [("recipe mean", v["recipe_mean_context"])] + [("fixed", c) for c in fixed_contexts if c <= max_len]
    skipped = [c for c in fixed_contexts if c > max_len]
    concurrencies = [("all at once", v["seqs_per_engine"]), ("fixed", fixed_seqs)]
    rows = []
    for ctx_label, ctx in contexts:
        for conc_label, seqs in concurrencies:
            rows.append({"context_label": ctx_label, "mean_context": ctx, "concurrency_label": conc_label,
                         "seqs_per_engine": seqs, "setups": compare_setups(m, tp, seqs, ctx)})
    capacity = {a.name: capacity_bound(m, tp, a, v["seqs_per_engine"], v["max_num_seqs"], v["recipe_mean_context"],
                                       v["gpu_memory_utilization"]) for a in ACCELERATORS}
    recipe.update({
        "model_shape": asdict(m),
        "kv_bytes_per_token_per_rank": {s.name: kv_bytes_per_token(m, s, tp) for s in SETUPS},
        "stored_weight_bytes_per_rank": {s.name: stored_weight_bytes(m, s, tp) for s in SETUPS},
        "contexts_beyond_max_length": skipped, "rows": rows, "capacity_bound": capacity,
        "cpu_toy": v["model"] == TINY_MODEL,
    })
    return recipe


# ---------------------------------------------------------------------------------- published figures

# Set-ups of published speed-ups. Figures and sources as ../shared/docs/qurl-paper-spec.md (§5.5) and
# ../shared/docs/peers.md (§3, §4, §12.J) give them; where a publication does not state a value the
# roofline needs, the entry says which value was assumed.
PUBLISHED = [
    {
        "name": "QuRL paper, INT8 rollout, 7B",
        "claim": "INT8 vs BF16 rollout throughput 1.2-1.3x for 7B (single A6000/A100/H100)",
        "source": "QuRL arXiv 2602.13953, Fig. 8, via qurl-paper-spec.md §5.5",
        "published_low": 1.2, "published_high": 1.3, "setup": "w8a8",
        "model": "Qwen/Qwen2.5-7B", "tp": 1, "requested_seqs": 256, "max_num_seqs": 256,
        "max_prompt_length": 2048, "max_response_length": 8192, "gpu_memory_utilization": 0.9,
        "assumed": "batch, lengths and memory share not published (qurl-paper-spec.md §4 [N]): the dapo recipe's "
                   "lengths, verl's max_num_seqs, vLLM's default gpu_memory_utilization; H100 SXM",
    },
    {
        "name": "QuRL paper, INT8 rollout, 14B",
        "claim": "INT8 vs BF16 rollout throughput 1.3-1.6x for 14B",
        "source": "QuRL arXiv 2602.13953, Fig. 8, via qurl-paper-spec.md §5.5",
        "published_low": 1.3, "published_high": 1.6, "setup": "w8a8",
        "model": "Qwen/Qwen2.5-14B", "tp": 1, "requested_seqs": 256, "max_num_seqs": 256,
        "max_prompt_length": 2048, "max_response_length": 8192, "gpu_memory_utilization": 0.9,
        "assumed": "as for 7B; one GPU",
    },
    {
        "name": "QuRL paper, INT8 rollout, 32B at TP 2",
        "claim": "INT8 vs BF16 rollout throughput 1.7x on A100, about 1.83x on H100, 32B at TP=2",
        "source": "QuRL arXiv 2602.13953, Fig. 8, via qurl-paper-spec.md §5.5",
        "published_low": 1.7, "published_high": 1.83, "setup": "w8a8",
        "model": "Qwen/Qwen2.5-32B", "tp": 2, "requested_seqs": 256, "max_num_seqs": 256,
        "max_prompt_length": 2048, "max_response_length": 8192, "gpu_memory_utilization": 0.9,
        "assumed": "as for 7B; TP 2 as published",
    },
    {
        "name": "verl FP8 rollout (linear layers), Qwen3-8B-Base",
        "claim": "FP8 rollout about 12% (CUDA 12.6) to 18% (CUDA 12.9) faster, Qwen3-8B-Base DAPO, 20K response, "
                 "8xH100; over 35% for the MoE Qwen3-30B-A3B (not modelled here)",
        "source": "verl docs/low_precision/fp8.md, via peers.md §3",
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
        "source": "NVIDIA-NeMo/RL PR #1212 (peers.md §4, §12.J; NVIDIA blog 'Run High-Throughput RL Training with "
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


# ------------------------------------------------------------------------------------------- markdown

def fmt(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}"


def fmt_bytes(x: float) -> str:
    """GB with two decimals, MB below a hundredth of a GB (the tiny CPU model)."""
    return f"{x / GB:,.2f} GB" if x >= GB / 100 else f"{x / 1e6:,.2f} MB"


def fmt_share(x: float) -> str:
    return f"{100 * x:.0f}%"


def seqs_text(x: float) -> str:
    return f"{x:g}"


def recipe_markdown(r: dict) -> list[str]:
    v = r["inputs"]
    gpus = f"{v['num_gpus']} GPU" + ("s" if v["num_gpus"] != 1 else "")
    lines = [f"## {r['name']} (`{r['file']}`)", ""]
    if r["cpu_toy"]:
        lines += ["A CPU toy: the recipe runs on a CPU; the figures are those of its model's shape on the cards below.", ""]
    lines += [f"Model `{v['model']}` ({r['model_shape']['source']}); {v['train_batch_size']} prompts x "
              f"{v['rollout_n']} = {v['sequences_per_step']} sequences on {gpus} "
              f"({v['nnodes']} x {v['n_gpus_per_node']}), rollout TP {v['tensor_model_parallel_size']}: "
              f"{seqs_text(v['seqs_per_gpu'])} sequences per GPU, {seqs_text(v['seqs_per_engine'])} per engine; "
              f"max prompt {v['max_prompt_length']}, max response {v['max_response_length']} "
              f"(recipe mean context {fmt(v['recipe_mean_context'], 0)}); "
              f"max_num_seqs {v['max_num_seqs']}, gpu_memory_utilization {v['gpu_memory_utilization']}.",
              "KV cache per token per rank: " + ", ".join(
                  f"{s['label']} {fmt(r['kv_bytes_per_token_per_rank'][s['name']] / 2**10, 1)} KiB" for s in r["setups"])
              + "; weights resident per rank: " + ", ".join(
                  f"{s['label']} {fmt_bytes(r['stored_weight_bytes_per_rank'][s['name']])}" for s in r["setups"]) + "."]
    if r["defaults_taken"]:
        lines.append("Not in the recipe, verl's default taken: " + "; ".join(f"`{d}`" for d in r["defaults_taken"]) + ".")
    if r["contexts_beyond_max_length"]:
        lines.append("Fixed contexts beyond the recipe's max length, left out: "
                     + ", ".join(str(c) for c in r["contexts_beyond_max_length"]) + ".")
    lines.append("")
    labels = [s["label"] for s in r["setups"]]
    for acc in r["accelerators"]:
        lines += [f"### {acc['label']} ({fmt(acc['bandwidth_bytes_per_s'] / 1e12)} TB/s)", "",
                  "| context (tokens) | sequences per engine | " + " | ".join(f"read per GPU {x}" for x in labels)
                  + " | " + " | ".join(f"step ms {x}" for x in labels)
                  + " | " + " | ".join(f"speed-up {x}" for x in labels[1:]) + " |",
                  "|" + "---|" * (2 + 3 * len(labels) - 1)]
        for row in r["rows"]:
            cells = [f"{fmt(row['mean_context'], 0)} ({row['context_label']})",
                     f"{seqs_text(row['seqs_per_engine'])} ({row['concurrency_label']})"]
            cells += [fmt_bytes(row["setups"][s["name"]]["total_bytes"]) for s in r["setups"]]
            cells += [fmt(row["setups"][s["name"]]["step_ms"][acc["name"]], 3) for s in r["setups"]]
            cells += [fmt(row["setups"][s["name"]]["speedup_over_bf16"]) + "x" for s in r["setups"][1:]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Capacity-bound, at the recipe mean context", "",
              "| card | set-up | KV capacity per engine (tokens) | sequences running | limited by | decode tokens/s per GPU "
              "| speed-up |", "|---|---|---|---|---|---|---|"]
    for acc in r["accelerators"]:
        for s in r["setups"]:
            c = r["capacity_bound"][acc["name"]][s["name"]]
            sp = "-" if c["speedup_over_bf16"] is None else fmt(c["speedup_over_bf16"]) + "x"
            lines.append(f"| {acc['label']} | {s['label']} | {fmt(c['kv_capacity_tokens'], 0)} | {c['running_seqs']} "
                         f"| {c.get('limited_by', 'does not fit')} | {fmt(c['tokens_per_s_per_gpu'], 0)} | {sp} |")
    return lines + [""]


def published_range(p: dict) -> str:
    low, high = fmt(p["published_low"]) + "x", fmt(p["published_high"]) + "x"
    return low if low == high else f"{low} - {high}"


def published_markdown(p: dict, label: dict) -> list[str]:
    """One published figure against the roofline, and what the gap says."""
    cap = p["capacity_bound_speedup"]
    if cap > p["published_high"]:
        where = f"above it ({fmt(cap)}x)"
    elif cap < p["published_low"]:
        where = f"below it ({fmt(cap)}x)"
    else:
        where = f"within it ({fmt(cap)}x)"
    text = [f"**{p['name']}** ({label[p['setup']]}). Published: {p['claim']} ({p['source']}). Assumed: {p['assumed']}. "
            f"The capacity-bound roofline on {p['capacity_bound_accelerator_label']} is {where}; per step it spans "
            f"{fmt(p['per_step_speedup_min'])}x - {fmt(p['per_step_speedup_max'])}x."]
    share = p["kv_share_matching_published"]
    if share is None:
        text.append(f"No KV share of the step gives {fmt(p['published_mid'])}x: the roofline cannot fall to it "
                    "at any context or batch.")
    else:
        text.append(f"The per-step roofline gives {fmt(p['published_mid'])}x when the KV cache is "
                    f"{fmt_share(share)} of a BF16 step's bytes; at the mean context with the capacity-bound batch it is "
                    f"{fmt_share(p['kv_share_at_mean_context'])}.")
    if p["untouched_share_of_bf16_time"] is not None:
        text.append(f"Read as Amdahl's law, the published figure leaves {fmt_share(p['untouched_share_of_bf16_time'])} "
                    "of the BF16 rollout time to parts the roofline does not speed up.")
    if p.get("published_kv_gain_over_linear"):
        text.append(f"The KV cache alone, over 8-bit linears: published {fmt(p['published_kv_gain_over_linear'])}x, "
                    f"capacity-bound roofline {fmt(p['roofline_kv_gain_over_linear'])}x.")
    return [" ".join(text), ""] + [f"- {e}" for e in p["explanations"]] + [""]


def markdown(report: dict) -> str:
    setups = report["setups"]
    label = {s["name"]: s["label"] for s in setups}
    lines = ["# Decode bytes per step: a memory-bound roofline of rollout", "",
             "Written by `bench/bench_decode_roofline.py` from `decode_roofline.json`; pure arithmetic, no run.", "",
             report["model_text"], "",
             "Set-ups: " + "; ".join(f"**{s['label']}**: linear weights {s['linear_weight_bytes']} B"
                                     + (f" + {s['linear_scale_bytes']} B scale per output channel" if s["linear_scale_bytes"]
                                        else "")
                                     + f", KV {s['kv_bytes']} B per element" for s in setups)
             + f"; embeddings, lm_head, norms and biases {report['other_weight_bytes']} B in all.", "",
             "Rows: the recipe mean context (max prompt + max response / 2) and fixed contexts, each with all sequences "
             f"of a step at once (batch x n / GPUs x TP, an upper bound) and a fixed {report['fixed_seqs_per_engine']} "
             "sequences per engine. Speed-up = BF16 bytes / set-up bytes: the same on every card at fixed concurrency; "
             "the cards differ in step time and, in the capacity-bound tables, in how many sequences fit.", ""]
    s = report["issue_sanity_check"]
    lines += ["## Sanity check (the issue's arithmetic)", "",
              f"`{s['model']}`, {s['seqs_per_gpu']} sequences per GPU at {s['mean_context']} tokens: KV "
              f"{fmt(s['kv_kib_per_token_bf16'], 1)} KiB per token, {fmt(s['kv_gb_bf16'])} GB per step against "
              f"{fmt(s['weights_gb']['bf16'])} GB of BF16 weights ({fmt(s['weights_gb']['w8a8'])} GB W8A8); "
              f"{label['w8a8']} {fmt(s['speedup']['w8a8'])}x, {label['w8a8_fp8kv']} {fmt(s['speedup']['w8a8_fp8kv'])}x.", ""]
    for r in report["recipes"]:
        lines += recipe_markdown({**r, "setups": setups, "accelerators": report["accelerators"]})
    lines += ["## Compared with published figures", "",
              "Each published set-up is modelled with the values it states and the assumptions listed where it does "
              "not. Per step: the range of the roofline's speed-up over the contexts and concurrencies listed. "
              "Capacity-bound: the tokens/s speed-up at the mean context, with the sequences that fit.", "",
              "| publication | set-up | published | roofline per step | roofline capacity-bound | contexts | concurrencies |",
              "|---|---|---|---|---|---|---|"]
    for p in report["published"]:
        lines.append(f"| {p['name']} | {label[p['setup']]} | {published_range(p)} | {fmt(p['per_step_speedup_min'])}x - "
                     f"{fmt(p['per_step_speedup_max'])}x | {fmt(p['capacity_bound_speedup'])}x "
                     f"({p['capacity_bound_accelerator_label']}) | {', '.join(fmt(c, 0) for c in p['contexts'])} | "
                     f"{', '.join(seqs_text(c) for c in p['concurrencies'])} |")
    lines.append("")
    for p in report["published"]:
        lines += published_markdown(p, label)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- main

MODEL_TEXT = ("Roofline: a decode step's time is the bytes one GPU reads divided by its memory bandwidth: every "
              "decoder weight and the lm_head once, the embedding rows of the tokens it embeds, and the KV cache of "
              "every running sequence at its mean context; tensor parallelism splits weights and KV heads over "
              "the ranks of an engine (KV heads replicated where fewer than ranks). Ignored: compute, attention-"
              "kernel efficiency, activations, sampling and logits, the prefill, weight sync and CPU overheads. "
              "FP8 linear weights read as many bytes as INT8 (one per weight; their scales are negligible), so the "
              "W8A8 set-up stands for either. "
              "Concurrency 'all sequences of a step at once' is an upper bound; the capacity-bound tables cap it by "
              "max_num_seqs and by the KV cache that fits in the memory vLLM may use after the weights.")


def build_report(recipe_paths: list[Path], fixed_contexts: list[int], fixed_seqs: int) -> dict:
    recipes = []
    for p in recipe_paths:
        recipes.append(recipe_roofline(recipe_inputs(p), fixed_contexts, fixed_seqs))
    return {
        "what": "bytes a decode step reads per GPU and the memory-bound step time, per recipe and rollout set-up",
        "model_text": MODEL_TEXT,
        "setups": [asdict(s) for s in SETUPS],
        "other_weight_bytes": OTHER_WEIGHT_BYTES,
        "accelerators": [asdict(a) for a in ACCELERATORS],
        "fixed_contexts": fixed_contexts,
        "fixed_seqs_per_engine": fixed_seqs,
        "verl_defaults": VERL_DEFAULTS,
        "issue_sanity_check": issue_sanity_check(),
        "recipes": recipes,
        "published": [published_comparison(ref, fixed_contexts, fixed_seqs) for ref in PUBLISHED],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--recipes", nargs="*", default=None,
                    help="recipe names in qurl_verl/hydra_configs/qurl_recipe (default: every one not starting with _)")
    ap.add_argument("--contexts", nargs="*", type=int, default=[1024, 3072, 8192, 16384],
                    help="fixed mean contexts (tokens) besides each recipe's own mean")
    ap.add_argument("--fixed-seqs", type=int, default=32, help="the smaller concurrency, sequences per engine")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output path without suffix (.json and .md)")
    args = ap.parse_args()
    names = args.recipes or sorted(p.stem for p in RECIPE_DIR.glob("*.yaml") if not p.stem.startswith("_"))
    report = build_report([RECIPE_DIR / f"{n}.yaml" for n in names], args.contexts, args.fixed_seqs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(markdown(json.loads(args.out.with_suffix(".json").read_text())) + "\n")
    print(f"wrote {args.out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
