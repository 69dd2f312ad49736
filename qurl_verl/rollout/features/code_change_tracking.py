"""Code-change tracking: the share of 8-bit codes each sync changes, QuRL's weight-update problem (§3.2).

An ``UpdateVisibilityTracker`` (``qurl_verl.quant.update_visibility``) sees every quantized weight of
the stream with the codes just computed, on every Nth row (``custom.qurl.code_change_row_stride``),
so the rate costs no second quantization. One tracker per worker, across syncs (it holds the previous
sync's sampled weights and codes), in CPU memory capped by ``custom.qurl.code_change_max_mb``: it lives
for the whole run, outside the accelerator memory vLLM budgets for. A sync whose base stays frozen
afterwards (``WeightSync.frozen_base``) is not tracked.
"""
from __future__ import annotations

from dataclasses import dataclass

from qurl_verl.quant import UpdateVisibilityTracker
from qurl_verl.rollout.features import SyncFeature, register
from qurl_verl.rollout.sync_stats import SUMMED, stat
from qurl_verl.settings import RolloutSettings

UPDATE_PREFIX = "qurl/update/"


@dataclass
class CodeChangeStats:
    # share of the tracked 8-bit codes this sync changed, and ||W_new - W_prev|| / ||Q(W_prev) - W_prev||
    # (None on the first sync)
    changed_code_frac: float | None = stat(prefix=UPDATE_PREFIX)
    update_to_error_ratio: float | None = stat(prefix=UPDATE_PREFIX)
    # the tracker's state (CPU, bounded): bytes held across syncs, and the row stride it samples at (the
    # requested one, or larger where the byte cap needed it)
    tracker_resident_bytes: int = stat(0, ranks=SUMMED)
    tracker_row_stride: int = stat(0)


@register
class CodeChangeTracking(SyncFeature):
    name = "code_change_tracking"
    stats = CodeChangeStats

    def __init__(self, settings: RolloutSettings):
        super().__init__(settings)
        self.tracker: UpdateVisibilityTracker | None = None

    @classmethod
    def enabled(cls, settings: RolloutSettings) -> bool:
        return settings.quantized and settings.code_change_row_stride > 0

    def prepare(self, sync) -> None:
        if sync.frozen_base:
            self.tracker = None
            return
        if self.tracker is None:
            s = self.settings
            self.tracker = UpdateVisibilityTracker(
                s.quant_scheme, ignore=s.ignore_patterns, row_stride=s.code_change_row_stride,
                storage_device="cpu", max_resident_bytes=s.code_change_max_bytes,
            )
        sync.stream.tracker = self.tracker

    def summarize(self, sync) -> CodeChangeStats | None:
        if self.tracker is None or sync.frozen_base:
            return None
        summary = self.tracker.end_step()
        overall = summary["overall"]
        return CodeChangeStats(
            changed_code_frac=overall["changed_fraction"] if overall["numel"] else None,
            update_to_error_ratio=overall["update_to_error_ratio"] if overall["numel"] else None,
            tracker_resident_bytes=summary["tracker"]["resident_bytes"],
            tracker_row_stride=summary["tracker"]["row_stride"],
        )
