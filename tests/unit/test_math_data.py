"""The recipes' math data: shipped jsonl -> verl parquet with each recipe's template and data sources."""
from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from qurl_recipes.data import math_datasets as md

SHIPPED_ROWS = {  # data/README.md
    "deepscaler/train_sample.jsonl": 1975, "deepscaler/aime2024.jsonl": 30, "deepscaler/amc.jsonl": 83,
    "deepscaler/math500.jsonl": 500, "deepscaler/minerva.jsonl": 272, "deepscaler/olympiad_bench.jsonl": 675,
    "dapo/dapo_math_sample.jsonl": 2000,
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return {recipe: md.write_recipe_data(recipe, root / recipe) for recipe in md.RECIPES}


@pytest.fixture(scope="module")
def tokenizer():
    from qurl_recipes.tiny_model import TinyModelSpec, build_tokenizer

    return build_tokenizer(TinyModelSpec())  # the embedded model's tokenizer, without building the model


def test_every_shipped_file_is_read_in_full():
    for part in {p.benchmark for spec in md.RECIPES.values() for p in spec.parts}:
        assert len(md.read_shipped(part)) == SHIPPED_ROWS[part.shipped], part.shipped


def test_parquet_rows_follow_each_recipe(written):
    ds = pd.read_parquet(written["deepscaler"]["val"])
    assert ds.data_source.value_counts().to_dict() == {
        "deepscaler_olympiad_bench": 675, "deepscaler_math500": 500, "deepscaler_minerva": 272,
        "deepscaler_amc": 83, "deepscaler_aime2024": 30}
    train = pd.read_parquet(written["deepscaler"]["train"])
    assert len(train) == 1975 and set(train.data_source) == {"deepscaler_train"}
    for content in list(train.prompt.map(lambda p: p[0]["content"])) + list(ds.prompt.map(lambda p: p[0]["content"])):
        assert content.endswith(" Let's think step by step and output the final answer within \\boxed{}.")

    dapo_train, dapo_val = (pd.read_parquet(written["dapo"][s]) for s in ("train", "val"))
    assert set(dapo_train.data_source) == {"math_dapo"} and len(dapo_train) == 2000
    assert set(dapo_val.data_source) == {"aime2024"} and len(dapo_val) == 30
    for prompt in list(dapo_train.prompt) + list(dapo_val.prompt):
        assert len(prompt) == 1 and prompt[0]["role"] == "user"
        assert prompt[0]["content"].startswith("Solve the following math problem step by step. The last line")
        assert prompt[0]["content"].endswith('\n\nRemember to put your answer on its own line after "Answer:".')

    aime = ds[ds.data_source == "deepscaler_aime2024"]
    raw = [r["answer"] for r in md.read_shipped(md.AIME2024)]
    assert "025" in raw and "25" in set(aime.reward_model.map(lambda r: r["ground_truth"]))  # zero padding removed
    assert list(aime.extra_info.map(lambda e: e["answer_raw"])) == raw
    assert list(dapo_val.reward_model.map(lambda r: r["ground_truth"])) == list(aime.reward_model.map(lambda r: r["ground_truth"]))
    olympiad = ds[ds.data_source == "deepscaler_olympiad_bench"].reward_model.map(lambda r: r["ground_truth"])
    assert not any(re.fullmatch(r"\$[^$]*\$", gt) for gt in olympiad)  # single $...$ delimiters dropped
    minerva = ds[ds.data_source == "deepscaler_minerva"].extra_info
    assert sum(len(e["answers"]) > 1 for e in minerva) == 40  # of the 75 rows listing 2-3 forms, 40 differ once stripped
    assert all(e["answers"][0] == gt for e, gt in zip(ds.extra_info, ds.reward_model.map(lambda r: r["ground_truth"])))


@pytest.mark.parametrize("recipe", sorted(md.RECIPES))
def test_parquet_loads_in_verl_rl_dataset(recipe, written, tokenizer):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 100_000, "filter_overlong_prompts": False,
                            "return_raw_chat": True, "truncation": "error"})
    for path in written[recipe].values():
        frame = pd.read_parquet(path)
        ds = RLHFDataset(data_files=[str(path)], tokenizer=tokenizer, config=cfg)
        assert len(ds) == len(frame)
        firsts = frame.reset_index().groupby("data_source")["index"].first()  # first row of each benchmark
        for source, i in firsts.items():
            item = ds[int(i)]
            assert item["data_source"] == source
            assert item["reward_model"]["ground_truth"] == frame.iloc[i]["reward_model"]["ground_truth"]
            assert item["extra_info"]["index"] == frame.iloc[i]["extra_info"]["index"]
            assert item["raw_prompt"][0]["content"] == frame.iloc[i]["prompt"][0]["content"]


