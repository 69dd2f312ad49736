"""Which of verl 0.9.1's trainers a config runs, read from the config as verl's entry points read it, and
whether its workers may run on a node other than the driver's.

* ``main_ppo`` runs the legacy trainer (``main_ppo_v0``, deprecated) when ``trainer.use_v1`` is falsy
  (``verl/trainer/main_ppo.py``: ``if config.trainer.use_v1``); the one-step-off and fully-async entry points
  never read it.
* The disaggregated modes give the rollout a pool of its own: ``trainer.v1.trainer_mode=separate_async``
  (standalone replicas on ``actor_rollout_ref.rollout.nnodes``, with or without hybrid ones), and the
  one-step-off and fully-async entry points, whose configs carry a top-level ``rollout`` pool
  (``verl/experimental/*/config/*.yaml``; their mains copy ``rollout.nnodes`` into the rollout's config
  before Ray starts).
* Ray is a cluster started outside the run when ``RAY_ADDRESS`` is set (``Host.outside_ray_cluster``) or
  ``ray_kwargs.ray_init.address`` names one (``local`` starts a new one-node cluster, as no address does).

The driver refuses the legacy trainer, requires shared UAQ storage where a worker may run off its node
(``uaq_checks``), and says once when a disaggregated quantized rollout syncs in full precision.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qurl_verl.platform.host import Host
from qurl_verl.settings import CHECKPOINT_ENGINE_KEY, NNODES_KEY, QurlConfigError, RolloutSettings, select, show
from qurl_verl.settings.keys import (
    ASYNC_TRAINING_NODE,
    INT8_SYNC_BACKEND,
    RAY_INIT_ADDRESS_KEY,
    ROLLOUT_NNODES_KEY,
    SEPARATE_ASYNC_MODE,
    STANDALONE_ROLLOUT_NNODES_KEY,
    TRAINER_MODE_KEY,
    USE_V1_KEY,
)

FULLY_ASYNC, ONE_STEP_OFF = "fully_async_policy", "one_step_off_policy"  # verl/experimental/<entry point>
# ray.init's address that starts a new cluster on this machine, as no address does
RAY_LOCAL_ADDRESS = "local"


def runs_legacy_trainer(cfg: Any) -> bool:
    """``main_ppo`` would run ``main_ppo_v0``: ``trainer.use_v1`` present and falsy (false, null, 0).

    Without the key verl's own read fails (its configs always carry it, true by default)."""
    trainer = select(cfg, "trainer")
    key = USE_V1_KEY.split(".", 1)[1]
    if trainer is None or key not in trainer:
        return False
    return not trainer.get(key)


def check_v1_trainer(cfg: Any) -> None:
    """Refuse the legacy trainer: qurl-verl is built and tested on verl's v1 trainer."""
    if runs_legacy_trainer(cfg):
        value = show(select(cfg, "trainer").get(USE_V1_KEY.split(".", 1)[1]))
        raise QurlConfigError(
            f"{USE_V1_KEY}={value}: verl 0.9.1's main_ppo would run its legacy trainer (main_ppo_v0, deprecated), "
            f"which qurl-verl does not support. Drop {USE_V1_KEY}={value} from the command line (verl's default "
            f"{USE_V1_KEY}=true runs the v1 trainer; {TRAINER_MODE_KEY}=sync is the same synchronous PPO)"
        )


@dataclass(frozen=True)
class RolloutPool:
    """The rollout's own pool in a disaggregated mode: the mode, the key that sizes it, its nodes."""

    mode: str
    nnodes_key: str
    nnodes: int


def rollout_pool(cfg: Any) -> RolloutPool | None:
    """The rollout's own pool, None where the rollout shares the trainer's GPUs (sync, colocate_async)."""
    if select(cfg, STANDALONE_ROLLOUT_NNODES_KEY) is not None:
        mode = FULLY_ASYNC if select(cfg, ASYNC_TRAINING_NODE) is not None else ONE_STEP_OFF
        return RolloutPool(mode, STANDALONE_ROLLOUT_NNODES_KEY, _count(select(cfg, STANDALONE_ROLLOUT_NNODES_KEY)))
    if select(cfg, TRAINER_MODE_KEY) == SEPARATE_ASYNC_MODE and not runs_legacy_trainer(cfg):
        return RolloutPool(f"{TRAINER_MODE_KEY}={SEPARATE_ASYNC_MODE}", ROLLOUT_NNODES_KEY,
                           _count(select(cfg, ROLLOUT_NNODES_KEY, 0)))
    return None


def _count(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def outside_ray_cluster(cfg: Any, host: Host) -> str | None:
    """How the run joins a Ray cluster started outside it (whose nodes may not be this one), None if it starts
    its own on this machine."""
    if host.outside_ray_cluster:
        return "RAY_ADDRESS is set (a Ray cluster started outside this run)"
    address = select(cfg, RAY_INIT_ADDRESS_KEY)
    if address not in (None, "", RAY_LOCAL_ADDRESS):
        return f"{RAY_INIT_ADDRESS_KEY}={show(address)} (a Ray cluster started outside this run)"
    return None


def off_this_node(cfg: Any, host: Host) -> str | None:
    """Why some of the run's workers may run on a node other than the driver's, None when all run here: more
    than one trainer node, a rollout pool of more than one node, or a Ray cluster started outside the run."""
    nnodes = _count(select(cfg, NNODES_KEY, 1))
    if nnodes > 1:
        return f"{NNODES_KEY}={nnodes}"
    pool = rollout_pool(cfg)
    if pool is not None and pool.nnodes > 1:
        return f"{pool.mode} with {pool.nnodes_key}={pool.nnodes} (the rollout's own pool)"
    return outside_ray_cluster(cfg, host)


def in_ray_actor() -> bool:
    """This process is a Ray actor (verl's TaskRunner), not the driver. Checks ``ray.is_initialized`` first:
    asking the runtime context of a process without Ray would start a local cluster."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def full_precision_sync_warning(cfg: Any, rollout: RolloutSettings | None) -> str | None:
    """What a quantized ``qurl_vllm`` rollout with its own pool loses with a full-precision checkpoint engine:
    the rollout side still quantizes and measures each sync, but verl 0.9.1 drops what its
    CheckpointEngineWorker returns, so those metrics never reach the trainer's logger; ``qurl_int8`` brings them
    back with what its sender returns (which the fully-async trainer drops, and
    ``patches/always/fully_async_sync_metrics`` logs for qurl runs). None where it does not apply (colocated
    modes, a bf16 rollout, the ``qurl_int8`` engine)."""
    pool = rollout_pool(cfg)
    backend = select(cfg, CHECKPOINT_ENGINE_KEY)
    if pool is None or rollout is None or not rollout.quantized or backend == INT8_SYNC_BACKEND:
        return None
    int8_sync = f"{CHECKPOINT_ENGINE_KEY}={INT8_SYNC_BACKEND}"
    instead = (f". {int8_sync} carries them to the trainer's logger, and sends 8-bit codes and scales instead of "
               f"full-precision weights")
    return (
        f"[qurl] {pool.mode} syncs its own rollout pool through {CHECKPOINT_ENGINE_KEY}={show(backend)} in full "
        f"precision: the qurl sync metrics (actor/qurl/sync/*) of those replicas stay on the rollout side, since "
        f"verl drops the results of its CheckpointEngineWorker{instead}"
    )
