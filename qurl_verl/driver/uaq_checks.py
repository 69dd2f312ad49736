"""UAQ beside the run's layout: where workers may run off the driver's node the converted checkpoint must be
on shared storage, and a resumed run must carry the UAQ it was trained with (verl reloads its own checkpoint
over model.path)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qurl_verl.driver.trainer_modes import off_this_node
from qurl_verl.model_info import ModelInfo
from qurl_verl.platform.host import Host
from qurl_verl.settings import MODEL_PATH_KEY, UAQ_KEY, QurlConfigError, UaqSettings, select, show

SHARED_STORAGE_FIX = f"set {UAQ_KEY}.cache_dir=<shared folder>"


def check_uaq_storage(cfg: Any, uaq: UaqSettings, model: ModelInfo, host: Host) -> None:
    """UAQ whose workers may run on another node than the driver's needs shared storage, unless model.path
    already carries it: more than one trainer node, a disaggregated rollout pool of more than one node, or a
    Ray cluster started outside the run (``trainer_modes.off_this_node``). Everything on this one node (one
    trainer node, a rollout pool of one node, Ray started by the run) reads the driver's default cache."""
    if not uaq.enable or uaq.cache_dir or carries_uaq(model):
        return
    reason = off_this_node(cfg, host)
    if reason:
        from qurl_verl.uaq_checkpoint import DEFAULT_CACHE

        raise QurlConfigError(
            f"{reason} with UAQ: the driver writes the converted checkpoint (by default under {DEFAULT_CACHE}, on "
            f"its own node) and every worker reads it, so it must be on storage all nodes share; {SHARED_STORAGE_FIX} "
            f"(or convert once with `python -m qurl_verl.quant.uaq_convert` onto shared storage, point "
            f"{MODEL_PATH_KEY} at it)"
        )


def carries_uaq(model: ModelInfo) -> bool:
    """``model.path`` is a local checkpoint already converted (used as it is, nothing written)."""
    return model.is_local and model.uaq_record is not None


def check_resumed_uaq(cfg: Any, uaq: UaqSettings) -> None:
    """A resumed run's checkpoint and the configured UAQ must agree."""
    resumed = resumed_checkpoint_config(cfg)
    if resumed is None:
        return
    folder, record = resumed
    if record is None and uaq.enable:
        raise QurlConfigError(
            f"resuming from {folder}, which was trained without UAQ, with {UAQ_KEY}.enable=true: verl reloads those "
            f"weights over the converted checkpoint, so the run would silently lose UAQ; set {UAQ_KEY}.enable=false, "
            "or start in a new trainer.default_local_dir"
        )
    if record is not None and not uaq.enable:
        raise QurlConfigError(
            f"resuming from {folder}, trained with UAQ ({record}), with {UAQ_KEY}.enable=false: the weights stay "
            f"re-parametrised, and the config would describe another run; set {UAQ_KEY}.enable=true with "
            f"{UAQ_KEY}.scale={record.get('scale')} and {UAQ_KEY}.targets={show(list(record.get('targets') or []))}"
        )
    if record is not None and (abs(float(record.get("scale", 0)) - uaq.scale) > 1e-12
                               or sorted(record.get("targets") or []) != sorted(uaq.targets)):
        raise QurlConfigError(
            f"resuming from {folder}, trained with UAQ {record}, but {UAQ_KEY}.scale={uaq.scale:g} and "
            f"{UAQ_KEY}.targets={show(list(uaq.targets))}: set them to the checkpoint's values"
        )


def resumed_checkpoint_config(cfg: Any) -> tuple[Path, dict | None] | None:
    """(checkpoint folder, its UAQ record) of the verl checkpoint the trainer will resume from, if any.

    Follows verl 0.9.1's ``_load_checkpoint``: ``trainer.resume_mode`` auto reads
    ``latest_checkpointed_iteration.txt`` in ``trainer.default_local_dir``; ``resume_path`` takes
    ``trainer.resume_from_path``. The record is in the HF config verl saves beside the actor shards.
    """
    mode = select(cfg, "trainer.resume_mode", "auto")
    if mode == "auto":
        base = select(cfg, "trainer.default_local_dir")
        if not base:
            return None
        tracker = Path(os.path.abspath(os.path.expanduser(str(base)))) / "latest_checkpointed_iteration.txt"
        if not tracker.is_file():
            return None
        folder = tracker.parent / f"global_step_{int(tracker.read_text().strip())}"
    elif mode == "resume_path" and select(cfg, "trainer.resume_from_path"):
        folder = Path(os.path.abspath(os.path.expanduser(str(select(cfg, "trainer.resume_from_path")))))
    else:
        return None
    hf_folder = folder / "actor" / "huggingface"
    if not (hf_folder / "config.json").is_file():
        return None
    from qurl_verl.uaq_checkpoint import uaq_record_of

    return folder, uaq_record_of(hf_folder)
