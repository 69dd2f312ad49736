"""Checkpoints of a GRPO study run: written atomically, resumed only by the run they belong to."""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qurl_recipes.study_settings import StudySettings, recorded_settings

if TYPE_CHECKING:  # the run imports this module
    from qurl_recipes.grpo_study import StudyRun

CHECKPOINT = "checkpoint.pt"


def _identity(variant: str, seed: int, settings: StudySettings) -> dict:
    return {"variant": variant, "seed": seed, "settings": asdict(settings)}


def save_checkpoint(path: Path, study: StudyRun, next_step: int, lines: int, wall_s: float,
                    resumed_at: list[int]) -> None:
    """Write to a temporary file, then rename: a kill mid-write leaves the previous checkpoint whole."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({**_identity(study.name, study.seed, study.settings), "next_step": next_step, "lines": lines,
                "wall_s": wall_s, "resumed_at": resumed_at, "state": study.state_dict()}, tmp)
    os.replace(tmp, path)


def resume(study: StudyRun, checkpoint: Path, partial: Path) -> tuple[int, float, list[int]]:
    """(next step, wall seconds spent, steps resumed at) after loading ``checkpoint`` if it belongs to
    this run, with ``partial`` cut back to the lines it covers; (0, 0.0, []) to start over."""
    label = f"[study] {study.name} seed {study.seed}"
    if not checkpoint.exists():
        return 0, 0.0, []
    saved = torch.load(checkpoint, weights_only=True)
    found = {"variant": saved.get("variant"), "seed": saved.get("seed"), "settings": recorded_settings(saved.get("settings") or {})}
    if found != _identity(study.name, study.seed, study.settings):
        print(f"{label}: checkpoint at step {saved.get('next_step')} has other settings; starting over", flush=True)
        return 0, 0.0, []
    lines = partial.read_text().splitlines(keepends=True) if partial.exists() else []
    if len(lines) < saved["lines"]:
        print(f"{label}: {partial.name} holds {len(lines)} of the checkpoint's {saved['lines']} lines; "
              f"starting over", flush=True)
        return 0, 0.0, []
    study.load_state_dict(saved["state"])
    kept = partial.with_name(partial.name + ".tmp")
    kept.write_text("".join(lines[:saved["lines"]]))  # drops the steps after the checkpoint
    os.replace(kept, partial)
    print(f"{label}: resuming from the checkpoint at step {saved['next_step']} ({checkpoint})", flush=True)
    return saved["next_step"], saved["wall_s"], [*saved["resumed_at"], saved["next_step"]]
