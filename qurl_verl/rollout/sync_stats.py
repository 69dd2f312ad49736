"""What one weight sync cost inside a vLLM worker, and how the ranks of one engine and the syncs of one
step add up.

Every rank of a TP engine receives the full tensors and quantizes them itself (vLLM's loaders then
keep the rank's shard), so the stream's counters and the code-change tracker's rates are the same on
every rank. What differs is cost: a sync ends when its slowest rank does, and each rank holds its own
process memory and tracker state. Each field says how it merges (``stat``): over the ranks of one
engine (``combine_ranks``) and over two syncs of one step (``combine_syncs``, a feature's ``trainer_report``).
The stream's counters, the sync's own and each sync feature's (``rollout.features``) are reported as
one flat row.
"""
from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from qurl_verl.settings import DEFAULT_WEIGHT_BITS

logger = logging.getLogger("qurl_verl")

# over the ranks of one engine
SAME = "same"  # equal on every rank (each sees the whole stream); rank 0's, a warning if they differ
SLOWEST = "slowest"  # seconds: the sync ends with its slowest rank
SUMMED = "summed"  # host memory each rank holds
# over two syncs of one step
LAST, ADDED, FIRST, LEAST, CHECKSUM = "last", "added", "first", "least", "checksum"


def stat(default: Any = None, *, ranks: str = SAME, syncs: str = LAST, prefix: str = "qurl/sync/"):
    """A stats field and its merge rules; ``prefix``: the metric group it is logged under."""
    return field(default=default, metadata={"ranks": ranks, "syncs": syncs, "prefix": prefix})


def merge_rules(*types: type) -> dict[str, dict[str, str]]:
    """{field name: its ``stat`` metadata} over stats dataclasses (plus their ``REPORTED`` extras)."""
    rules: dict[str, dict[str, str]] = {}
    for t in types:
        rules.update({f.name: dict(f.metadata) for f in fields(t) if "ranks" in f.metadata})
        rules.update(getattr(t, "REPORTED", {}))
    return rules


# Counted, but left out of the sync's report (``report``): passed_through is tensors_in - quantized -
# skipped, and the element counts reach it as ``quantized_frac``.
_NOT_REPORTED = {"reported": False}
# The checksum stays below 2**40, so a metric averaged over a replica's ranks keeps it exact in float64.
CHECKSUM_MODULUS = 2**40 - 87  # a prime
CHECKSUM_MULTIPLIER = 1_000_003
# Each element's bit pattern is weighted by its flat index i: weight(i) = index_hash(i % BLOCK) +
# index_hash(BLOCK + i // BLOCK), so a transposed or permuted tensor has another checksum. The split lets a
# block's column sums take the first term and its row sums the second: two reductions, no per-element hash.
# Everything stays in int64 without overflow: bit patterns |v| < 2**31; a column or row sum of 2**12 of them is
# below 2**43 and is reduced below 2**40 before it is multiplied by a hash (<= 2**20); 2**12 such terms, each
# reduced below 2**40 again, sum below 2**52.
CHECKSUM_BLOCK = 1 << 12
_BLOCKS_PER_STEP = 1 << 12
_INDEX_PRIME = 2_147_483_629  # a prime below 2**31: a residue squared is below 2**62
_INDEX_MIX = 4_194_301  # a prime below 2**22: index * _INDEX_MIX < 2**63 for any index below 2**40
_INDEX_OFFSET = 1_234_567
_INDEX_HASH_BITS = 20
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def index_hash(index: torch.Tensor) -> torch.Tensor:
    """int64 in, int64 in [1, 2**20] out: a squared affine residue mixed with the index again, so that no fixed
    stride maps two indices to one hash."""
    mixed = (index * _INDEX_MIX + _INDEX_OFFSET) % _INDEX_PRIME
    mixed = (mixed * mixed + index) % _INDEX_PRIME
    return mixed % (1 << _INDEX_HASH_BITS) + 1


