"""GSM8K for the PPO recipe: the shipped files are the documented ones, the conversion writes verl's
GSM8K rows, and verl's scorer gives the reference solution 1 and any other final number 0."""
from __future__ import annotations

import hashlib

import pytest

from qurl_recipes.data import gsm8k

SHA256 = {  # data/README.md
    "train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
}
FIRST = 20


@pytest.fixture(scope="module")
def train_head():
    return gsm8k.read_shipped("train")[:FIRST]


def test_shipped_files_are_the_origin_files():
    for name, digest in SHA256.items():
        assert hashlib.sha256((gsm8k.SHIPPED_DATA / name).read_bytes()).hexdigest() == digest
    assert (gsm8k.SHIPPED_DATA.parent / "LICENSES" / "openai_grade-school-math_MIT.txt").read_text().startswith("MIT License")


def test_rows_are_verls_gsm8k_rows(train_head):
    rows = gsm8k.to_verl_rows(train_head, "train")
    assert rows[0]["prompt"] == [{"role": "user", "content": (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
        "clips did Natalia sell altogether in April and May? Let's think step by step and output the final answer "
        "after \"####\".")}]
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "72"}
    for i, (rec, row) in enumerate(zip(train_head, rows)):
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["prompt"][0]["content"] == f"{rec['question']} {gsm8k.INSTRUCTION}"
        assert row["reward_model"]["ground_truth"] == rec["answer"].split("#### ")[-1].strip().replace(",", "")
        assert row["extra_info"] == {"split": "train", "index": i, "answer": rec["answer"], "question": rec["question"]}


def test_thousands_separators_are_removed():
    rec = next(r for r in gsm8k.read_shipped("train") if "," in r["answer"].split("#### ")[-1])
    truth = gsm8k.ground_truth(rec["answer"])
    assert "," not in truth and truth == rec["answer"].split("#### ")[-1].replace(",", "") and int(truth) >= 1000
    assert gsm8k.reward_function()(gsm8k.DATA_SOURCE, rec["answer"], truth) == 1.0


def test_reward_of_reference_and_wrong_answers(train_head):
    score = gsm8k.reward_function()  # what verl's reward loop calls: no custom reward function is set
    for row in gsm8k.to_verl_rows(train_head, "train"):
        truth, solution = row["reward_model"]["ground_truth"], row["extra_info"]["answer"]
        assert score(row["data_source"], solution, truth) == 1.0
        body = solution.rsplit("#### ", 1)[0]
        assert score(row["data_source"], f"{body}#### {int(truth) + 1}", truth) == 0.0
        assert score(row["data_source"], body, truth) == 0.0  # no "####" line: no answer
        assert score(row["data_source"], f"So the answer is {truth}.", truth) == 0.0  # the format is part of the task
    assert gsm8k.reward_agreement("val", limit=FIRST) == {"rows": FIRST, "reference_correct": FIRST, "wrong_number_scored_zero": FIRST}


def test_written_parquet(tmp_path):
    import pandas as pd

    paths = gsm8k.write_gsm8k_data(tmp_path)
    train, val = (pd.read_parquet(paths[s]) for s in ("train", "val"))
    assert (len(train), len(val)) == (7473, 1319)
    assert set(val.extra_info.map(lambda e: e["split"])) == {"test"}
    first = gsm8k.to_verl_rows(gsm8k.read_shipped("val")[:1], "val")[0]
    row = val.iloc[0]
    assert row.reward_model == first["reward_model"] and list(row.prompt) == first["prompt"]
    assert row.extra_info["index"] == 0


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"test.jsonl is missing.*data/gsm8k/"):
        gsm8k.read_shipped("val", tmp_path)
    assert gsm8k.main(["--out", str(tmp_path / "out"), "--data-dir", str(tmp_path)]) == 2
