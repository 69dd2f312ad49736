"""GSM8K for the PPO recipe (`+qurl_recipe=gsm8k_ppo`, the paper's Table 1), in verl's RL parquet format.

Reads the complete train and test sets shipped in the repository's `data/gsm8k/` (openai/grade-school-math,
origin schema `{"question", "answer"}`; see `data/README.md`) and writes them the way verl's own GSM8K
example (`examples/data_preprocess/gsm8k.py`) does:

* prompt: one user message, the question followed by `Let's think step by step and output the final
  answer after "####".`;
* `data_source` = `openai/gsm8k`, which verl's `default_compute_score` sends to its GSM8K scorer: 1.0
  when the last `#### <number>` of the response equals the ground truth, else 0.0 (no partial credit);
* `reward_model.ground_truth` = the number after `#### ` in the reference solution, thousands
  separators removed, read with that scorer's own extractor so the two always agree.

    python -m qurl_recipes.data.gsm8k --out ~/data/qurl/gsm8k     # train.parquet (7,473) + val.parquet (1,319)
    python -m qurl_recipes.data.gsm8k --check-reward              # score the reference solutions with verl's scorer
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

SHIPPED_DATA = Path(__file__).resolve().parents[2] / "data" / "gsm8k"
DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# parquet split -> (shipped file, verl's extra_info.split)
SPLITS = {"train": ("train.jsonl", "train"), "val": ("test.jsonl", "test")}


def prompt_text(question: str) -> str:
    return f"{question} {INSTRUCTION}"


def ground_truth(solution: str) -> str:
    """The final answer of a reference solution: the number after its last `#### `, without commas."""
    from verl.utils.reward_score.gsm8k import extract_solution

    answer = extract_solution(solution, method="strict")
    if answer is None:
        raise ValueError(f"no '#### <number>' line in the reference solution: {solution[-120:]!r}")
    return answer


def read_shipped(split: str, data_dir: str | Path | None = None) -> list[dict]:
    """Rows of a shipped file, `split` being `train` or `val` (the GSM8K test set)."""
    path = Path(data_dir if data_dir is not None else SHIPPED_DATA) / SPLITS[split][0]
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing. The GSM8K recipe reads the files shipped in the qurl-verl repository's "
            "data/gsm8k/ (see data/README.md); pass --data-dir <folder holding train.jsonl and test.jsonl>."
        )
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def to_verl_rows(records: list[dict], split: str) -> list[dict]:
    """verl RL rows: chat prompt, data_source, reward_model.ground_truth, extra_info."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt_text(rec["question"])}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth(rec["answer"])},
            "extra_info": {"split": SPLITS[split][1], "index": i, "answer": rec["answer"], "question": rec["question"]},
        }
        for i, rec in enumerate(records)
    ]


def write_gsm8k_data(out_dir: str | Path, data_dir: str | Path | None = None) -> dict[str, Path]:
    """Write `train.parquet` and `val.parquet`; returns their paths."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in SPLITS:
        path = out / f"{split}.parquet"
        tmp = path.with_suffix(".parquet.partial")
        pd.DataFrame(to_verl_rows(read_shipped(split, data_dir), split)).to_parquet(tmp, index=False)
        tmp.replace(path)  # a run that stops half-way leaves no file a later run would trust
        paths[split] = path
    return paths


def reward_function() -> Callable:
    """The scorer verl's reward loop calls for these rows (no custom reward function is set)."""
    from verl.utils.reward_score import default_compute_score

    return default_compute_score


def wrong_answer(answer: str) -> str:
    return str(int(answer) + 1)


def reward_agreement(split: str, limit: int | None = None, data_dir: str | Path | None = None) -> dict[str, int]:
    """How verl's scorer grades each reference solution (should be 1.0) and the same with the final number changed (0.0)."""
    score = reward_function()
    records = read_shipped(split, data_dir)[:limit]
    stats = {"rows": len(records), "reference_correct": 0, "wrong_number_scored_zero": 0}
    for rec, row in zip(records, to_verl_rows(records, split)):
        gt = row["reward_model"]["ground_truth"]
        stats["reference_correct"] += score(DATA_SOURCE, rec["answer"], gt) == 1.0
        body = rec["answer"].rsplit("#### ", 1)[0]
        stats["wrong_number_scored_zero"] += score(DATA_SOURCE, f"{body}#### {wrong_answer(gt)}", gt) == 0.0
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write GSM8K train/val parquet files in verl's format.")
    ap.add_argument("--out", help="folder for train.parquet and val.parquet")
    ap.add_argument("--data-dir", help="folder holding train.jsonl and test.jsonl (default: the repository's data/gsm8k)")
    ap.add_argument("--check-reward", action="store_true",
                    help="score each reference solution, and the same solution with another final number, with verl's scorer")
    ap.add_argument("--limit", type=int, help="--check-reward: rows per file")
    a = ap.parse_args(argv)
    try:
        if a.check_reward:
            for split in SPLITS:
                print(split, reward_agreement(split, a.limit, a.data_dir))
            return 0
        if not a.out:
            ap.error("--out is required unless --check-reward is given")
        paths = write_gsm8k_data(a.out, a.data_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths.values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
