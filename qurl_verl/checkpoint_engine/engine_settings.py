"""What the trainer side of ``qurl_int8`` quantizes with: the rollout's settings, carried in
``checkpoint_engine.engine_kwargs.qurl_int8`` (verl hands an engine nothing else of the config)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from qurl_verl.settings import RolloutSettings
from qurl_verl.settings.keys import INT8_SYNC_BACKEND

ENGINE_NAME = INT8_SYNC_BACKEND
# where the engine registers itself (verl imports it by this name); spelled from the package so that the
# settings do not name the engine module they are imported by
ENGINE_MODULE = f"{__name__.rpartition('.')[0]}.int8_engine"
SETTINGS_KWARGS = ("quantization", "ignore", "weight_bits", "experts")
TRANSPORT_KWARGS = ("rest_dtype", "tie_word_embeddings", "device", "timeout_s", "multi_sender")
DELTA_KWARGS = ("delta", "full_sync_every")


def rollout_settings(quantization: str = "int8", ignore: Iterable[str] | str = (), weight_bits: int = 8,
                     experts: str = "bf16") -> RolloutSettings:
    """The trainer side's settings from ``engine_kwargs.qurl_int8`` (the driver checks they match the rollout's)."""
    ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore or ())
    return RolloutSettings(format=quantization, ignore=ignore, weight_bits=weight_bits, experts=experts)


def engine_kwargs_for(rollout: RolloutSettings) -> dict[str, Any]:
    """The ``engine_kwargs.qurl_int8`` entry that makes the engine quantize as ``rollout`` does."""
    return {"quantization": rollout.format.value, "ignore": list(rollout.ignore),
            "weight_bits": rollout.weight_bits, "experts": rollout.experts.value}


def settings_of(engine_kwargs: Mapping | None) -> RolloutSettings:
    kwargs = dict((engine_kwargs or {}).items())
    return rollout_settings(**{k: kwargs[k] for k in SETTINGS_KWARGS if k in kwargs})


def delta_settings_error(delta: Any, full_sync_every: Any) -> str | None:
    """What is wrong with the delta mode's ``engine_kwargs`` (None: nothing), for the engine and the driver:
    ``delta`` (send only what changed since the last sync; default false) and ``full_sync_every`` (a full sync
    every K syncs; 0, the default, only when one is forced)."""
    if not isinstance(delta, bool):
        return f"delta={delta!r}: must be true or false"
    if isinstance(full_sync_every, bool) or not isinstance(full_sync_every, int) or full_sync_every < 0:
        return f"full_sync_every={full_sync_every!r}: must be an integer >= 0 (0: full only when forced)"
    if full_sync_every and not delta:
        return f"full_sync_every={full_sync_every} without delta=true: every sync is full already"
    return None
