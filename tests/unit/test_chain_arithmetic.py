"""Multi-step arithmetic: correct written-out steps, disjoint splits, 32-64 token solutions, exact reward."""
from __future__ import annotations

import re

import pandas as pd
import pytest

from qurl_recipes.data.chain_arithmetic import (
    DATA_SOURCE,
    DEFAULT_MAX_OPS,
    DEFAULT_MIN_OPS,
    draw_problems,
    main,
    make_splits,
    sft_pairs,
    write_parquet,
)
from qurl_verl.recipe_rewards.chain_arithmetic import compute_score

_STEP = re.compile(r"^(\d+) ([+\-*]) (\d+) = (\d+)\.$")


def _check_solution(question: str, solution: str) -> int:
    """Recompute every written step independently; return the stated final answer."""
    start, ops = re.fullmatch(r"Start with (\d+)\. Apply in order: (.*)\.", question).groups()
    asked = [(op, int(b)) for op, b in (s.split(" ") for s in ops.split(", "))]
    body, final = solution.rsplit(" Answer: ", 1)
    steps = re.findall(r"\d+ [+\-*] \d+ = \d+\.", body)
    assert " ".join(steps) == body
    value = int(start)
    assert len(steps) == len(asked)
    for step, (op, b) in zip(steps, asked):
        a, sop, sb, result = _STEP.match(step).groups()
        assert (int(a), sop, int(sb)) == (value, op, b), step  # continues from the previous result
        assert int(result) == {"+": int(a) + int(sb), "-": int(a) - int(sb), "*": int(a) * int(sb)}[sop], step
        assert 0 <= int(result) <= 99
        value = int(result)
    assert int(final) == value
    return int(final)


def test_deterministic_per_seed_and_splits_disjoint():
    train, val = make_splits(n_train=300, n_val=60, seed=4)
    assert (train, val) == make_splits(n_train=300, n_val=60, seed=4)
    assert train != make_splits(n_train=300, n_val=60, seed=5)[0]
    train_q = {r["prompt"][0]["content"] for r in train}
    val_q = {r["prompt"][0]["content"] for r in val}
    assert len(train_q) == 300 and len(val_q) == 60
    assert not train_q & val_q


def test_reference_steps_are_correct_and_answer_is_ground_truth():
    train, val = make_splits(n_train=200, n_val=50, seed=0)
    for r in train + val:
        assert r["data_source"] == DATA_SOURCE
        final = _check_solution(r["prompt"][0]["content"], r["extra_info"]["reference"])
        assert str(final) == r["reward_model"]["ground_truth"]
        assert DEFAULT_MIN_OPS <= r["extra_info"]["n_ops"] <= DEFAULT_MAX_OPS
    ops = {op for p in draw_problems(200, seed=1) for op, _ in p.steps}
    assert ops == {"+", "-", "*"}


def test_reward_is_exact_on_the_last_answer():
    train, _ = make_splits(n_train=20, n_val=1, seed=2)
    for r in train:
        ref, gt = r["extra_info"]["reference"], r["reward_model"]["ground_truth"]
        assert compute_score(DATA_SOURCE, ref, gt)["score"] == 1.0
        assert compute_score(DATA_SOURCE, ref + "<|im_end|>", gt)["score"] == 1.0
        assert compute_score(DATA_SOURCE, ref + ".\n<|im_end|><|endoftext|> more text", gt)["score"] == 1.0
        wrong = ref.rsplit(" ", 1)[0] + f" {int(gt) + 1}"
        assert compute_score(DATA_SOURCE, wrong, gt) == {"score": 0.0, "acc": 0.0}
        no_answer = ref.rsplit(" Answer:", 1)[0]  # correct steps, final number present, no "Answer:"
        assert compute_score(DATA_SOURCE, no_answer, gt)["score"] == 0.0
    assert compute_score(DATA_SOURCE, "Answer: 3. Answer: 4", "4")["score"] == 1.0  # only the last counts
    assert compute_score(DATA_SOURCE, "Answer: 4. Answer: 3", "4")["score"] == 0.0
    assert compute_score(DATA_SOURCE, "Answer: 40", "4")["score"] == 0.0
    assert compute_score(DATA_SOURCE, "Answer: 4.5", "4")["score"] == 0.0
    assert compute_score(DATA_SOURCE, "Answer: -3", "-3")["score"] == 1.0


@pytest.mark.parametrize("garbage", ["", "Answer:", "Answer: x 5", "\x00\ufffd Answer:: 5", "9" * 5000, "Answer: " + "9" * 5000,
                                     None, 12])
def test_reward_never_raises_on_garbage(garbage):
    assert compute_score(DATA_SOURCE, garbage, "5")["score"] == 0.0
    assert compute_score(DATA_SOURCE, "Answer: 5", "not a number")["score"] == 0.0


def test_default_reference_solutions_take_32_to_64_tokens(tmp_path):
    """Measured with the tokenizer verl loads from the model folder (it splits numbers into digits)."""
    from transformers import AutoTokenizer

    from qurl_recipes.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    train, val = make_splits()
    lengths = [len(tok(r["extra_info"]["reference"], add_special_tokens=False)["input_ids"]) for r in train + val]
    assert 32 <= min(lengths) and max(lengths) + 1 <= 64  # +1: the end-of-turn token the policy also emits
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in train + val]
    assert max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts) <= 64  # the demo's prompt limit


def test_sft_pairs_match_the_rl_format():
    pairs = sft_pairs(seed=1234)
    for _ in range(20):
        q, sol = next(pairs)
        assert compute_score(DATA_SOURCE, sol, str(_check_solution(q, sol)))["score"] == 1.0


def test_parquet_loads_in_verl_rl_dataset(tmp_path):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from qurl_recipes.tiny_model import build_tiny_model

    main(["--out", str(tmp_path), "--n-train", "8", "--n-val", "4", "--seed", "3"])
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    assert len(pd.read_parquet(train)) == 8 and len(pd.read_parquet(val)) == 4
    again, _ = write_parquet(tmp_path / "again", n_train=8, n_val=4, seed=3)
    assert pd.read_parquet(again).equals(pd.read_parquet(train))
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 64, "filter_overlong_prompts": False,
                            "return_raw_chat": True, "truncation": "error"})
    ds = RLHFDataset(data_files=[str(train)], tokenizer=tok, config=cfg)
    item = ds[0]
    first = pd.read_parquet(train).iloc[0]
    assert item["data_source"] == DATA_SOURCE
    assert item["reward_model"]["ground_truth"] == first["reward_model"]["ground_truth"]
    assert compute_score(item["data_source"], first["extra_info"]["reference"], item["reward_model"]["ground_truth"])["score"] == 1.0


def test_cli_refuses_bad_operation_counts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--min-ops", "6", "--max-ops", "5"])
    assert "--min-ops" in capsys.readouterr().err
    assert not (tmp_path / "train.parquet").exists()
