"""Tiny random HF causal LMs built from config classes (no hub access), for any test to import."""
from __future__ import annotations

import torch

TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=256,
    max_position_embeddings=128,
)


def build_tiny_causal_lm(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A 2-layer random model of the given family; norm weights are randomised so folds are visible."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[model_type]
    dims = dict(TINY_DIMS, head_dim=16)
    dims.update(overrides)
    config = config_cls(**dims)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.05 * torch.randn_like(param))
    return model.to(dtype)
