"""Carry the rollout-sync metrics to verl's logger through whatever policy loss the run uses.

Targets: verl 0.9.1 (``verl/workers/utils/losses.py::ppo_loss``, which looks the loss up with
``get_policy_loss_fn(loss_mode)`` at every call and logs the metrics it returns under ``actor/``).

Why: verl has no channel for a rollout backend to log per-step numbers. The ``qurl_vllm`` adapter
measures each weight sync (quantize/load seconds, bytes, the share of 8-bit codes that changed) in
the trainer worker process, the same process that computes the loss (colocated hybrid engine).
The adapter publishes them here; the wrapped lookup adds them to the metrics of the loss it
returns, any loss (verl's ``vanilla`` included), so presets choose a loss for its maths only.
Values are constant within a step, so verl's averaging over micro-batches leaves them unchanged.

When: installed by the ``qurl_vllm`` adapter in its own process; never in a run that does not
use that rollout. With nothing published, a loss's metrics pass through unchanged. With a
standalone (non-colocated) rollout the adapter lives elsewhere and nothing is added.
"""
from __future__ import annotations

import functools
import threading

from qurl_verl.patches.contract import Patch, wrap_once

_MARK = "_qurl_adds_sync_metrics"
_lock = threading.Lock()
_current: dict[str, float] = {}


def publish(metrics: dict[str, float], *, replace_prefix: str | None = None) -> None:
    """Record ``metrics`` (name -> float); with ``replace_prefix``, first drop older keys under it."""
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


def with_sync_metrics(loss_fn):
    """``loss_fn`` with the published metrics added to the metrics dict it returns."""

    @functools.wraps(loss_fn)
    def loss_with_sync_metrics(*args, **kwargs):
        loss, metrics = loss_fn(*args, **kwargs)
        published = current()
        return loss, ({**metrics, **published} if published else metrics)

    return loss_with_sync_metrics


def losses_with_sync_metrics_for(original):
    @functools.wraps(original)
    def get_policy_loss_fn(name):
        return with_sync_metrics(original(name))

    return get_policy_loss_fn


def _wrap_lookup() -> str:
    import verl.workers.utils.losses as verl_losses

    return wrap_once(verl_losses, "get_policy_loss_fn", losses_with_sync_metrics_for, _MARK)


PATCH = Patch(
    module=__name__,
    target="verl.workers.utils.losses:get_policy_loss_fn",
    package="verl",
    versions=("0.9.1",),
    when="in the process of the qurl_vllm rollout adapter only",
    change=_wrap_lookup,
)


def apply() -> str:
    """Wrap the lookup ``ppo_loss`` uses; "" if already wrapped."""
    return PATCH.apply()
