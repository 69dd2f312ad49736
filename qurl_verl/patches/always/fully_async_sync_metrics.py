"""Log what the checkpoint engine returns at each sync of verl's fully_async trainer, as its other trainers do.

Targets: verl 0.9.1, ``FullyAsyncTrainer._fit_update_weights``
(``verl/experimental/fully_async_policy/fully_async_trainer.py:690-790``), a method of the class that
``@ray.remote`` wraps (Ray 2.60 copies it, behind its tracing wrapper, into the subclass the actor runs: both
are wrapped, and the copy calls the original, so a sync is logged once).

Why: a checkpoint engine reports each sync through the return value of ``CheckpointEngineManager.update_weights``;
verl's separate_async and one_step_off trainers merge it into the step's metrics
(``trainer_separate_async.py`` ``on_step_end``, ``separation/ray_trainer.py`` ``_fit_update_weights``), but
fully_async awaits it and drops it (``fully_async_trainer.py:734``). The ``qurl_int8`` engine's report (what was
sent, and what the rollout loaded at the previous sync) would never reach the logger. The wrapper keeps the
value and logs it as a row of its own at the parameter version the sync installed, the step at which verl logs
that sync's timings (``fully_async_trainer.py:783``).

When: in every process that imports verl; only for a trainer whose config uses qurl-verl
(``settings.uses_qurl``), and only when the engine returned something. Any other run calls verl's method as is.
"""
from __future__ import annotations

import functools

from qurl_verl.patches.contract import Patch, wrap_once
from qurl_verl.patches.on_import import patch_now_or_on_import
from qurl_verl.settings import uses_qurl

TARGET_MODULE = "verl.experimental.fully_async_policy.fully_async_trainer"
_MARK = "_qurl_logs_sync_metrics"


def remote_class(actor):
    """The class ``@ray.remote`` made ``actor`` from, or ``actor`` itself."""
    metadata = getattr(actor, "__ray_metadata__", None)
    return metadata.modified_class.__ray_actor_class__ if metadata is not None else actor


def classes_to_wrap(actor, name: str) -> list:
    """Where the actor's method ``name`` is looked up: the class it was made from and, where Ray copied the
    method into the subclass it ships to the actor's process (its tracing wrapper, which calls the original
    function it captured at decoration), that subclass too."""
    metadata = getattr(actor, "__ray_metadata__", None)
    if metadata is None:
        return [actor]
    modified = metadata.modified_class
    return [modified.__ray_actor_class__] + ([modified] if name in vars(modified) else [])


def logging_sync_metrics(original):
    """``wrapper_for`` of ``wrap_once``: ``_fit_update_weights`` that logs what each ``update_weights`` returned."""
    @functools.wraps(original)
    async def _fit_update_weights(self, *args, **kwargs):
        manager = getattr(self, "checkpoint_manager", None)
        if manager is None or not uses_qurl(self.config):
            return await original(self, *args, **kwargs)
        returned: list[dict] = []
        update_weights = manager.update_weights

        async def update_weights_kept(*a, **kw):
            result = await update_weights(*a, **kw)  # verl's auto_await hands an async caller the coroutine
            returned.append(result)
            return result

        own = "update_weights" in vars(manager)
        manager.update_weights = update_weights_kept
        try:
            result = await original(self, *args, **kwargs)
        finally:
            if own:
                manager.update_weights = update_weights
            else:
                del manager.update_weights
        metrics = {name: value for sync in returned if sync for name, value in sync.items()}
        if metrics:
            self.logger.log(data=metrics, step=self.current_param_version)
        return result

    return _fit_update_weights


def patch_trainer(module) -> str:
    did = [wrap_once(cls, "_fit_update_weights", logging_sync_metrics, _MARK)
           for cls in classes_to_wrap(module.FullyAsyncTrainer, "_fit_update_weights")]
    return ", ".join(d for d in did if d)


PATCH = Patch(
    module=__name__,
    target=f"{TARGET_MODULE}:FullyAsyncTrainer._fit_update_weights",
    package="verl",
    versions=("0.9.1",),
    when="in every process that imports verl; logs only for a config that uses qurl-verl",
    change=lambda: patch_now_or_on_import(TARGET_MODULE, patch_trainer),
)


def apply() -> str:
    return PATCH.apply()
