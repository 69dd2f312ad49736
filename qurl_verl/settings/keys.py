"""Where each qurl-verl setting lives in verl's config, the environment variables it reads, and the one
reader (``select``) every group uses, so a key is spelled once."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

PRESET_KEY = "qurl.preset"
UAQ_KEY = "qurl.uaq"
ROLLOUT_KEY = "actor_rollout_ref.rollout"
ROLLOUT_NAME_KEY = f"{ROLLOUT_KEY}.name"
QUANTIZATION_KEY = f"{ROLLOUT_KEY}.quantization"
ROLLOUT_DTYPE_KEY = f"{ROLLOUT_KEY}.dtype"  # the engine's activations and full-precision weights (bfloat16 by default)
ROLLOUT_CUSTOM_KEY = f"{ROLLOUT_KEY}.custom.qurl"
POLICY_LOSS_KEY = "actor_rollout_ref.actor.policy_loss"
LOSS_MODE_KEY = f"{POLICY_LOSS_KEY}.loss_mode"
MODEL_PATH_KEY = "actor_rollout_ref.model.path"
ROLLOUT_CORRECTION_KEY = "algorithm.rollout_correction"
# verl's sender packs each step's tensors into one buffer of this many MiB
# (verl/workers/rollout/vllm_rollout/vllm_rollout.py:235-240).
CHECKPOINT_ENGINE_KEY = f"{ROLLOUT_KEY}.checkpoint_engine.backend"
# the backends of the sync where the actor process itself streams to its colocated engine
# (ServerAdapter.update_weights); others stream from a separate checkpoint-engine process, which never
# sees the actor's forwards, and send the whole model at once
COLOCATED_SYNC_BACKENDS = (None, "naive")
# qurl_verl.checkpoint_engine: the 8-bit sync of the disaggregated modes (quantized on the trainer side)
INT8_SYNC_BACKEND = "qurl_int8"
CHECKPOINT_ENGINE_NODE = f"{ROLLOUT_KEY}.checkpoint_engine"
BUCKET_MB_KEY = f"{ROLLOUT_KEY}.checkpoint_engine.update_weights_bucket_megabytes"
TRAINER_DTYPE_KEY = "actor_rollout_ref.actor.fsdp_config.model_dtype"  # fp32 by default (engine/fsdp.yaml)
ACTOR_STRATEGY_KEY = "actor_rollout_ref.actor.strategy"
ATTN_IMPLEMENTATION_KEY = "actor_rollout_ref.model.override_config.attn_implementation"
# the rollout engine's parallel sizes (verl's rollout.yaml); their product is one replica's ranks
ROLLOUT_PARALLEL_KEYS = tuple(f"{ROLLOUT_KEY}.{k}_parallel_size" for k in ("tensor_model", "data", "pipeline_model"))
# verl's FSDP LoRA: adapters of this rank (0 = off); merge=True syncs W + BA instead of the adapters
LORA_RANK_KEY = "actor_rollout_ref.model.lora_rank"
LORA_NESTED_RANK_KEY = "actor_rollout_ref.model.lora.rank"  # verl reads it first when > 0
LORA_MERGE_KEY = "actor_rollout_ref.model.lora.merge"
NNODES_KEY = "trainer.nnodes"
GPUS_PER_NODE_KEY = "trainer.n_gpus_per_node"
# verl 0.9.1's main_ppo runs the v1 trainer when this is truthy, else the legacy main_ppo_v0 (deprecated)
USE_V1_KEY = "trainer.use_v1"
TRAINER_MODE_KEY = "trainer.v1.trainer_mode"  # sync, colocate_async, separate_async
SEPARATE_ASYNC_MODE = "separate_async"
# the rollout's own pool: separate_async places its standalone replicas on this many nodes
ROLLOUT_NNODES_KEY = f"{ROLLOUT_KEY}.nnodes"
# the one-step-off and fully-async entry points' rollout pool (their mains copy it into ROLLOUT_NNODES_KEY);
# the fully-async config alone has ASYNC_TRAINING_NODE
STANDALONE_ROLLOUT_NNODES_KEY = "rollout.nnodes"
ASYNC_TRAINING_NODE = "async_training"
RAY_INIT_ADDRESS_KEY = "ray_kwargs.ray_init.address"  # a Ray cluster to join (ray.init's address)
# the UAQ the rollout's checkpoint must carry, as the presets hand it to the rollout servers (which see only the
# rollout's config): interpolated from qurl.uaq, rewritten by the driver when it decides otherwise
ROLLOUT_UAQ_KEY = f"{ROLLOUT_KEY}.custom.qurl_uaq"

ROLLOUT_NAME = "qurl_vllm"
DRY_RUN_ENV = "QURL_DRY_RUN"
PLATFORM_ENV = "VERL_PLATFORM"
CPU_PLATFORM = "cpu"
# Set by the qurl_vllm server before it launches its engine, inherited by the vLLM workers: they
# re-pack weights through the layerwise reload, so the stock-rollout CPU patch stays off there.
LAYERWISE_RELOAD_WORKER_ENV = "QURL_VLLM_LAYERWISE_RELOAD"


def select(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b.c`` for a DictConfig, a dict or a dataclass tree; ``default`` where any part is missing."""
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping) or (hasattr(node, "get") and not hasattr(node, "__dataclass_fields__")):
            try:
                node = node.get(part)
            except Exception:  # noqa: BLE001 - an interpolation or missing value reads as absent
                return default
        else:
            node = getattr(node, part, None)
    return default if node is None else node


def absent(cfg: Any, key: str) -> bool:
    """Whether ``key`` is missing from a Hydra config, so that an override must add it (``+key=value``)."""
    from omegaconf import DictConfig, OmegaConf

    marker = object()
    return isinstance(cfg, DictConfig) and OmegaConf.select(cfg, key, default=marker) is marker


def override_text(cfg: Any, key: str, value: Any) -> str:
    """The override that sets ``key`` to ``value`` on this config: with '+' where verl's schema lacks the key."""
    return f"{'+' if absent(cfg, key) else ''}{key}={show(value)}"


def show(value: Any) -> str:
    """A value as it is written in a Hydra override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    return str(value)


def cpu_platform_selected() -> bool:
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == CPU_PLATFORM


def dry_run() -> bool:
    """``QURL_DRY_RUN=1``: check a config as the driver would, touch no checkpoint, download nothing."""
    return os.environ.get(DRY_RUN_ENV, "").strip() == "1"


def uses_qurl(cfg: Any) -> bool:
    """Whether a composed config asks for anything of qurl-verl; the plugin leaves every other run alone.

    A ``qurl`` preset (or node), a ``qurl_*`` policy loss, the ``qurl_vllm`` rollout, the ``qurl_int8``
    checkpoint engine, or the CPU
    platform this package provides (``VERL_PLATFORM=cpu``).
    """
    loss_mode = select(cfg, LOSS_MODE_KEY)
    return (
        select(cfg, "qurl") is not None
        or (isinstance(loss_mode, str) and loss_mode.startswith("qurl_"))
        or select(cfg, ROLLOUT_NAME_KEY) == ROLLOUT_NAME
        or select(cfg, CHECKPOINT_ENGINE_KEY) == INT8_SYNC_BACKEND
        or cpu_platform_selected()
    )
