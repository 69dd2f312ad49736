"""Deterministic synthetic arithmetic prompts in verl's parquet format (the embedded demo task)."""
from __future__ import annotations

import argparse
import random
from pathlib import Path

DATA_SOURCE = "qurl/arithmetic"


def make_rows(n: int, seed: int, split: str) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"What is {a} {op} {b}? Answer with a number."}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def write_parquet(out_dir: str | Path, n_train: int = 256, n_val: int = 32, seed: int = 0) -> tuple[Path, Path]:
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n, s in (("train", n_train, seed), ("val", n_val, seed + 1)):
        p = out / f"{split}.parquet"
        pd.DataFrame(make_rows(n, s, split)).to_parquet(p, index=False)
        paths.append(p)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the synthetic arithmetic train/val parquet files.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-val", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    train, val = write_parquet(a.out, a.n_train, a.n_val, a.seed)
    print(f"wrote {train} and {val}")


if __name__ == "__main__":
    main()
