"""Whether a math recipe's reward scorer agrees with the shipped reference answers
(``python -m qurl_recipes.data.math_datasets --recipe <r> --check-reward``): the reference written as the
final answer must score correct, a perturbed one wrong, and a MATH-style worked solution correct."""
from __future__ import annotations

import re
from pathlib import Path

from qurl_recipes.data.math_datasets import (
    _INTEGER,
    dapo_prompt,
    deepscaler_prompt,
    read_shipped,
    recipe_spec,
    reward_function,
    to_verl_rows,
)

_MATH_DELIMITER = re.compile(r"(?<!\\)\$")
THOUGHT = "<think>\nLet me work through it.\n</think>\n"  # DeepScaleR's reward reads only what follows </think>


def answer_response(recipe: str, answer: str) -> str:
    """A response that ends the way the recipe's prompt asks, with `answer` as the final answer.

    Inside \\boxed{} the answer is written as a model writes it: without `$` math delimiters
    (OlympiadBench lists several answers as `$a$,$b$`).
    """
    if recipe_spec(recipe).prompt is dapo_prompt:
        return f"Let me work through it.\nAnswer: {answer}"
    return f"{THOUGHT}The final answer is $\\boxed{{{_MATH_DELIMITER.sub('', answer)}}}$."


def perturbed_answer(answer: str) -> str:
    """A wrong answer: an integer plus one, a decimal doubled plus one, any other expression with `+1` appended."""
    if _INTEGER.fullmatch(answer):
        return str(int(answer) + 1)
    try:
        return repr(float(answer) * 2 + 1)
    except ValueError:
        return f"{answer}+1"


def _score_is_correct(result) -> bool:
    if isinstance(result, dict):
        return bool(result.get("acc", result["score"] > 0))
    return float(result) > 0


def reward_agreement(recipe: str, limit: int | None = None, data_dir: str | Path | None = None) -> dict[str, dict]:
    """How often the recipe's scorer agrees with the shipped answers, per benchmark.

    For each row: the reference answer written as the final answer must score correct; a
    perturbed answer must score wrong; where the origin's worked solution ends in a \\boxed{}
    answer (MATH-style solutions), that solution as the response (after a closed thought) should score correct too (its
    boxed form may legitimately differ from the reference, e.g. rounding in Minerva).
    """
    spec = recipe_spec(recipe)
    score = reward_function(recipe)
    report = {}
    for part in spec.parts:
        records = read_shipped(part.benchmark, data_dir)[:limit]
        rows = to_verl_rows(records, spec, part, "check")
        stats = {"rows": len(rows), "answer_correct": 0, "perturbed_wrong": 0, "solutions": 0, "solution_correct": 0,
                 "answer_misses": [], "perturbed_hits": [], "solution_misses": []}
        for rec, row in zip(records, rows):
            gt, info = row["reward_model"]["ground_truth"], row["extra_info"]
            ok = _score_is_correct(score(part.data_source, answer_response(recipe, gt), gt, info))
            stats["answer_correct"] += ok
            if not ok:
                stats["answer_misses"].append(gt)
            wrong = perturbed_answer(gt)
            bad = _score_is_correct(score(part.data_source, answer_response(recipe, wrong), gt, info))
            stats["perturbed_wrong"] += not bad
            if bad:
                stats["perturbed_hits"].append((wrong, gt))
            solution = rec.get("solution")
            if spec.prompt is deepscaler_prompt and solution and "\\boxed" in solution:
                stats["solutions"] += 1
                result = score(part.data_source, THOUGHT + solution, gt, info)
                stats["solution_correct"] += _score_is_correct(result)
                if not _score_is_correct(result):
                    stats["solution_misses"].append((result.get("pred") if isinstance(result, dict) else None, gt))
        report[f"{part.data_source} ({part.benchmark.shipped})"] = stats
    return report


def agreement_table(report: dict[str, dict]) -> str:
    lines = ["| data source (file) | rows | reference answer scored correct | perturbed answer scored wrong | boxed solution scored correct |",
             "|---|---:|---:|---:|---:|"]
    for name, s in report.items():
        sol = f"{s['solution_correct']}/{s['solutions']}" if s["solutions"] else "–"
        lines.append(f"| {name} | {s['rows']} | {s['answer_correct']}/{s['rows']} | {s['perturbed_wrong']}/{s['rows']} | {sol} |")
    return "\n".join(lines)