def bit_patterns(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as signed integers of their own width, flat (8-byte and wider elements as 4-byte words)."""
    t = t.detach().contiguous().view(-1)
    if t.dtype == torch.bool:
        return t.to(torch.int8)
    size = t.element_size()
    return t.view(_SAME_SIZE_INT[size]) if size in _SAME_SIZE_INT else t.view(torch.int32)


def _weighted_sum(values: torch.Tensor, weights: torch.Tensor) -> int:
    """sum(values * weights) mod CHECKSUM_MODULUS, ``values`` below 2**43 in magnitude, at most 2**12 terms."""
    return int(torch.remainder(torch.remainder(values, CHECKSUM_MODULUS) * weights, CHECKSUM_MODULUS).sum())


def tensor_checksum(t: torch.Tensor) -> int:
    """The sum of ``t``'s bit patterns (signed integers), each times the weight of its flat index, modulo
    ``CHECKSUM_MODULUS``, then its shape: exact, on the tensor's own device, and sensitive to where each element
    sits (a transposed square matrix, permuted rows or two swapped elements change it)."""
    bits = bit_patterns(t)
    device, n = bits.device, bits.numel()
    column_hash = index_hash(torch.arange(CHECKSUM_BLOCK, dtype=torch.int64, device=device))
    checksum, full = 0, n - n % CHECKSUM_BLOCK
    step = CHECKSUM_BLOCK * _BLOCKS_PER_STEP
    for start in range(0, n, step):
        stop = min(start + step, n)
        blocks = (min(stop, full) - start) // CHECKSUM_BLOCK
        first = start // CHECKSUM_BLOCK
        if blocks:
            m = bits[start: start + blocks * CHECKSUM_BLOCK].to(torch.int64).view(blocks, CHECKSUM_BLOCK)
            row_hash = index_hash(torch.arange(first, first + blocks, dtype=torch.int64, device=device) + CHECKSUM_BLOCK)
            checksum += _weighted_sum(m.sum(0), column_hash) + _weighted_sum(m.sum(1), row_hash)
        if stop > full:  # the last, partial block: one row
            tail = bits[full:stop].to(torch.int64)
            row = torch.tensor([full // CHECKSUM_BLOCK + CHECKSUM_BLOCK], dtype=torch.int64, device=device)
            checksum += _weighted_sum(tail, column_hash[: tail.numel()]) + _weighted_sum(tail.sum(0, keepdim=True),
                                                                                        index_hash(row))
        checksum %= CHECKSUM_MODULUS
    for size in t.shape:
        checksum = (checksum * CHECKSUM_MULTIPLIER + size) % CHECKSUM_MODULUS
    return checksum


@dataclass
class StreamStats:
    tensors_in: int = stat(0, syncs=ADDED)
    quantized: int = stat(0, syncs=ADDED)
    passed_through: int = field(default=0, metadata=_NOT_REPORTED)
    skipped: int = stat(0, syncs=ADDED)  # dropped before any copy: names in ``WeightStreamQuantizer.skip``
    bytes_in: int = stat(0, syncs=ADDED)
    numel_in: int = field(default=0, metadata=_NOT_REPORTED)  # elements of the tensors loaded (skipped ones not counted)
    quantized_numel: int = field(default=0, metadata=_NOT_REPORTED)  # ... of which sent as 8-bit codes
    quantize_s: float = stat(0.0, ranks=SLOWEST, syncs=ADDED)  # quantizing the targeted weights
    copy_s: float = stat(0.0, ranks=SLOWEST, syncs=ADDED)  # copying pass-through tensors out of the transport buffer
    code_change_s: float = stat(0.0, ranks=SLOWEST, syncs=ADDED)  # the update-visibility tracker
    # a checksum of every tensor the stream handed the engine (codes, scales, pass-through), by name:
    # equal on two replicas that loaded the same bits, whatever their buckets (``tensor_checksum``)
    checksum: int = stat(0, syncs=CHECKSUM)
    # reported beside the fields: over two syncs of one step, the share sent in 8 bits is the first's (the base's)
    REPORTED: ClassVar[dict] = {"quantized_frac": {"ranks": SAME, "syncs": FIRST, "prefix": "qurl/sync/"}}

    @property
    def quantized_frac(self) -> float | None:
        """Share of the loaded weight elements sent as 8-bit codes: what the rollout runs quantized
        (with an MoE model's experts in bf16, a small share); None before any element arrived."""
        return self.quantized_numel / self.numel_in if self.numel_in else None

    def add_checksum(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Order-free: buckets may be cut differently; each tensor weighted by its name."""
        for name, t in named_tensors:
            self.checksum = (self.checksum + (zlib.crc32(name.encode()) + 1) * tensor_checksum(t)) % CHECKSUM_MODULUS

    def count_loaded_as_is(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Tensors the engine takes as they arrive (through verl's own loader, not the stream)."""
        self.tensors_in += len(named_tensors)
        self.passed_through += len(named_tensors)
        self.bytes_in += sum(t.numel() * t.element_size() for _, t in named_tensors)
        self.numel_in += sum(t.numel() for _, t in named_tensors)
        self.add_checksum(named_tensors)

    def report(self) -> dict[str, int | float | None]:
        """The counters a sync reports (``worker_extension.SyncStats``), flat, with ``quantized_frac``."""
        reported = {f.name: getattr(self, f.name) for f in fields(self) if "ranks" in f.metadata}
        return {**reported, "quantized_frac": self.quantized_frac}


@dataclass
class SyncStats:
    """Cost of one weight sync inside the vLLM worker (seconds; bytes as received).

    Reported flat (``as_dict``): the stream's counters (``StreamStats.report``) and each feature's
    stats (``features``) beside the sync's own."""

    sync: int = stat()
    format: str = stat()
    weight_bits: int = stat(DEFAULT_WEIGHT_BITS)  # integer code width of the quantized weights (8 = INT8)
    total_s: float = stat(0.0, ranks=SLOWEST, syncs=ADDED)
    load_s: float = stat(0.0, ranks=SLOWEST, syncs=ADDED)  # model.load_weights, with each layer's post-processing
    finalize_s: float = stat(0.0, ranks=SLOWEST, syncs=ADDED)
    buckets: int = stat(0, syncs=ADDED)
    stream: StreamStats = field(default_factory=StreamStats)  # the stream's own, counted as it runs
    rss_mb: float = stat(0.0, ranks=SUMMED)  # worker resident memory after the sync, to watch for leaks
    features: dict = field(default_factory=dict)  # {feature name: its stats instance}

    def as_dict(self) -> dict:
        """What ``qurl_last_sync`` returns to the trainer: one flat dict, ``stream`` and ``features`` spread."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("stream", "features")}
        out.update(self.stream.report())
        for stats in self.features.values():
            out.update({f.name: getattr(stats, f.name) for f in fields(stats)})
        return out

    def as_metrics(self, prefix: str = "qurl/sync/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in self.as_dict().items() if k != "format" and v is not None}


def all_rules(feature_stats: Sequence[type] = ()) -> dict[str, dict[str, str]]:
    """The merge rules of every field a sync reports: the sync's, the stream's, and the features' (their stats types)."""
    return merge_rules(SyncStats, StreamStats, *feature_stats)


def combine_ranks(per_rank: Sequence[dict | None], feature_stats: Sequence[type] = ()) -> dict | None:
    """One engine's sync, from its ranks' ``SyncStats.as_dict()`` (None where a rank reported nothing),
    by each field's ``ranks`` rule (unknown fields: rank 0's), plus ``ranks``."""
    rows = [r for r in per_rank if r]
    if not rows:
        return None
    rules = all_rules(feature_stats)
    out = dict(rows[0])
    for key in out:
        values = [r.get(key) for r in rows]
        rule = rules.get(key, {}).get("ranks")
        if rule == SLOWEST:
            out[key] = max(v for v in values if v is not None)
        elif rule == SUMMED:
            out[key] = sum(v for v in values if v is not None)
        elif rule == SAME and len(set(map(repr, values))) > 1:
            logger.warning("qurl_vllm sync: ranks disagree on %s: %s", key, values)
    out["ranks"] = len(rows)
    return out


def combine_syncs(first: dict, then: dict, feature_stats: Sequence[type] = ()) -> dict:
    """One step's report from two syncs in a row (``combine_ranks`` rows), by each field's ``syncs`` rule:
    costs and counts added, the checksum of everything loaded (an order-free sum), the first's or the
    least where a field says so, the rest from the later one."""
    out = dict(then)
    for key, rule in all_rules(feature_stats).items():
        rule = rule.get("syncs")
        if rule == ADDED:
            out[key] = (first.get(key) or 0) + (then.get(key) or 0)
        elif rule == CHECKSUM:
            out[key] = ((first.get(key) or 0) + (then.get(key) or 0)) % CHECKSUM_MODULUS
        elif rule == FIRST:
            out[key] = first.get(key)
        elif rule == LEAST:
            out[key] = min(first.get(key, 0), then.get(key, 0))
    return out


def metric_groups(stats: dict | None, replica_rank: int = 0, feature_stats: Sequence[type] = ()) -> dict[str, dict[str, float]]:
    """{metric prefix: {metric: value}} of a reported sync: numbers only, each field under its group's
    prefix; the checksum as one key per replica (verl averages a key over ranks)."""
    groups: dict[str, dict[str, float]] = {}
    rules = all_rules(feature_stats)
    for key, value in (stats or {}).items():
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        prefix = rules.get(key, {}).get("prefix", "qurl/sync/")
        name = f"{prefix}{key}/replica_{replica_rank}" if key == "checksum" else f"{prefix}{key}"
        groups.setdefault(prefix, {})[name] = float(value)
    return groups


# The rollout's report of its last sync, in a disaggregated rollout: the adapter that loaded the weights lives
# in the rollout's process (verl's ``CheckpointEngineWorker``), whose results verl drops, so the report waits
# here for the checkpoint engine, which carries it to the trainer at the start of the next sync.
_rollout_report: list[tuple[int, dict]] = []


def post_rollout_report(replica_rank: int, stats: dict) -> None:
    """Keep this process's last sync report (``combine_ranks`` row) for the checkpoint engine to carry."""
    _rollout_report[:] = [(replica_rank, dict(stats))]


def take_rollout_report() -> tuple[int, dict] | None:
    """The report posted since the last call, once (None if there is none)."""
    return _rollout_report.pop() if _rollout_report else None


def rollout_report_metrics(reports: Sequence[tuple[int, dict]], feature_stats: Sequence[type] = (),
                           prefix: str | None = None) -> dict[str, float]:
    """The rollout ranks' reports as metrics: one key per replica for the checksum (``.../checksum/replica_<r>``),
    the mean over the reports (verl's reduction of a metric over ranks) for the rest.

    ``prefix`` None: under the colocated sync's names (``actor/`` + ``metric_groups``); else each stat as
    ``prefix + name``, apart from the names a colocated sync logs (a disaggregated run with a hybrid engine
    has both)."""
    sums: dict[str, list[float]] = {}
    for replica_rank, stats in reports:
        if prefix is None:
            named = {f"actor/{name}": value for metrics in metric_groups(stats, replica_rank, feature_stats).values()
                     for name, value in metrics.items()}
        else:
            named = {(f"{prefix}{key}/replica_{replica_rank}" if key == "checksum" else f"{prefix}{key}"): float(value)
                     for key, value in stats.items()
                     if value is not None and not isinstance(value, bool) and isinstance(value, (int, float))}
        for name, value in named.items():
            sums.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) for name, values in sums.items()}
