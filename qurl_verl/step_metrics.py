"""Per-step numbers produced beside the loss, carried to verl's logger through the loss's metrics.

verl's trainer logs what the policy loss returns, and the loss runs in the same worker process
as the rollout adapter that performs the weight sync (colocated/hybrid engine). The adapter
publishes the last sync's costs and the quantized-code change rate here; the qurl losses add
them to their metrics. Values are constant within a step, so verl's averaging over micro-batches
leaves them unchanged. Pure Python: no verl or vLLM import.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_current: dict[str, float] = {}


def publish(metrics: dict[str, float], *, replace_prefix: str | None = None) -> None:
    """Record `metrics` (name -> float); with `replace_prefix`, first drop older keys under it."""
    with _lock:
        if replace_prefix is not None:
            for k in [k for k in _current if k.startswith(replace_prefix)]:
                del _current[k]
        _current.update({k: float(v) for k, v in metrics.items()})


def current() -> dict[str, float]:
    with _lock:
        return dict(_current)


def clear() -> None:
    with _lock:
        _current.clear()
