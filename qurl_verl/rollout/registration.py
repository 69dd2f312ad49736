"""Registers the `qurl_vllm` backend with verl when imported (by the plugin); no vLLM import here.

``actor_rollout_ref.rollout.name=qurl_vllm`` then resolves, in the trainer, to
``QurlvLLMReplica`` (engine servers) and, in each trainer worker, to ``QurlServerAdapter``
(weight sync client). Both classes are imported only when verl looks the name up.
"""
from __future__ import annotations

from verl.workers.rollout.base import _ROLLOUT_REGISTRY
from verl.workers.rollout.replica import RolloutReplicaRegistry

from qurl_verl.settings import ROLLOUT_NAME

ADAPTER = "qurl_verl.rollout.adapter.QurlServerAdapter"


def load_replica():
    from qurl_verl.rollout.server import QurlvLLMReplica

    return QurlvLLMReplica


RolloutReplicaRegistry.register(ROLLOUT_NAME, load_replica)
_ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER
