"""Every qurl-verl setting: where it lives in verl's config, its default, its check, one error class.

Each group is read from the config node verl hands to the process that needs it:

| group | config node | module | read in |
|---|---|---|---|
| rollout | ``actor_rollout_ref.rollout.{name, quantization, custom.qurl.*}`` | ``rollout`` | driver, vLLM server, adapter |
| loss | ``actor_rollout_ref.actor.policy_loss.{loss_mode, is_cap, acr_upper_cap}`` | ``loss`` | driver, actor workers |
| UAQ | ``qurl.uaq.*`` | ``uaq`` | driver only (the checkpoint is converted before Ray starts) |

``keys`` spells every key and holds the one reader, ``errors`` the error class and requirement
tables. Imports only the pure-torch layer (for the defaults it owns) and the standard library, and
probes nothing: every other qurl-verl module may import this.
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
    CPU_PLATFORM,
    DRY_RUN_ENV,
    ENGINE_KV_CACHE_DTYPE_KEY,
    GPUS_PER_NODE_KEY,
    LAYERWISE_RELOAD_WORKER_ENV,
    LORA_MERGE_KEY,
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
    ROLLOUT_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    ROLLOUT_PARALLEL_KEYS,
    TRAINER_DTYPE_KEY,
    UAQ_KEY,
    cpu_platform_selected,
    dry_run,
    select,
    show,
    uses_qurl,
)
from .loss import (
    DEFAULT_IS_CAP,
    LOSS_CONFIG_TARGET,
    LOSS_REQUIRED,
    MIN_IS_THRESHOLD,
    SUGGESTED_IS_THRESHOLD,
    LossMode,
    LossSettings,
    is_qurl_loss_config_target,
    loss_problems,
)
from .rollout import (
    DEFAULT_CODE_CHANGE_MAX_MB,
    DEFAULT_CODE_CHANGE_ROW_STRIDE,
    DEFAULT_EXPERTS,
    DEFAULT_KV_CACHE,
    DEFAULT_ROLLOUT_FORMAT,
    DEFAULT_WEIGHT_BITS,
    ROLLOUT_CUSTOM_KEYS,
    ExpertsPrecision,
    KVCacheFormat,
    RolloutFormat,
    RolloutSettings,
)
from .uaq import UAQ_KEYS, UaqSettings

__all__ = [
    "ACTOR_STRATEGY_KEY", "ATTN_IMPLEMENTATION_KEY", "BUCKET_MB_KEY", "CHECKPOINT_ENGINE_KEY", "CPU_PLATFORM", "DEFAULT_CODE_CHANGE_MAX_MB",
    "DEFAULT_CODE_CHANGE_ROW_STRIDE", "DEFAULT_EXPERTS", "DEFAULT_KV_CACHE", "DEFAULT_IS_CAP", "DEFAULT_ROLLOUT_FORMAT",
    "DEFAULT_WEIGHT_BITS", "DRY_RUN_ENV", "ENGINE_KV_CACHE_DTYPE_KEY", "GPUS_PER_NODE_KEY", "LORA_MERGE_KEY", "LORA_RANK_KEY", "NNODES_KEY", "ROLLOUT_PARALLEL_KEYS", "LAYERWISE_RELOAD_WORKER_ENV", "LOSS_CONFIG_TARGET", "LOSS_MODE_KEY",
    "LOSS_REQUIRED", "MIN_IS_THRESHOLD", "MODEL_PATH_KEY", "PLATFORM_ENV", "POLICY_LOSS_KEY", "PRESET_KEY",
    "QUANTIZATION_KEY", "ROLLOUT_CORRECTION_KEY", "ROLLOUT_CUSTOM_KEY", "ROLLOUT_CUSTOM_KEYS", "ROLLOUT_KEY",
    "ROLLOUT_NAME", "ROLLOUT_NAME_KEY", "SUGGESTED_IS_THRESHOLD", "TRAINER_DTYPE_KEY", "UAQ_KEY", "UAQ_KEYS",
    "ExpertsPrecision", "KVCacheFormat", "LossMode", "LossSettings", "QurlConfigError", "QurlSettings", "Requirement",
    "RolloutFormat", "RolloutSettings", "UaqSettings", "cpu_platform_selected", "dry_run", "is_number",
    "is_qurl_loss_config_target", "loss_problems", "problems", "raise_problems", "select", "show", "uses_qurl",
]


@dataclass(frozen=True)
class QurlSettings:
    """The three groups of a composed config, each checked on construction."""

    rollout: RolloutSettings | None = None  # None unless rollout.name=qurl_vllm
    loss: LossSettings | None = None  # None unless loss_mode is a qurl loss
    uaq: UaqSettings = field(default_factory=UaqSettings)

    @classmethod
    def from_config(cls, cfg: Any) -> QurlSettings:
        rollout = None
        if select(cfg, ROLLOUT_NAME_KEY) == ROLLOUT_NAME:
            rollout = RolloutSettings.from_rollout_config(select(cfg, ROLLOUT_KEY))
        loss = None
        if select(cfg, LOSS_MODE_KEY) in {m.value for m in LossMode}:
            raise_problems(f"{LOSS_MODE_KEY}={select(cfg, LOSS_MODE_KEY)} cannot run with this config:", loss_problems(cfg))
            loss = LossSettings.from_policy_loss_config(select(cfg, POLICY_LOSS_KEY))
        return cls(rollout=rollout, loss=loss, uaq=UaqSettings.from_config(cfg))
