"""Deterministic synthetic arithmetic prompts in verl's parquet format (the embedded demo task)."""
from __future__ import annotations

import argparse
import random
from pathlib import Path

DATA_SOURCE = "qurl/arithmetic"
OPS = "+-*"


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}? Answer with a number."


def solve(a: int, op: str, b: int) -> int:
    if op not in OPS:
        raise ValueError(f"unknown operator {op!r}; expected one of {OPS!r}")
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_rows(n: int, seed: int, split: str, ops: str = OPS, max_operand: int = 99) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(ops)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": question(a, op, b)}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(solve(a, op, b))},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def write_parquet(out_dir: str | Path, n_train: int = 256, n_val: int = 32, seed: int = 0, ops: str = OPS,
                  max_operand: int = 99) -> tuple[Path, Path]:
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n, s in (("train", n_train, seed), ("val", n_val, seed + 1)):
        p = out / f"{split}.parquet"
        pd.DataFrame(make_rows(n, s, split, ops, max_operand)).to_parquet(p, index=False)
        paths.append(p)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the synthetic arithmetic train/val parquet files.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-val", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", default=OPS, help="operators to draw from, e.g. '+-'")
    ap.add_argument("--max-operand", type=int, default=99)
    a = ap.parse_args(argv)
    if not a.ops or set(a.ops) - set(OPS):
        ap.error(f"--ops must be a non-empty subset of {OPS!r}, got {a.ops!r}")
    train, val = write_parquet(a.out, a.n_train, a.n_val, a.seed, a.ops, a.max_operand)
    print(f"wrote {train} and {val}")


if __name__ == "__main__":
    main()
