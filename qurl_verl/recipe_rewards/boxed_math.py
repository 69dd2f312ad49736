"""Reward for the DeepScaleR recipe: the response's last \\boxed{} answer, graded as DeepScaleR grades it.

DeepScaleR scores a response by the last \\boxed{} answer, accepted when it matches any reference
answer under the PRM800K checks (MATH normalisation, then sympy equivalence). verl ships that
grader as `prime_math.grade_answer`, but its default dispatch only reaches it for `numina_*`
data sources and through an extractor that also takes "the answer is ..." phrases; the \\boxed
scorers it does dispatch compare strings (`math_reward`) or the boxed text verbatim
(`math_dapo`). This module only extracts the boxed answer (verl's `last_boxed_only_string`) and
calls verl's grader; it grades nothing itself.

The thought delimiter is handled as DeepScaleR's reward handles it: only the text after `</think>`
is read (up to a second `</think>`, as DeepScaleR splits on it), and a response without `</think>`
scores 0 whatever it boxes. A response cut off at the length limit is therefore never rewarded for
an answer written while thinking, which is what the 8k stage relies on to shorten the thought. The
opening `<think>` is not required: the chat template of R1-distilled models puts it in the prompt.

Data sources written by `qurl_recipes.data.math_datasets` for this recipe start with `deepscaler_`
(one per benchmark, so verl reports validation accuracy per benchmark). Any other data source is
passed to verl's `default_compute_score` unchanged.

Use with `reward.custom_reward_function.path=pkg://qurl_verl.recipe_rewards.boxed_math`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DATA_SOURCE_PREFIX = "deepscaler_"
THINK_END = "</think>"


def final_part(response: str) -> str | None:
    """What DeepScaleR grades: the text after the first `</think>` (up to a second one); None without one."""
    if THINK_END not in response:
        return None
    return response.split(THINK_END)[1]


def boxed_answer(response: str) -> str | None:
    """Content of the last \\boxed{...} in the response (None when there is none)."""
    from verl.utils.reward_score.math_dapo import last_boxed_only_string

    boxed = last_boxed_only_string(response)
    return None if boxed is None else boxed[len("\\boxed{") : -1]


def reference_answers(ground_truth: Any, extra_info: Any = None) -> list[str]:
    """The ground truth plus any other accepted forms listed in `extra_info["answers"]`."""
    answers = [str(ground_truth)]
    extra = extra_info.get("answers") if isinstance(extra_info, Mapping) else None
    if extra is not None and not isinstance(extra, str):  # a list, or a numpy array after parquet
        answers += [str(a) for a in extra if str(a) not in answers]
    return answers


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl custom reward signature: 1.0 for a correct boxed answer after `</think>`, else 0.0."""
    if not str(data_source).startswith(DATA_SOURCE_PREFIX):
        from verl.utils.reward_score import default_compute_score

        result = default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
        result = dict(result) if isinstance(result, dict) else {"score": float(result), "acc": float(result) > 0}
        result["benchmark"] = str(data_source)
        return result

    from verl.utils.reward_score.prime_math import grade_answer

    final = final_part(str(solution_str))
    pred = None if final is None else boxed_answer(final)
    correct = pred is not None and any(grade_answer(pred, ref) for ref in reference_answers(ground_truth, extra_info))
    # `benchmark` is a string, so verl leaves it out of the metrics but writes it into the
    # validation dump, where qurl_recipes.evaluation groups samples by it.
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": pred or "", "benchmark": str(data_source)}
