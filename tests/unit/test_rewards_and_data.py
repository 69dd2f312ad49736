"""The demo's task: prompts in verl's format, and a reward that grades them by rule."""
from __future__ import annotations

import pandas as pd
import pytest

from qurl_recipes.data.arithmetic import DATA_SOURCE, make_rows, write_parquet
from qurl_verl.recipe_rewards.arithmetic import compute_score


def test_rows_are_deterministic_and_correct():
    rows = make_rows(50, seed=3, split="train")
    assert rows == make_rows(50, seed=3, split="train")
    for r in rows:
        q = r["prompt"][0]["content"]
        a, op, b = q.removeprefix("What is ").split("?")[0].split(" ")
        assert int(r["reward_model"]["ground_truth"]) == eval(f"{a}{op}{b}")  # noqa: S307


def test_parquet_loads_in_verl_rl_dataset(tmp_path):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from qurl_recipes.tiny_model import build_tiny_model

    train, val = write_parquet(tmp_path, n_train=8, n_val=4)
    assert len(pd.read_parquet(train)) == 8 and len(pd.read_parquet(val)) == 4
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 64, "filter_overlong_prompts": False,
                            "return_raw_chat": True, "truncation": "error"})
    ds = RLHFDataset(data_files=[str(train)], tokenizer=tok, config=cfg)
    item = ds[0]
    assert item["data_source"] == DATA_SOURCE
    assert item["reward_model"]["ground_truth"] == pd.read_parquet(train).iloc[0]["reward_model"]["ground_truth"]


def test_reward_grades_by_rule():
    assert compute_score(DATA_SOURCE, "12 + 7 = 19. The answer is 19.", "19")["score"] == 1.0
    assert compute_score(DATA_SOURCE, "The answer is -5", "-5")["acc"] == 1.0
    wrong = compute_score(DATA_SOURCE, "The answer is 18", "19")
    assert wrong["acc"] == 0.0 and 0.0 < wrong["score"] < 0.5
    assert compute_score(DATA_SOURCE, "no digits here", "19")["score"] == 0.0
    # more digits, more (partial) reward: the signal a random tiny model can climb
    assert compute_score(DATA_SOURCE, "1234", "19")["score"] > compute_score(DATA_SOURCE, "a1bc", "19")["score"]


def test_operator_and_operand_range_options():
    from qurl_recipes.data.arithmetic import question, solve

    rows = make_rows(200, seed=5, split="train", ops="+-", max_operand=20)
    seen_ops = set()
    for r in rows:
        a, op, b = r["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" ")
        seen_ops.add(op)
        assert 0 <= int(a) <= 20 and 0 <= int(b) <= 20
        assert int(r["reward_model"]["ground_truth"]) == eval(f"{a}{op}{b}")  # noqa: S307
        assert r["prompt"][0]["content"] == question(int(a), op, int(b))
    assert seen_ops == {"+", "-"}
    with pytest.raises(ValueError, match="unknown operator"):
        solve(1, "/", 2)


def test_cli_refuses_unknown_operators(tmp_path, capsys):
    from qurl_recipes.data.arithmetic import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--ops", "+/"])
    assert "--ops must be" in capsys.readouterr().err
    assert not (tmp_path / "train.parquet").exists()


def test_exact_reward_has_no_shaping():
    from qurl_verl.recipe_rewards.arithmetic import compute_exact_score

    assert compute_exact_score(DATA_SOURCE, "19", "19") == {"score": 1.0, "acc": 1.0}
    assert compute_exact_score(DATA_SOURCE, "-3", "-3")["score"] == 1.0
    # digits that are wrong earn nothing, unlike the shaped demo reward
    assert compute_exact_score(DATA_SOURCE, "1234", "19")["score"] == 0.0
    assert compute_exact_score(DATA_SOURCE, "", "19")["score"] == 0.0
