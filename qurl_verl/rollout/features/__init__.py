"""The weight sync as features: one module for each thing a sync carries or does beyond the W8A8 codes.

The codes themselves are the sync's core (``weight_stream``: quantize the targeted linears, copy the
rest; ``worker_extension.WeightSync``: vLLM's layerwise reload around it). Everything else is a
``SyncFeature``, which owns in its one module:

=====================  ==========================================================================
process                what the feature provides (all optional; the base class does nothing)
=====================  ==========================================================================
driver                 ``checks``: rows of the driver's table (``settings.errors.Check``)
rollout server         ``engine_kwargs``: what it adds to the engine's arguments, checked on the server's host
trainer (adapter)      ``trainer_setup``; ``trainer_tensors``: what it appends to the stream;
                       ``trainer_report``: how a step's syncs are reported
vLLM worker            ``prepare`` (model intact), ``take`` (a streamed tensor it consumes),
                       ``stream_name``/``loader_name`` (names on the way in and into the loader),
                       ``after_finalize``, ``summarize`` (its stats), ``own_sync`` (a sync it runs itself)
stats                  ``stats``: a dataclass of ``sync_stats.stat`` fields, each with its merge rule
=====================  ==========================================================================

A feature is built once per process that uses it, from the run's ``RolloutSettings``, and keeps
what it needs across syncs. ``WeightSync`` and ``QurlServerAdapter`` walk the enabled features in
registration order. A new feature is one module that calls ``register``: a module of this package is
imported with it; one elsewhere (a test's) wherever it must run.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from qurl_verl.settings import RolloutSettings
from qurl_verl.settings.errors import Check

_REGISTERED: list[type[SyncFeature]] = []


class SyncFeature:
    """What one feature adds to a weight sync (module docstring); every hook does nothing by default."""

    name: ClassVar[str]
    stats: ClassVar[type | None] = None  # dataclass of its stats fields (``sync_stats.stat``)
    checks: ClassVar[tuple[Check, ...]] = ()

    def stream_setting(self) -> tuple[str, str] | None:
        """(the setting, what it sends) when this run's trainer appends tensors to every sync (``trainer_tensors``),
        else None: a sync that carries something else (a feature's ``own_sync``) cannot serve such a setting."""
        return None

    def __init__(self, settings: RolloutSettings):
        self.settings = settings

    @classmethod
    def enabled(cls, settings: RolloutSettings) -> bool:
        return True

    # -------------------------------------------------------------- rollout server
    def engine_kwargs(self, engine_kwargs: dict, hf_config: Any, model_path: str) -> None:
        """Add to (or check) the engine's arguments, on the server's host, before the engine starts."""

    # -------------------------------------------------------------- trainer side
    def trainer_setup(self) -> None:
        """Once, when the trainer's adapter is built (in the actor's process)."""

    def trainer_tensors(self) -> Iterable[tuple[str, Any]]:
        """Tensors appended to this sync's stream, after the trainer's weights."""
        return ()

    def trainer_report(self, stats: dict | None, sync_kwargs: dict) -> tuple[dict | None, bool]:
        """(stats to report, whether to report now): a feature may hold a sync back to report it with the next."""
        return stats, True

    # -------------------------------------------------------------- vLLM worker
    def own_sync(self, worker: Any, **rpc_kwargs) -> Any | None:
        """Run this sync itself instead of the reload (returns its ``SyncStats``), or None."""
        return None

    def prepare(self, sync: Any) -> None:
        """Before the reload starts, while the model is intact."""

    def take(self, name: str, tensor: Any) -> bool:
        """Whether this streamed tensor is the feature's (then it does not reach the loader)."""
        return False

    def stream_name(self, name: str) -> str:
        """The name the stream quantizes and tracks a tensor under."""
        return name

    def loader_name(self, name: str) -> str:
        """The name the model's loader takes for a stream name."""
        return name

    def after_finalize(self, sync: Any) -> None:
        """After ``finalize_layerwise_reload`` and the per-reload CPU fixes."""

    def summarize(self, sync: Any) -> Any | None:
        """This sync's ``stats`` instance, or None."""
        return None


def register(feature: type[SyncFeature]) -> type[SyncFeature]:
    """Add a feature to every sync of this process (a class decorator); registering twice is a no-op."""
    if feature not in _REGISTERED:
        _REGISTERED.append(feature)
    return feature


def unregister(feature: type[SyncFeature]) -> None:
    """Take a feature out of this process's syncs (a test's, after it ran)."""
    if feature in _REGISTERED:
        _REGISTERED.remove(feature)


def registered() -> tuple[type[SyncFeature], ...]:
    return tuple(_REGISTERED)


def build(settings: RolloutSettings) -> list[SyncFeature]:
    """The enabled features of a run, built for this process, in registration order."""
    return [feature(settings) for feature in _REGISTERED if feature.enabled(settings)]


def driver_checks() -> tuple[Check, ...]:
    """Every registered feature's driver rows, in registration order."""
    return tuple(row for feature in _REGISTERED for row in feature.checks)


def stats_types() -> tuple[type, ...]:
    return tuple(f.stats for f in _REGISTERED if f.stats is not None)


def _import_builtin() -> None:
    """Every module of this package is a feature that registers itself (in name order: none depends on another)."""
    import importlib
    import pkgutil

    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{module}")


_import_builtin()
