"""Math RL data for the DeepScaleR and DAPO recipes, written in verl's RL parquet format.

Reads the evaluation sets and training samples shipped in the repository's `data/` folder (see
`data/README.md` for origins and licenses), or, with `--source hub`, the full datasets through
`datasets.load_dataset`. Each recipe applies its own prompt template and picks data sources that
route to the right scorer:

* deepscaler: `deepscaler_<benchmark>`, graded by `qurl_verl.recipe_rewards.boxed_math` (the last
  \\boxed{} answer, verl's PRM800K grader); one data source per benchmark, so verl reports
  validation accuracy per benchmark.
* dapo: `math_dapo` for training and `aime2024` for validation, both dispatched by verl's
  `default_compute_score` to `math_dapo` (the "Answer: ..." line the DAPO template asks for).

    python -m qurl_recipes.data.math_datasets --recipe deepscaler --out outputs/data/deepscaler
    python -m qurl_recipes.data.math_datasets --recipe dapo --out DIR --source hub
    python -m qurl_recipes.data.math_datasets --recipe deepscaler --check-reward

Each run writes `train.parquet` and `val.parquet` (all validation benchmarks, told apart by
`data_source`); deepscaler also `val_aime2024.parquet`, its validation during training.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SHIPPED_DATA = Path(__file__).resolve().parents[2] / "data"

DEEPSCALER_INSTRUCTION = " Let's think step by step and output the final answer within \\boxed{}."
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def deepscaler_prompt(problem: str) -> str:
    return problem + DEEPSCALER_INSTRUCTION


def dapo_prompt(problem: str) -> str:
    return DAPO_PREFIX + problem + DAPO_SUFFIX


class MissingDataError(FileNotFoundError):
    """A shipped data file is not where the recipe expects it; the message says what to do."""


@dataclass(frozen=True)
class Benchmark:
    """One shipped jsonl file and the hub dataset it is a copy or sample of."""

    name: str
    shipped: str  # path under data/
    hub: str  # key of HUB_LOADERS


@dataclass(frozen=True)
class Part:
    benchmark: Benchmark
    data_source: str


@dataclass(frozen=True)
class RecipeData:
    name: str
    prompt: Callable[[str], str]
    train: Part
    val: tuple[Part, ...]
    reward_function: str | None  # verl's reward.custom_reward_function.path; None: verl's default dispatch
    val_subsets: tuple[tuple[str, str], ...] = ()  # (file stem, data source): a benchmark of val.parquet alone

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.train, *self.val)


DEEPSCALER_TRAIN = Benchmark("train", "deepscaler/train_sample.jsonl", "deepscaler_train")
AIME2024 = Benchmark("aime2024", "deepscaler/aime2024.jsonl", "aime2024")
AMC = Benchmark("amc", "deepscaler/amc.jsonl", "amc")
MATH500 = Benchmark("math500", "deepscaler/math500.jsonl", "math500")
MINERVA = Benchmark("minerva", "deepscaler/minerva.jsonl", "minerva")
OLYMPIAD_BENCH = Benchmark("olympiad_bench", "deepscaler/olympiad_bench.jsonl", "olympiad_bench")
DAPO_TRAIN = Benchmark("train", "dapo/dapo_math_sample.jsonl", "dapo_math_17k")

RECIPES: dict[str, RecipeData] = {
    "deepscaler": RecipeData(
        name="deepscaler",
        prompt=deepscaler_prompt,
        train=Part(DEEPSCALER_TRAIN, "deepscaler_train"),
        val=tuple(Part(b, f"deepscaler_{b.name}") for b in (AIME2024, AMC, MATH500, MINERVA, OLYMPIAD_BENCH)),
        reward_function="pkg://qurl_verl.recipe_rewards.boxed_math",
        val_subsets=(("val_aime2024", "deepscaler_aime2024"),),  # validation during training, as DeepScaleR's
    ),
    "dapo": RecipeData(
        name="dapo",
        prompt=dapo_prompt,
        train=Part(DAPO_TRAIN, "math_dapo"),
        val=(Part(AIME2024, "aime2024"),),
        reward_function=None,
    ),
}


# ---------------------------------------------------------------- reading records

def read_shipped(benchmark: Benchmark, data_dir: str | Path | None = None) -> list[dict]:
    """Records of a shipped jsonl file (schema in data/README.md: problem, answer, source, solution?, meta?)."""
    root = Path(data_dir) if data_dir is not None else SHIPPED_DATA
    path = root / benchmark.shipped
    if not path.is_file():
        raise MissingDataError(
            f"{path} is missing. The DeepScaleR and DAPO recipes read the data shipped in the qurl-verl "
            "repository's data/ folder (see data/README.md); pass --data-dir <folder holding deepscaler/ "
            "and dapo/>, or --source hub to take the full datasets from the Hugging Face hub."
        )
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class HubDataError(RuntimeError):
    """The full dataset could not be read from the Hugging Face hub (offline, no cache); the message says what to do."""


def _hub_rows(dataset_id: str, split: str, config: str | None = None):
    import datasets

    try:
        return datasets.load_dataset(dataset_id, config, split=split)
    except Exception as e:  # noqa: BLE001 - connection errors, offline mode, a missing cache: all the same fix
        raise HubDataError(
            f"cannot read {dataset_id} ({split}) from the Hugging Face hub: {type(e).__name__}: {e}. The GPU recipes "
            "train on the full sets by default (DATA=hub). Download it where this machine can (`huggingface-cli download "
            f"--repo-type dataset {dataset_id}`, then HF_HUB_OFFLINE=1 reads the cache), or run on the repository's "
            "shipped sample with DATA=shipped (a start and a check, not the paper's setting)."
        ) from e


def _hub_deepscaler_train() -> list[dict]:
    return [{"problem": r["problem"], "answer": str(r["answer"]), "source": "deepscaler_train", "solution": r.get("solution")}
            for r in _hub_rows("agentica-org/DeepScaleR-Preview-Dataset", "train")]


def _hub_aime2024() -> list[dict]:
    return [{"problem": r["problem"], "answer": str(r["answer"]), "source": "aime2024"}
            for r in _hub_rows("HuggingFaceH4/aime_2024", "train")]


def _hub_amc() -> list[dict]:
    return [{"problem": r["problem"], "answer": _integral(r["answer"]), "source": "amc_2022_2023"}
            for r in _hub_rows("AI-MO/aimo-validation-amc", "train")]


def _hub_math500() -> list[dict]:
    return [{"problem": r["problem"], "answer": r["answer"], "source": "math500", "solution": r["solution"]}
            for r in _hub_rows("HuggingFaceH4/MATH-500", "test")]


def _hub_minerva() -> list[dict]:
    return [{"problem": r["question"], "answer": str(r["answer"]).strip(), "source": "minerva_math"}
            for r in _hub_rows("math-ai/minervamath", "test")]


def _hub_olympiad_bench() -> list[dict]:
    return [{"problem": r["question"], "answer": str(r["final_answer"][0]).strip(), "source": "olympiadbench",
             "meta": {"answer_raw": list(r["final_answer"])}}
            for r in _hub_rows("Hothan/OlympiadBench", "train", config="OE_TO_maths_en_COMP")]


def _hub_dapo_math_17k() -> list[dict]:
    """The hub copy repeats every prompt about 100 times and wraps it in the DAPO template: undo both."""
    seen, records = set(), []
    for r in _hub_rows("BytedTsinghua-SIA/DAPO-Math-17k", "train"):
        content = r["prompt"][0]["content"]
        if content in seen:
            continue
        seen.add(content)
        problem = content.removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX)
        records.append({"problem": problem, "answer": str(r["reward_model"]["ground_truth"]), "source": "dapo_math_17k"})
    return records


# Full datasets behind each shipped file (ids documented in data/README.md; not reachable offline).
HUB_LOADERS: dict[str, Callable[[], list[dict]]] = {
    "deepscaler_train": _hub_deepscaler_train,
    "aime2024": _hub_aime2024,
    "amc": _hub_amc,
    "math500": _hub_math500,
    "minerva": _hub_minerva,
    "olympiad_bench": _hub_olympiad_bench,
    "dapo_math_17k": _hub_dapo_math_17k,
}


def _integral(value) -> str:
    v = float(value)
    return str(int(v)) if v.is_integer() else str(value)


# ---------------------------------------------------------------- conversion

_INTEGER = re.compile(r"[+-]?\d+")
_DOLLARS = re.compile(r"\$(.*)\$", re.S)


def canonical_answer(answer: str) -> str:
    """The reference answer as a model would box it: no `$...$` delimiters, no zero padding ("025" -> "25").

    verl's `math_dapo` compares normalised strings, so a zero-padded AIME answer would never match.
    """
    a = str(answer).strip()
    m = _DOLLARS.fullmatch(a)
    if m and "$" not in m.group(1):
        a = m.group(1).strip()
    if _INTEGER.fullmatch(a):
        a = str(int(a))
    return a


def accepted_answers(record: dict) -> list[str]:
    """Every accepted form of the answer: the canonical one first, then the origin's alternatives (Minerva)."""
    answers = [canonical_answer(record["answer"])]
    raw = (record.get("meta") or {}).get("answer_raw")
    if isinstance(raw, list):
        answers += [c for c in (canonical_answer(a) for a in raw) if c and c not in answers]
    return answers


