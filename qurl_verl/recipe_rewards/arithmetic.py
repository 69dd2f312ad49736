"""Reward for the synthetic arithmetic task of the embedded CPU demo.

A freshly initialised tiny model never produces the right number, so an exact-answer reward alone
gives every GRPO group the same score and zero advantage. The reward is therefore shaped:
1.0 for the correct final number, otherwise half the share of the response's non-space
characters that are digits (a formatting signal the tiny model can learn within a few steps).
"""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def final_number(text: str) -> int | None:
    found = _NUMBER.findall(text)
    return int(found[-1]) if found else None


def digit_share(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl custom reward signature; returns verl's dict form with `score` and `acc`."""
    answer = final_number(solution_str)
    correct = answer is not None and answer == int(ground_truth)
    shaped = 1.0 if correct else 0.5 * digit_share(solution_str)
    return {"score": shaped, "acc": float(correct), "digit_share": digit_share(solution_str)}


def compute_exact_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """Unshaped verifiable reward: 1.0 for the correct final number, else 0.0 (for SFT-warmed models)."""
    answer = final_number(solution_str)
    correct = float(answer is not None and answer == int(ground_truth))
    return {"score": correct, "acc": correct}
