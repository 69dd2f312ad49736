"""Lazy registration of the `qurl_vllm` backend with verl (no vLLM import here).

``actor_rollout_ref.rollout.name=qurl_vllm`` then resolves, in the trainer, to
``QurlvLLMReplica`` (engine servers) and, in each trainer worker, to ``QurlServerAdapter``
(weight sync client). Both imports happen only when verl looks the name up.
"""
from __future__ import annotations

NAME = "qurl_vllm"
ADAPTER = "qurl_verl.rollout.adapter.QurlServerAdapter"


def _load_replica():
    from qurl_verl.rollout.server import QurlvLLMReplica

    return QurlvLLMReplica


def register() -> None:
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(NAME, _load_replica)
    _ROLLOUT_REGISTRY[(NAME, "async")] = ADAPTER