def test_data_sources_route_to_the_intended_scorers():
    from verl.utils.reward_score import default_compute_score

    from qurl_verl.recipe_rewards.boxed_math import compute_score

    # DAPO: verl's own dispatch, math_dapo, reading the "Answer:" line
    for source in ("math_dapo", "aime2024"):
        assert default_compute_score(source, "work\nAnswer: 25", "25")["acc"] is True
        assert default_compute_score(source, "work\nAnswer: 26", "25")["acc"] is False
    # DeepScaleR: verl has no scorer for these sources, the recipe's reward owns them
    with pytest.raises(NotImplementedError):
        default_compute_score("deepscaler_aime2024", "\\boxed{25}", "25")
    assert compute_score("deepscaler_aime2024", "</think> so \\boxed{25}", "25")["acc"] is True
    # anything else passes through to verl unchanged (plus the benchmark tag)
    passed = compute_score("math_dapo", "Answer: 7", "7")
    assert passed == {**default_compute_score("math_dapo", "Answer: 7", "7"), "benchmark": "math_dapo"}


def test_missing_data_file_is_named_with_the_fix(tmp_path, capsys):
    with pytest.raises(md.MissingDataError, match=r"deepscaler/train_sample.jsonl is missing.*--source hub"):
        md.write_recipe_data("deepscaler", tmp_path / "out", data_dir=tmp_path)
    assert md.main(["--recipe", "dapo", "--out", str(tmp_path / "out"), "--data-dir", str(tmp_path)]) == 2
    assert "dapo/dapo_math_sample.jsonl is missing" in capsys.readouterr().err
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_hub_source_maps_fields_and_undoes_the_dapo_copy(monkeypatch):
    """`--source hub` is not run here (no hub access); this checks its field mapping on stand-in rows."""
    import datasets

    templated = md.dapo_prompt("What is 2+2?")
    fake = {
        ("BytedTsinghua-SIA/DAPO-Math-17k", None): [
            {"prompt": [{"role": "user", "content": templated}], "reward_model": {"ground_truth": "4"}}] * 3,
        ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP"): [
            {"question": "Find x.", "final_answer": ["$\\frac{1}{2}$"], "solution": ["..."]}],
        ("AI-MO/aimo-validation-amc", None): [{"problem": "p", "answer": 142.0, "url": "u"}],
    }
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, split=None: fake[(name, config)])
    dapo = md.HUB_LOADERS["dapo_math_17k"]()
    assert dapo == [{"problem": "What is 2+2?", "answer": "4", "source": "dapo_math_17k"}]
    olympiad = md.to_verl_rows(md.HUB_LOADERS["olympiad_bench"](), md.RECIPES["deepscaler"], md.RECIPES["deepscaler"].val[-1], "test")
    assert olympiad[0]["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert olympiad[0]["data_source"] == "deepscaler_olympiad_bench"
    assert md.HUB_LOADERS["amc"]()[0]["answer"] == "142"


def test_canonical_answers():
    assert md.canonical_answer("025") == "25" and md.canonical_answer(" -007 ") == "-7"
    assert md.canonical_answer("$x^2$") == "x^2" and md.canonical_answer("$1$, $2$") == "$1$, $2$"
    assert md.canonical_answer("\\frac{2}{3}") == "\\frac{2}{3}"
    rec = {"answer": "9.6", "meta": {"answer_raw": ["9.6", " 9.60 ", "$9.6$"]}}
    assert md.accepted_answers(rec) == ["9.6", "9.60"]
    assert json.loads(json.dumps(md.accepted_answers({"answer": "3"}))) == ["3"]
