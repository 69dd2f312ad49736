"""The checkpoint a qurl run starts from: a local folder with config.json, a hub id, or a remote URL verl
copies to each node; checked before anything reads it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qurl_verl.model_info import hub_id, hub_id_cached
from qurl_verl.settings import MODEL_PATH_KEY, UAQ_KEY, QurlConfigError, UaqSettings, dry_run, select

MODEL_PATH_FIX = f"{MODEL_PATH_KEY}=<HF model folder>"


def check_model_path(cfg: Any, uaq: UaqSettings) -> None:
    """A qurl run's checkpoint: a local folder with config.json, a hub id, or a remote URL verl copies."""
    path = select(cfg, MODEL_PATH_KEY)
    if path is None:
        raise QurlConfigError(f"{MODEL_PATH_KEY} is not set: pass {MODEL_PATH_FIX}")
    text = str(path)
    if "://" in text:  # hdfs://, s3://: verl copies it to each node; UAQ cannot convert it in the driver
        if uaq.enable and not dry_run():
            raise QurlConfigError(
                f"{MODEL_PATH_KEY}={text}: UAQ converts the checkpoint in the driver and needs it on a file system; "
                f"copy it to a local or shared folder, or set {UAQ_KEY}.enable=false"
            )
        return
    p = Path(os.path.expanduser(text))
    if p.exists():
        if not (p / "config.json").exists():
            raise QurlConfigError(f"{MODEL_PATH_KEY}={text} has no config.json: point it at a Hugging Face model folder")
        return
    if hub_id(text) is None:
        raise QurlConfigError(f"{MODEL_PATH_KEY}={text} does not exist")
    if os.environ.get("HF_HUB_OFFLINE") == "1" and not dry_run() and not hub_id_cached(text):
        raise QurlConfigError(
            f"{MODEL_PATH_KEY}={text} is a hub id that is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 "
            "forbids downloading it: download it first or pass a local folder"
        )
