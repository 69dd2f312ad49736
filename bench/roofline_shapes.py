"""What the decode roofline counts with: model shapes (from their config.json), rollout set-ups (bytes per
weight, scale and KV element) and accelerators (bandwidth, memory).
"""
from __future__ import annotations

from dataclasses import dataclass

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
    # Qwen2.5-Math-7B (the DAPO recipe's model): the Qwen2.5-7B shape, 3584, 28, 28, 4, 128, 18944, 152064, untied
    "Qwen/Qwen2.5-Math-7B": ModelShape(
        3584, 28, 28, 4, 128, 18944, 152064, False, True, False,
        "config.json of Qwen/Qwen2.5-Math-7B (recipes/dapo/Qwen2.5-Math-7B/config.json)"),
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
