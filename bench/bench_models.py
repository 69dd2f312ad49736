"""Random-weight Qwen2 models for the benchmarks, with a choice of weight init.

Speed does not depend on the weight values, but log-prob fidelity does, a lot:

* ``gain4``: the project's tiny-model init (std 0.02) scaled by 4, as the reload tests use. At
  hidden 128 that is close to 1/sqrt(fan_in), i.e. roughly signal-preserving; at hidden 1024 every
  linear amplifies its input ~2.6x, the depth-9 network becomes chaotic and any rounding (bf16
  included) is amplified layer after layer. Not a model anyone trains.
* ``default``: the plain HF init (std 0.02): contracting at hidden 1024, near-flat next-token
  distributions, so small log-prob deltas say little.
* ``fanin``: std 1/sqrt(fan_in) for the projections, o_proj/down_proj further scaled by
  1/sqrt(2 * layers) (the usual residual-branch scaling), tied embeddings at std 0.08 so logits
  spread over a few nats. Activations keep their scale through depth, like a trained LLM's
  (minus the activation outliers of real models, which random weights do not have).

Every init ends with a 1e-3 relative jitter that moves values off the bf16 grid, as a trainer's
fp32 masters are after the first update (see ``qurl_testkit/reload_harness.py``).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

INITS = ("gain4", "default", "fanin")
SPECS = {
    "tiny": dict(),
    # ~102M parameters (tied embeddings): large enough for decode to stream weights from memory
    "mid": dict(hidden_size=1024, num_layers=9, num_heads=16, num_kv_heads=4, intermediate_size=2816),
}
EMBED_STD = 0.08  # fanin: tied embedding / lm_head std


def build_model(out: Path, model: str = "mid", init: str = "fanin") -> Path:
    """Write an fp32 HF folder (config, weights, tokenizer) for ``SPECS[model]`` with ``init``."""
    from transformers import AutoModelForCausalLM

    from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    build_tiny_model(out, TinyModelSpec(**SPECS[model]))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    n_layers = hf.config.num_hidden_layers
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and init == "gain4":
                p.mul_(4.0)
            elif p.dim() == 2 and init == "fanin":
                if "embed_tokens" in name or "lm_head" in name:
                    std = EMBED_STD
                else:
                    std = 1 / math.sqrt(p.shape[1])
                    if name.endswith(("o_proj.weight", "down_proj.weight")):
                        std /= math.sqrt(2 * n_layers)
                p.normal_(0.0, std, generator=gen)
            p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(out)
    return out


def param_count(master: dict[str, torch.Tensor], tied: bool) -> int:
    """Parameters, counting a tied lm_head once."""
    return sum(t.numel() for n, t in master.items() if not (n == "lm_head.weight" and tied))
