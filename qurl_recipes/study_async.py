"""Staleness x quantization (`make study-async`): the GRPO study's harness over rollout precision x
staleness x correction x learning rate, two seeds each, and the report.

verl's asynchronous trainers roll out with weights one or more updates older than the ones they train,
so the behaviour policy is stale as well as quantized. Each arm here is a ``grpo_study`` run with the
``staleness`` setting; its records carry the mismatch's parts as defined pairs (``StudyRun.mismatch_parts``).
Runs go to ``OUT/lr<lr>/staleness<k>/<variant>/seed<s>/``; an arm that finished with the same settings is
kept, an interrupted one resumes (``grpo_study.run``). Never imports verl or vLLM.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from qurl_recipes import grpo_study
from qurl_recipes.study_settings import VARIANTS, StudySettings, add_settings_arguments

# precision x correction: the rollout format and the loss that corrects for the mismatch (TIS, Eq. 5; ACR, Eq. 9)
GRID_VARIANTS = ("bf16_tis", "bf16_acr", "tis", "acr_no_uaq")
GRID_STALENESS = (0, 1)
# the study's rate, where the PPO ratio hardly moves, and one where a step of staleness is as large as W5A8's
# mismatch (the pilot in recipes/tiny_cpu/study_async/README.md)
GRID_LRS = (1e-5, 4e-5)
# staleness 2 where it matters most: the higher rate, W5A8, both corrections
GRID_ALSO = ((4e-5, 2, "tis"), (4e-5, 2, "acr_no_uaq"))


@dataclass(frozen=True)
class Arm:
    lr: float
    staleness: int
    variant: str

    def folder(self, out: str | Path) -> Path:
        return Path(out) / f"lr{self.lr:g}" / f"staleness{self.staleness}"

    def settings(self, base: StudySettings) -> StudySettings:
        return replace(base, lr=self.lr, staleness=self.staleness)


def grid(variants=GRID_VARIANTS, staleness=GRID_STALENESS, lrs=GRID_LRS, also=GRID_ALSO) -> list[Arm]:
    """The full product of ``variants`` x ``staleness`` x ``lrs``, plus the ``also`` arms (lr, k, variant), the
    highest learning rate first: there staleness matters, so a grid stopped early has those arms whole."""
    for v in {*variants, *(a[2] for a in also)}:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; expected one of {list(VARIANTS)}")
    arms = {Arm(lr, k, v) for lr in lrs for k in staleness for v in variants} | {Arm(*a) for a in also}
    return sorted(arms, key=lambda a: (-a.lr, a.staleness, a.variant))


def parse_arm(text: str) -> tuple[float, int, str]:
    """``lr:staleness:variant``, e.g. ``4e-5:2:tis``."""
    try:
        lr, k, variant = text.split(":")
        return float(lr), int(k), variant
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"an extra arm is lr:staleness:variant (e.g. 4e-5:2:tis), got {text!r}") from e


def run_arms(model_dir: str | Path, out: str | Path, seed: int, arms: list[Arm], base: StudySettings,
             checkpoint_every: int = 50) -> list[Path]:
    """Runs (or keeps, or resumes) every arm for one seed, in the grid's order."""
    done = []
    for i, arm in enumerate(arms, 1):
        print(f"[study-async] seed {seed}: arm {i}/{len(arms)}: lr {arm.lr:g}, staleness {arm.staleness}, "
              f"{arm.variant}", flush=True)
        done.append(grpo_study.run(model_dir, arm.variant, seed, arm.settings(base), arm.folder(out),
                                   checkpoint_every=checkpoint_every))
    return done


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Staleness x quantization grid of the pure-torch GRPO study, one seed "
                                             "per process.")
    ap.add_argument("--model", required=True, help="warm-started HF folder (python -m qurl_recipes.tiny_sft)")
    ap.add_argument("--out", required=True, help="runs go to OUT/lr<lr>/staleness<k>/<variant>/seed<s>/")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--variants", nargs="+", default=list(GRID_VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--staleness-grid", nargs="+", type=int, default=list(GRID_STALENESS))
    ap.add_argument("--lrs", nargs="+", type=float, default=list(GRID_LRS))
    ap.add_argument("--also", nargs="*", type=parse_arm, default=list(GRID_ALSO),
                    help="extra arms lr:staleness:variant beside the product (none: --also with no value)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("QURL_STUDY_THREADS", 1)))
    ap.add_argument("--checkpoint-every", type=int, default=50)
    add_settings_arguments(ap, leave=("lr", "staleness"))  # those two are set per arm
    a = vars(ap.parse_args(argv))
    arms = grid(a.pop("variants"), a.pop("staleness_grid"), a.pop("lrs"), a.pop("also"))
    model, out, seed = a.pop("model"), a.pop("out"), a.pop("seed")
    torch.set_num_threads(a.pop("threads"))
    checkpoint_every = a.pop("checkpoint_every")
    base = StudySettings(**a)
    print(f"[study-async] seed {seed}: {len(arms)} arms of {base.steps} steps; settings {asdict(base)}", flush=True)
    run_arms(model, out, seed, arms, base, checkpoint_every)


if __name__ == "__main__":
    main()
