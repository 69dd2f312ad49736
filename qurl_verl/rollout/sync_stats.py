"""What one weight sync cost inside a vLLM worker, and how the ranks of one engine add up.

Every rank of a TP engine receives the full tensors and quantizes them itself (vLLM's loaders then
keep the rank's shard), so the stream's counters and the code-change tracker's rates are the same on
every rank. What differs is cost: a sync ends when its slowest rank does, and each rank holds its own
process memory and tracker state. ``combine_ranks`` reports an engine as one row: seconds of the
slowest rank, resident memory and tracker bytes summed over ranks (the host memory the engine holds),
the rest from rank 0, and ``ranks``.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from qurl_verl.rollout.weight_stream import StreamStats
from qurl_verl.settings import DEFAULT_WEIGHT_BITS

logger = logging.getLogger("qurl_verl")

# per-rank quantities of a sync: host memory each rank holds
SUMMED_OVER_RANKS = ("rss_mb", "tracker_resident_bytes")
# the same on every rank of an engine when its stream is whole: each rank sees every tensor
SAME_ON_EVERY_RANK = ("sync", "format", "weight_bits", "buckets", "tensors_in", "quantized", "skipped", "bytes_in",
                      "quantized_frac", "changed_code_frac", "update_to_error_ratio", "tracker_row_stride", "checksum",
                      "kv_scale_layers_streamed", "kv_scale_k_min", "kv_scale_k_max", "kv_scale_v_min", "kv_scale_v_max", "base_frozen")


@dataclass
class SyncStats:
    """Cost of one weight sync inside the vLLM worker (seconds; bytes as received).

    Reported flat (``as_dict``): the stream's counters (``StreamStats.report``) beside the sync's own."""

    sync: int
    format: str
    weight_bits: int = DEFAULT_WEIGHT_BITS  # integer code width of the quantized weights (8 = INT8)
    total_s: float = 0.0
    load_s: float = 0.0  # model.load_weights, including each layer's post-processing (prepack)
    finalize_s: float = 0.0
    buckets: int = 0
    stream: StreamStats = field(default_factory=StreamStats)  # the stream's own, counted as it runs
    rss_mb: float = 0.0  # worker resident memory after the sync, to watch for leaks
    # QuRL's weight-update problem: share of the tracked 8-bit codes this sync changed, and
    # ||W_new - W_prev|| / ||Q(W_prev) - W_prev|| (None on the first sync or with tracking off)
    changed_code_frac: float | None = None
    update_to_error_ratio: float | None = None
    # The tracker's state (CPU, bounded): bytes held across syncs, and the row stride it samples at
    # (the requested one, or larger where the byte cap needed it; 0 = tracking off)
    tracker_resident_bytes: int = 0
    tracker_row_stride: int = 0
    # An FP8 KV cache's scales after the sync: how many layers took theirs from the stream (0: vLLM's
    # default 1.0 everywhere, the first sync), and the range of the K and V scales (None: no FP8 cache)
    kv_scale_layers_streamed: int = 0
    kv_scale_k_min: float | None = None
    kv_scale_k_max: float | None = None
    kv_scale_v_min: float | None = None
    kv_scale_v_max: float | None = None
    # LoRA adapter mode: 1 for a sync that carried only the adapters (the 8-bit base, quantized at the
    # first sync, did not change; the code-change tracker is off)
    base_frozen: int = 0

    def as_dict(self) -> dict:
        """What ``qurl_last_sync`` returns to the trainer: one flat dict, ``stream`` spread in place."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out.update(value.report() if f.name == "stream" else {f.name: value})
        return out

    def as_metrics(self, prefix: str = "qurl/sync/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in self.as_dict().items() if k != "format" and v is not None}



def combine_ranks(per_rank: Sequence[dict | None]) -> dict | None:
    """One engine's sync, from its ranks' ``SyncStats.as_dict()`` (None where a rank reported nothing):
    ``*_s`` the slowest rank's, ``SUMMED_OVER_RANKS`` summed, the rest rank 0's, plus ``ranks``."""
    rows = [r for r in per_rank if r]
    if not rows:
        return None
    out = dict(rows[0])
    for key in out:
        values = [r.get(key) for r in rows]
        if key.endswith("_s"):
            out[key] = max(v for v in values if v is not None)
        elif key in SUMMED_OVER_RANKS:
            out[key] = sum(v for v in values if v is not None)
        elif key in SAME_ON_EVERY_RANK and len(set(map(repr, values))) > 1:
            logger.warning("qurl_vllm sync: ranks disagree on %s: %s", key, values)
    out["ranks"] = len(rows)
    return out


# what a step that synced twice paid in all (a LoRA run's step 1: the base, then the adapters)
ADDED_OVER_SYNCS = ("total_s", "quantize_s", "copy_s", "code_change_s", "load_s", "finalize_s", "buckets",
                    "tensors_in", "quantized", "skipped", "bytes_in")


def combine_syncs(first: dict, then: dict) -> dict:
    """One step's report from two syncs in a row (``combine_ranks`` rows; a LoRA run's step 1: the base,
    then the adapters): costs and counts added, the checksum of everything loaded (the stream's checksum
    is an order-free sum), the share sent in 8 bits and ``base_frozen`` (0: the base changed) from the
    first, the rest from the later one."""
    from qurl_verl.rollout.weight_stream import CHECKSUM_MODULUS

    out = dict(then)
    for key in ADDED_OVER_SYNCS:
        out[key] = (first.get(key) or 0) + (then.get(key) or 0)
    out["checksum"] = ((first.get("checksum") or 0) + (then.get("checksum") or 0)) % CHECKSUM_MODULUS
    out["quantized_frac"] = first.get("quantized_frac")
    out["base_frozen"] = min(first.get("base_frozen", 0), then.get("base_frozen", 0))
    return out