def to_verl_rows(records: list[dict], recipe: RecipeData, part: Part, split: str) -> list[dict]:
    """verl RL rows: chat prompt, data_source, reward_model.ground_truth, extra_info."""
    rows = []
    for i, rec in enumerate(records):
        answers = accepted_answers(rec)
        rows.append({
            "data_source": part.data_source,
            "prompt": [{"role": "user", "content": recipe.prompt(rec["problem"])}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answers[0]},
            "extra_info": {
                "split": split,
                "index": i,
                "benchmark": part.benchmark.name,
                "answer_raw": str(rec["answer"]),
                "answers": answers,
            },
        })
    return rows


def load_records(part: Part, source: str = "shipped", data_dir: str | Path | None = None) -> list[dict]:
    if source == "shipped":
        return read_shipped(part.benchmark, data_dir)
    if source == "hub":
        return HUB_LOADERS[part.benchmark.hub]()
    raise ValueError(f"source must be 'shipped' or 'hub', got {source!r}")


def build_rows(recipe: str, source: str = "shipped", data_dir: str | Path | None = None) -> dict[str, list[dict]]:
    """{"train": rows, "val": rows, <subset>: rows of one benchmark of val} for one recipe."""
    spec = recipe_spec(recipe)
    train = to_verl_rows(load_records(spec.train, source, data_dir), spec, spec.train, "train")
    val = [row for part in spec.val for row in to_verl_rows(load_records(part, source, data_dir), spec, part, "test")]
    subsets = {stem: [row for row in val if row["data_source"] == data_source] for stem, data_source in spec.val_subsets}
    return {"train": train, "val": val, **subsets}


