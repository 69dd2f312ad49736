"""The recipes' rewards on the shipped data, scored through the functions verl's reward loop calls.

The full-file agreement numbers (`python -m qurl_recipes.data.math_datasets --recipe <r> --check-reward`)
are in recipes/README.md; here the first rows of every file are checked.
"""
from __future__ import annotations

import pytest

from qurl_recipes.data import math_datasets as md
from qurl_recipes.data import reward_agreement
from qurl_verl.recipe_rewards.boxed_math import boxed_answer, compute_score

ROWS = 6


@pytest.fixture(scope="module")
def deepscaler_report():
    return reward_agreement.reward_agreement("deepscaler", limit=ROWS)


def test_recipe_rewards_are_loaded_as_verl_loads_them():
    from verl.utils.reward_score import default_compute_score

    assert md.reward_function("deepscaler") is compute_score  # via verl's load_extern_object("pkg://...")
    assert md.reward_function("dapo") is default_compute_score


def test_deepscaler_reward_agrees_with_each_eval_set(deepscaler_report):
    assert len(deepscaler_report) == 6
    for name, s in deepscaler_report.items():
        assert s["rows"] == ROWS, name
        assert s["answer_correct"] == ROWS, (name, s["answer_misses"])
        assert s["perturbed_wrong"] == ROWS, (name, s["perturbed_hits"])
    # worked solutions ending in \boxed{}: the reference form and the solution's form agree, except
    # where Minerva's solution writes a rounded or differently written number (2 of its first 6)
    solutions = {name.split(" ")[0]: (s["solution_correct"], s["solutions"]) for name, s in deepscaler_report.items()}
    assert solutions == {"deepscaler_train": (6, 6), "deepscaler_aime2024": (4, 4), "deepscaler_amc": (0, 0),
                         "deepscaler_math500": (6, 6), "deepscaler_minerva": (4, 6), "deepscaler_olympiad_bench": (0, 0)}
    minerva = next(s for name, s in deepscaler_report.items() if name.startswith("deepscaler_minerva"))
    assert minerva["solution_misses"] == [("8.7e8", "8.7 \\times 10^{8}"), ("7e37", "7 \\times 10^{37}")]


def test_dapo_reward_agrees_with_its_files():
    report = reward_agreement.reward_agreement("dapo", limit=50)
    assert [name.split(" ")[0] for name in report] == ["math_dapo", "aime2024"]
    for name, s in report.items():
        assert (s["answer_correct"], s["perturbed_wrong"]) == (s["rows"], s["rows"]), (name, s)


def test_boxed_reward_grades_equivalent_forms():
    assert boxed_answer("a \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert boxed_answer("no box") is None
    ok = lambda response, gt, info=None: compute_score("deepscaler_math500", "</think>" + response, gt, info)["acc"]  # noqa: E731
    assert ok("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}")
    assert ok("\\boxed{0.5}", "\\frac{1}{2}")  # a float against an exact fraction
    assert ok("\\boxed{\\frac{1}{2}}", "0.5")  # an exact fraction against a float
    assert ok("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)")
    assert not ok("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}")  # PRM800K rule: unreduced fractions are wrong
    assert not ok("\\boxed{0.51}", "\\frac{1}{2}")
    assert not ok("The answer is 1/2.", "\\frac{1}{2}")  # the recipe asks for \boxed{}
    # Minerva's alternative accepted forms come through extra_info["answers"] (numpy array after parquet)
    import numpy as np

    info = {"answers": np.array(["4.5e33", "4.5 \\times 10^{33}"], dtype=object)}
    assert ok("\\boxed{4.5 \\times 10^{33}}", "4.5e33", info)
    result = compute_score("deepscaler_minerva", "</think>\\boxed{7}", "8")
    assert result == {"score": 0.0, "acc": False, "pred": "7", "benchmark": "deepscaler_minerva"}


def test_boxed_reward_reads_only_the_answer_after_the_thought():
    """DeepScaleR's rule: the answer after `</think>` only; no `</think>` (a truncated thought) scores 0."""
    score = lambda response, gt="25": compute_score("deepscaler_aime2024", response, gt)  # noqa: E731
    assert score("<think>\nwork\n</think>\nSo \\boxed{25}.")["score"] == 1.0
    assert score("work, no opening tag\n</think>\n\\boxed{25}")["score"] == 1.0  # the template opens the thought
    truncated = score("<think>\nI think it is \\boxed{25}, let me check once more and")
    assert truncated == {"score": 0.0, "acc": False, "pred": "", "benchmark": "deepscaler_aime2024"}
    assert score("\\boxed{25}")["score"] == 0.0  # no thought delimiter at all
    assert score("<think>\\boxed{25}</think>\nThe answer is 25.")["score"] == 0.0  # boxed only inside the thought
    assert score("<think>\\boxed{24}</think>\n\\boxed{25}")["score"] == 1.0  # the thought's box is not read
    assert score("<think>a</think>\\boxed{25}</think>\\boxed{24}")["score"] == 1.0  # as DeepScaleR: up to a second </think>
    assert score("</think>\\boxed{0.5}", "\\frac{1}{2}")["score"] == 1.0
    # other data sources go to verl's own scorers unchanged: no </think> rule there
    assert compute_score("math_dapo", "Answer: 7", "7")["acc"] is True
