"""Exact reward for the multi-step arithmetic task: the number after the last "Answer:".

No shaping and no credit for correct intermediate steps, so the score is the verifiable outcome
alone and any change in it under quantized rollout is a change in task success. Only the last
"Answer:" counts, so a response cannot hedge by listing several answers; the number must follow it
directly (a decimal such as "32.5" is not read as 32).
"""
from __future__ import annotations

import re

_ANSWER = re.compile(r"Answer:")
_NUMBER_AFTER = re.compile(r"\s*(-?\d+)(?!\d|\.\d)")


def final_answer(text) -> int | None:
    """The integer right after the last "Answer:", or None when there is none."""
    if not isinstance(text, str):
        return None
    marks = list(_ANSWER.finditer(text))
    if not marks:
        return None
    m = _NUMBER_AFTER.match(text, marks[-1].end())
    if not m or len(m.group(1)) > 100:  # int() refuses thousands of digits; no answer here is that long
        return None
    return int(m.group(1))


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl custom reward signature; `score` is 1.0 for the correct final answer, else 0.0."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        return {"score": 0.0, "acc": 0.0}
    answer = final_answer(solution_str)
    correct = float(answer is not None and answer == expected)
    return {"score": correct, "acc": correct}
