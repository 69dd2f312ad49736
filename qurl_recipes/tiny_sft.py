"""Supervised warm start of the embedded tiny model on synthetic arithmetic, before GRPO.

A randomly initialised model never samples a correct answer, so an exact-answer reward gives every
GRPO group the same score and no learning signal. A short SFT on the task's chat format fixes that:
stopped early, the model answers a minority of prompts correctly at temperature 1 and a fair share
of prompts have at least one correct sample in a group, which is where GRPO can make progress.

The SFT questions are drawn from a seed disjoint from the RL train/val files' seeds, with the same
wording and the same chat template verl applies, and the loss covers only the answer tokens
(the answer followed by the end-of-turn token). Plain torch + transformers; deterministic on CPU.

`task="chain_arithmetic"` warms up on the multi-step task instead: the target is the written-out
solution, and evaluation generates long enough for it and grades the number after "Answer:",
as that task's reward does.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qurl_recipes.data import chain_arithmetic
from qurl_recipes.data.arithmetic import question, solve

TASKS = ("arithmetic", "chain_arithmetic")
# Room for the answer and the end-of-turn token; the chain solutions take up to 52 tokens.
MAX_NEW_TOKENS = {"arithmetic": 8, "chain_arithmetic": 64}


@dataclass(frozen=True)
class SftSettings:
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    ops: str = "+-"
    max_operand: int = 20
    seed: int = 1234
    eval_prompts: int = 256
    task: str = "arithmetic"  # one of TASKS
    min_ops: int = chain_arithmetic.DEFAULT_MIN_OPS  # chain task only
    max_ops: int = chain_arithmetic.DEFAULT_MAX_OPS  # chain task only

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; expected one of {TASKS}")


def _grader(task: str):
    """Text -> graded integer, matching the reward the RL run uses for `task`."""
    if task == "chain_arithmetic":
        from qurl_verl.recipe_rewards.chain_arithmetic import final_answer

        return final_answer
    from qurl_verl.recipe_rewards.arithmetic import final_number

    return final_number


def _example_stream(settings: SftSettings):
    if settings.task == "chain_arithmetic":
        yield from chain_arithmetic.sft_pairs(settings.seed, settings.min_ops, settings.max_ops)
        return
    rng = random.Random(settings.seed)
    while True:
        a, b = rng.randint(0, settings.max_operand), rng.randint(0, settings.max_operand)
        op = rng.choice(settings.ops)
        yield question(a, op, b), str(solve(a, op, b))


def _encode(tokenizer, q: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt+answer+eos and the labels (-100 on the prompt)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return list(prompt_ids) + answer_ids, [-100] * len(prompt_ids) + answer_ids


def _batch(tokenizer, pairs, pad_id: int):
    import torch

    enc = [_encode(tokenizer, q, a) for q, a in pairs]
    width = max(len(ids) for ids, _ in enc)
    ids = torch.full((len(enc), width), pad_id, dtype=torch.long)
    labels = torch.full((len(enc), width), -100, dtype=torch.long)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    for i, (x, y) in enumerate(enc):  # left-aligned; causal attention never sees the right padding
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return ids, labels, mask


def _held_out_rows(settings: SftSettings) -> list[tuple[str, str]]:
    """(question, expected final number) pairs from a seed apart from the training stream's."""
    if settings.task == "chain_arithmetic":
        pairs = chain_arithmetic.sft_pairs(settings.seed + 7, settings.min_ops, settings.max_ops)
        grade = _grader(settings.task)
        return [(q, str(grade(sol))) for q, sol in (next(pairs) for _ in range(settings.eval_prompts))]
    held_out = random.Random(settings.seed + 7)
    rows = []
    for _ in range(settings.eval_prompts):
        a, b = held_out.randint(0, settings.max_operand), held_out.randint(0, settings.max_operand)
        op = held_out.choice(settings.ops)
        rows.append((question(a, op, b), str(solve(a, op, b))))
    return rows


def sampled_accuracy(model, tokenizer, rows: list[tuple[str, str]], samples: int = 1, temperature: float = 1.0,
                     max_new_tokens: int | None = None, seed: int = 0, task: str = "arithmetic") -> dict:
    """Share of correct sampled answers (pass@1 estimate) and of prompts with any correct sample.

    `rows` hold (question, expected final number); `task` picks the grader and, unless given, the
    generation length.
    """
    import torch

    grade = _grader(task)
    if max_new_tokens is None:
        max_new_tokens = MAX_NEW_TOKENS[task]
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q, _ in rows]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    correct = torch.zeros(len(rows), samples)
    with torch.no_grad():
        for s in range(samples):
            out = model.generate(**enc, do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                                 top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for i, (t, (_, ans)) in enumerate(zip(texts, rows)):
                got = grade(t)
                correct[i, s] = float(got is not None and got == int(ans))
    return {"acc_mean": correct.mean().item(), "any_correct": (correct.max(dim=1).values > 0).float().mean().item()}


def run_sft(base_dir: str | Path, out_dir: str | Path, settings: SftSettings = SftSettings(), log_every: int = 50) -> dict:
    """Train `base_dir`'s model on `settings.task`'s answers, save it to `out_dir` and return the record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / settings.warmup_steps)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, settings.steps) / settings.steps)))
    stream = _example_stream(settings)
    losses, t0 = [], time.perf_counter()
    for step in range(settings.steps):
        ids, labels, mask = _batch(tokenizer, [next(stream) for _ in range(settings.batch_size)], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"[sft] step {step + 1}/{settings.steps} loss {sum(losses[-log_every:]) / log_every:.4f}", flush=True)
    train_s = time.perf_counter() - t0

    model.eval()
    rows = _held_out_rows(settings)
    greedy = sampled_accuracy(model, tokenizer, rows, samples=1, temperature=0.0, task=settings.task)
    sampled = sampled_accuracy(model, tokenizer, rows, samples=4, temperature=1.0, seed=settings.seed, task=settings.task)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record = {
        "settings": asdict(settings),
        "base": str(Path(base_dir).name),
        "train_s": round(train_s, 1),
        "loss_first": losses[0],
        "loss_last_50": sum(losses[-50:]) / min(50, len(losses)),
        "greedy_acc": greedy["acc_mean"],
        "sampled_acc_t1": sampled["acc_mean"],
        "any_of_4_correct_t1": sampled["any_correct"],
    }
    (out / "qurl_tiny_sft.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="SFT warm start of the tiny model on synthetic (chain) arithmetic.")
    ap.add_argument("--base", required=True, help="HF folder of the model to start from (python -m qurl_recipes.tiny_model)")
    ap.add_argument("--out", required=True)
    for f, default in asdict(SftSettings()).items():
        choices = TASKS if f == "task" else None
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default, choices=choices)
    a = vars(ap.parse_args(argv))
    base, out = a.pop("base"), a.pop("out")
    record = run_sft(base, out, SftSettings(**a))
    print(json.dumps(record, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
