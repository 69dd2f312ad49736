"""A sync feature that exists only for the tests: one file, registered on import, that adds a tensor to the
stream on the trainer's side, takes it out in the worker, and reports a stat with its own merge rule.

``ToyFeatureWorkerExtension`` is the production worker extension, loaded by its qualified name in each vLLM
worker, so that importing it there registers the feature in that process too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qurl_verl.rollout.features import SyncFeature, register
from qurl_verl.rollout.sync_stats import SUMMED, stat
from qurl_verl.rollout.worker_extension import QurlWorkerExtension

MARKER = "qurl_toy.marker"  # a name no model has: the sync would fail if it reached the loader


@dataclass
class ToyStats:
    toy_marker_sum: float | None = stat()  # the same on every rank (each sees the whole stream)
    toy_syncs_seen: int = stat(0, ranks=SUMMED)  # one per rank: summed over an engine's ranks


@register
class ToyMarker(SyncFeature):
    name = "toy_marker"
    stats = ToyStats

    def __init__(self, settings):
        super().__init__(settings)
        self.sent = 0
        self.seen = 0
        self.value: float | None = None

    def trainer_tensors(self):
        self.sent += 1
        return [(MARKER, torch.arange(4, dtype=torch.float32) + self.sent)]

    def prepare(self, sync) -> None:
        self.value = None

    def take(self, name, tensor) -> bool:
        if name != MARKER:
            return False
        self.value = float(tensor.double().sum())
        return True

    def summarize(self, sync) -> ToyStats:
        self.seen += 1
        return ToyStats(toy_marker_sum=self.value, toy_syncs_seen=self.seen)


class ToyFeatureWorkerExtension(QurlWorkerExtension):
    """The production extension; its module registers ``ToyMarker`` in the worker's process."""
