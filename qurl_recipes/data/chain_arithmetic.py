"""Multi-step arithmetic with the steps written out: responses of 32-64 tokens for the tiny model.

The one-operation task answers in a few tokens, too short for the per-token mismatch between an
8-bit rollout policy and the full-precision policy to build up over a sequence as it does in long
chains of thought. Here a problem chains several operations on a running value; the reference
solution writes every step ("7 + 5 = 12. 12 * 3 = 36. Answer: 36") and the reward checks only the
final number. The tiny model's tokenizer, as verl loads it from the model folder
(``AutoTokenizer``: a ``Qwen2Tokenizer``), writes every digit as its own token, so a step costs
about 12 tokens: the default 4-5 operations give 39-63 tokens (at most 64 with the end-of-turn
token), and the prompt, which uses operator symbols, 48-57 tokens with the chat template (the
demo's limit is 64). ``tests/unit/test_chain_arithmetic.py`` measures both with that tokenizer.

Values stay within 0..99 after every step, numbers the model has seen.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "qurl/chain_arithmetic"
MIN_VALUE, MAX_VALUE = 0, 99
MAX_ADD_SUB_OPERAND = 20
MULTIPLIERS = (2, 3, 4, 5)
DEFAULT_MIN_OPS, DEFAULT_MAX_OPS = 4, 5
MAX_START = 20


@dataclass(frozen=True)
class ChainProblem:
    start: int
    steps: tuple[tuple[str, int], ...]  # (operator, operand) pairs applied in order

    def question(self) -> str:
        ops = ", ".join(f"{op} {b}" for op, b in self.steps)
        return f"Start with {self.start}. Apply in order: {ops}."

    def values(self) -> list[int]:
        """The running value before the first and after every step."""
        vals = [self.start]
        for op, b in self.steps:
            vals.append(apply_op(vals[-1], op, b))
        return vals

    def answer(self) -> int:
        return self.values()[-1]

    def reference_solution(self) -> str:
        vals = self.values()
        lines = [f"{vals[i]} {op} {b} = {vals[i + 1]}." for i, (op, b) in enumerate(self.steps)]
        return " ".join(lines) + f" Answer: {vals[-1]}"


def apply_op(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}; expected one of '+-*'")


def _feasible_steps(value: int) -> dict[str, range]:
    """Operands per operator that keep the running value within MIN_VALUE..MAX_VALUE."""
    options = {
        "+": range(1, min(MAX_ADD_SUB_OPERAND, MAX_VALUE - value) + 1),
        "-": range(1, min(MAX_ADD_SUB_OPERAND, value - MIN_VALUE) + 1),
        # multiplying 0 or 1 teaches nothing, so only values that really change qualify
        "*": range(MULTIPLIERS[0], min(MULTIPLIERS[-1], MAX_VALUE // value) + 1) if value >= 2 else range(0),
    }
    return {op: r for op, r in options.items() if len(r)}


def draw_problem(rng: random.Random, min_ops: int = DEFAULT_MIN_OPS, max_ops: int = DEFAULT_MAX_OPS) -> ChainProblem:
    """Operator uniform over those that keep the value in range, then the operand uniform."""
    value = rng.randint(0, MAX_START)
    start, steps = value, []
    for _ in range(rng.randint(min_ops, max_ops)):
        feasible = _feasible_steps(value)
        op = rng.choice(sorted(feasible))
        b = rng.choice(feasible[op])
        steps.append((op, b))
        value = apply_op(value, op, b)
    return ChainProblem(start, tuple(steps))


def draw_problems(n: int, seed: int, min_ops: int = DEFAULT_MIN_OPS, max_ops: int = DEFAULT_MAX_OPS,
                  exclude: set[ChainProblem] = frozenset()) -> list[ChainProblem]:
    """`n` distinct problems, none in `exclude` (so val never repeats a train problem)."""
    if not 1 <= min_ops <= max_ops:
        raise ValueError(f"need 1 <= min_ops <= max_ops, got {min_ops}..{max_ops}")
    rng = random.Random(seed)
    seen, out = set(exclude), []
    for _ in range(100 * n + 1000):
        if len(out) == n:
            break
        p = draw_problem(rng, min_ops, max_ops)
        if p not in seen:
            seen.add(p)
            out.append(p)
    if len(out) < n:
        raise ValueError(f"could not draw {n} distinct problems with {min_ops}..{max_ops} operations")
    return out


def to_row(p: ChainProblem, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": p.question()}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(p.answer())},
        "extra_info": {"split": split, "index": index, "n_ops": len(p.steps), "reference": p.reference_solution()},
    }


def make_splits(n_train: int = 256, n_val: int = 32, seed: int = 0, min_ops: int = DEFAULT_MIN_OPS,
                max_ops: int = DEFAULT_MAX_OPS) -> tuple[list[dict], list[dict]]:
    train = draw_problems(n_train, seed, min_ops, max_ops)
    val = draw_problems(n_val, seed + 1, min_ops, max_ops, exclude=set(train))
    return ([to_row(p, "train", i) for i, p in enumerate(train)],
            [to_row(p, "val", i) for i, p in enumerate(val)])


def write_parquet(out_dir: str | Path, n_train: int = 256, n_val: int = 32, seed: int = 0,
                  min_ops: int = DEFAULT_MIN_OPS, max_ops: int = DEFAULT_MAX_OPS) -> tuple[Path, Path]:
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, rows in zip(("train", "val"), make_splits(n_train, n_val, seed, min_ops, max_ops)):
        p = out / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(p, index=False)
        paths.append(p)
    return paths[0], paths[1]


def sft_pairs(seed: int, min_ops: int = DEFAULT_MIN_OPS, max_ops: int = DEFAULT_MAX_OPS):
    """Endless (question, reference solution) pairs for a supervised warm start.

    Same shape as `tiny_sft`'s example stream; use a seed disjoint from the RL files' seeds.
    """
    rng = random.Random(seed)
    while True:
        p = draw_problem(rng, min_ops, max_ops)
        yield p.question(), p.reference_solution()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the multi-step arithmetic train/val parquet files.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-val", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-ops", type=int, default=DEFAULT_MIN_OPS)
    ap.add_argument("--max-ops", type=int, default=DEFAULT_MAX_OPS)
    a = ap.parse_args(argv)
    if not 1 <= a.min_ops <= a.max_ops:
        ap.error(f"need 1 <= --min-ops <= --max-ops, got {a.min_ops}..{a.max_ops}")
    train, val = write_parquet(a.out, a.n_train, a.n_val, a.seed, a.min_ops, a.max_ops)
    print(f"wrote {train} and {val}")


if __name__ == "__main__":
    main()