def write_recipe_data(recipe: str, out_dir: str | Path, source: str = "shipped",
                      data_dir: str | Path | None = None) -> dict[str, Path]:
    """Write `train.parquet` and `val.parquet` for a recipe; returns their paths."""
    import pandas as pd

    rows = build_rows(recipe, source, data_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, split_rows in rows.items():
        path = out / f"{split}.parquet"
        tmp = path.with_suffix(".parquet.partial")
        pd.DataFrame(split_rows).to_parquet(tmp, index=False)
        tmp.replace(path)  # a run that stops half-way leaves no file a later run would trust
        paths[split] = path
    return paths


def recipe_spec(recipe: str) -> RecipeData:
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[recipe]


# ---------------------------------------------------------------- reward agreement

def reward_function(recipe: str) -> Callable:
    """The scorer verl's reward loop calls for this recipe, loaded the way verl loads it."""
    spec = recipe_spec(recipe)
    if spec.reward_function is None:
        from verl.utils.reward_score import default_compute_score

        return default_compute_score
    from verl.utils.import_utils import load_extern_object

    return load_extern_object(module_path=spec.reward_function, object_name="compute_score")


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a math recipe's train/val parquet files in verl's format.")
    ap.add_argument("--recipe", required=True, choices=sorted(RECIPES))
    ap.add_argument("--out", help="folder for train.parquet and val.parquet")
    ap.add_argument("--source", choices=["shipped", "hub"], default="shipped",
                    help="shipped: the repository's data/ files (default); hub: the full datasets via datasets.load_dataset")
    ap.add_argument("--data-dir", help="folder holding deepscaler/ and dapo/ (default: the repository's data/)")
    ap.add_argument("--check-reward", action="store_true",
                    help="score the shipped reference answers (and perturbed ones) with the recipe's reward; print a table")
    ap.add_argument("--limit", type=int, help="--check-reward: rows per file")
    a = ap.parse_args(argv)
    try:
        if a.check_reward:
            from qurl_recipes.data.reward_agreement import agreement_table, reward_agreement

            report = reward_agreement(a.recipe, a.limit, a.data_dir)
            print(agreement_table(report))
            for name, s in report.items():
                for key in ("answer_misses", "perturbed_hits", "solution_misses"):
                    if s[key]:
                        print(f"{name} {key} ({len(s[key])}): {s[key][:12]}")
            return 0
        if not a.out:
            ap.error("--out is required unless --check-reward is given")
        paths = write_recipe_data(a.recipe, a.out, a.source, a.data_dir)
    except (MissingDataError, HubDataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths.values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
