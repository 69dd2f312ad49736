"""Every qurl-verl setting: where it lives in verl's config, its default, its check, one error class.

Each group is read from the config node verl hands to the process that needs it:

| group | config node | module | read in |
|---|---|---|---|
| rollout | ``actor_rollout_ref.rollout.{name, quantization, custom.qurl.*}`` | ``rollout`` | driver, vLLM server, adapter; the workers through vLLM's ``additional_config`` |
| loss | ``actor_rollout_ref.actor.policy_loss.{loss_mode, is_cap, acr_upper_cap}`` | ``loss`` (verl's class: ``loss_config``; what the losses need elsewhere: ``loss_requirements``) | driver, actor workers |
| UAQ | ``qurl.uaq.*`` (mirrored by the presets into ``actor_rollout_ref.rollout.custom.qurl_uaq``) | ``uaq`` | driver (the checkpoint is converted before Ray starts); the vLLM server reads the mirror to refuse a checkpoint without the UAQ record |

``keys`` spells every key and holds the one reader, ``errors`` the error class and requirement
tables. Imports only the pure-torch layer (for the defaults it owns) and the standard library, and
probes nothing: every other qurl-verl module may import this. ``loss_config`` alone imports verl (its
class subclasses verl's ``PolicyLossConfig``); this ``__init__`` never imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import QurlConfigError, Requirement, is_number, problems, raise_problems
from .keys import (
    ACTOR_STRATEGY_KEY,
    ATTN_IMPLEMENTATION_KEY,
    BUCKET_MB_KEY,
    CHECKPOINT_ENGINE_KEY,
    COLOCATED_SYNC_BACKENDS,
    CPU_PLATFORM,
    DRY_RUN_ENV,
    GPUS_PER_NODE_KEY,
    LAYERWISE_RELOAD_WORKER_ENV,
    LORA_MERGE_KEY,
    LORA_NESTED_RANK_KEY,
    LORA_RANK_KEY,
    LOSS_MODE_KEY,
    MODEL_PATH_KEY,
    NNODES_KEY,
    PLATFORM_ENV,
    POLICY_LOSS_KEY,
    PRESET_KEY,
    QUANTIZATION_KEY,
    ROLLOUT_CORRECTION_KEY,
    ROLLOUT_CUSTOM_KEY,
    ROLLOUT_DTYPE_KEY,
    ROLLOUT_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    ROLLOUT_PARALLEL_KEYS,
    TRAINER_DTYPE_KEY,
    UAQ_KEY,
    absent,
    cpu_platform_selected,
    dry_run,
    override_text,
    select,
    show,
    uses_qurl,
)
from .loss import DEFAULT_IS_CAP, LossMode, LossSettings
from .loss_requirements import (
    LOSS_CONFIG_TARGET,
    LOSS_REQUIRED,
    MIN_IS_THRESHOLD,
    SUGGESTED_IS_THRESHOLD,
    is_qurl_loss_config_target,
    loss_problems,
    untruncated_weights_problem,
)
from .rollout import (
    DEFAULT_CODE_CHANGE_MAX_MB,
    DEFAULT_CODE_CHANGE_ROW_STRIDE,
    DEFAULT_EXPERTS,
    DEFAULT_ROLLOUT_FORMAT,
    DEFAULT_WEIGHT_BITS,
    ROLLOUT_CUSTOM_KEYS,
    ExpertsPrecision,
    RolloutFormat,
    RolloutSettings,
)
from .uaq import UAQ_KEYS, UaqSettings

__all__ = [
    "ACTOR_STRATEGY_KEY", "ATTN_IMPLEMENTATION_KEY", "BUCKET_MB_KEY", "CHECKPOINT_ENGINE_KEY", "COLOCATED_SYNC_BACKENDS", "CPU_PLATFORM", "DEFAULT_CODE_CHANGE_MAX_MB",
    "DEFAULT_CODE_CHANGE_ROW_STRIDE", "DEFAULT_EXPERTS", "DEFAULT_IS_CAP", "DEFAULT_ROLLOUT_FORMAT",
    "DEFAULT_WEIGHT_BITS", "DRY_RUN_ENV", "GPUS_PER_NODE_KEY", "LORA_MERGE_KEY", "LORA_NESTED_RANK_KEY", "LORA_RANK_KEY", "NNODES_KEY", "ROLLOUT_PARALLEL_KEYS", "LAYERWISE_RELOAD_WORKER_ENV", "LOSS_CONFIG_TARGET", "LOSS_MODE_KEY",
    "LOSS_REQUIRED", "MIN_IS_THRESHOLD", "MODEL_PATH_KEY", "PLATFORM_ENV", "POLICY_LOSS_KEY", "PRESET_KEY",
    "QUANTIZATION_KEY", "ROLLOUT_CORRECTION_KEY", "ROLLOUT_CUSTOM_KEY", "ROLLOUT_CUSTOM_KEYS", "ROLLOUT_DTYPE_KEY", "ROLLOUT_KEY",
    "ROLLOUT_NAME", "ROLLOUT_NAME_KEY", "SUGGESTED_IS_THRESHOLD", "TRAINER_DTYPE_KEY", "UAQ_KEY", "UAQ_KEYS",
    "ExpertsPrecision", "LossMode", "LossSettings", "QurlConfigError", "QurlSettings", "Requirement",
    "RolloutFormat", "RolloutSettings", "UaqSettings", "cpu_platform_selected", "dry_run", "is_number",
    "is_qurl_loss_config_target", "lora_adapter_rank", "lora_rank", "loss_problems", "override_text", "absent", "problems", "raise_problems", "select", "show", "untruncated_weights_problem", "uses_qurl",
]


@dataclass(frozen=True)
class QurlSettings:
    """The three groups of a composed config, each checked on construction."""

    rollout: RolloutSettings | None = None  # None unless rollout.name=qurl_vllm
    loss: LossSettings | None = None  # None unless loss_mode is a qurl loss
    uaq: UaqSettings = field(default_factory=UaqSettings)
    uaq_skipped: str | None = None  # why ``qurl.uaq.enable=true`` does nothing in this run (LoRA adapters)

    @classmethod
    def from_config(cls, cfg: Any) -> QurlSettings:
        rollout = None
        if select(cfg, ROLLOUT_NAME_KEY) == ROLLOUT_NAME:
            rollout = RolloutSettings.from_rollout_config(select(cfg, ROLLOUT_KEY))
        loss = None
        if select(cfg, LOSS_MODE_KEY) in {m.value for m in LossMode}:
            raise_problems(f"{LOSS_MODE_KEY}={select(cfg, LOSS_MODE_KEY)} cannot run with this config:", loss_problems(cfg))
            loss = LossSettings.from_policy_loss_config(select(cfg, POLICY_LOSS_KEY))
        uaq, uaq_skipped = UaqSettings.from_config(cfg), None
        if uaq.enable and lora_adapter_rank(cfg):
            uaq, uaq_skipped = UaqSettings(enable=False), UAQ_SKIPPED_WITH_LORA_ADAPTERS
        return cls(rollout=rollout, loss=loss, uaq=uaq, uaq_skipped=uaq_skipped)


# UAQ rescales the frozen base, whose 8-bit codes never change in adapter mode; the adapters reach the
# rollout unquantized, so every update is visible without it. Rescaling would only change how the
# adapters on q/k/v train (their input grows by s).
UAQ_SKIPPED_WITH_LORA_ADAPTERS = (
    f"[qurl] UAQ skipped: with LoRA adapters ({LORA_RANK_KEY}>0, {LORA_MERGE_KEY}=false) the 8-bit base is "
    "quantized once and never changes, and the adapters reach the rollout in full precision, so there is no "
    f"update for UAQ to make visible; the checkpoint is used as is ({UAQ_KEY}.enable is ignored)"
)


def lora_rank(cfg: Any) -> int:
    """The actor's LoRA rank as verl reads it (``model.lora.rank`` when > 0, else ``model.lora_rank``); 0: no LoRA."""
    return int(select(cfg, LORA_NESTED_RANK_KEY, 0) or 0) or int(select(cfg, LORA_RANK_KEY, 0) or 0)


def lora_adapter_rank(cfg: Any) -> int:
    """The LoRA rank of a run whose adapters verl syncs apart from the base (0: no LoRA, or merged)."""
    return 0 if select(cfg, LORA_MERGE_KEY, False) else lora_rank(cfg)
