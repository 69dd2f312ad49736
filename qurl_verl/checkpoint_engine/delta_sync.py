"""The delta mode of the 8-bit sync: each side keeps, in host memory, the tensors of the last sync, and a sync
after the first carries per tensor only its changed elements (``delta_codec``), or the tensor in full.

Transport-free (pure torch): the sender turns the model tensors the codec produced (codes, scales, the rest)
into wire tensors, the receiver turns them back into the full tensors, which go to the same reload path as a
full sync's. Only the bytes on the wire shrink.

On the wire, a sync starts with ``SYNC_HEADER`` (int64 ``[mode, sync_id, base_id, 0]``). In a full sync every
tensor follows as itself and the receiver's copy becomes exactly those tensors. In a delta sync, each tensor
is preceded by its header ``TENSOR_HEADER_PREFIX + name`` (int64 ``[encoding, changed, numel, element_size,
index_bytes]``), then comes either the tensor itself (``full``: new, a different shape or dtype, per-channel
scales, which change at almost every step, or a delta no smaller than the tensor) or one uint8 tensor
``PAYLOAD_PREFIX + name``: the index (bitmap or gap varints) then the changed values' bytes.

Never silently diverge. Sync ids count the sender's syncs (1, 2, ...). Each receiver reports, at the start of
every sync (the engine's report channel gathers it before the sender encodes), the id of the sync its copy
holds (``NO_BASE`` after a (re)start or a payload it could not apply) and the checksum of the full tensors it
rebuilt (``StreamStats.add_checksum``). The sender sends in full when:

- it has no copy (its first sync), or ``full_sync_every`` syncs have passed since the last full one;
- a replica's base is not the sync it sent last (it restarted, lost its copy, or missed a sync), a
  report is missing, or the sender's previous sync stopped half-way (its copy mixes two syncs);
- a replica's checksum differs from the one the sender computed for that sync (a payload corrupted on the
  way: detected one sync late, so the next sync is full).

The last two are counted in ``full_resyncs``. A sync a receiver cannot apply (a delta against a base it does
not hold, which the reports rule out unless a replica joined between the gather and the send; a malformed
payload) is still read to its end, so no peer is left waiting: from the fault on nothing more is handed on
(the tensors before it were), the copy counts as lost (``NO_BASE``), and the next sync is full.

Host memory: one copy on each side (the sender's rank 0, every receiving rank), updated tensor by tensor in
place, never two: the size of a full 8-bit sync's payload (codes, scales, the rest in the rollout's dtype).
"""
from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from qurl_verl.rollout.sync_stats import StreamStats

from . import delta_codec
from .delta_codec import EncodedTensor, Encoding

logger = logging.getLogger("qurl_verl")

# names no checkpoint tensor has (``:`` never appears in a module path)
SYNC_HEADER = "qurl_int8.delta_sync"
TENSOR_HEADER_PREFIX = "qurl_int8.delta_header:"
PAYLOAD_PREFIX = "qurl_int8.delta_payload:"
NO_BASE = -1
_ENCODING_CODES = {Encoding.FULL: 0, Encoding.BITMAP: 1, Encoding.GAPS: 2}
_CODE_ENCODINGS = {v: k for k, v in _ENCODING_CODES.items()}


class SyncMode(enum.IntEnum):
    FULL = 0
    DELTA = 1


class DeltaFormatError(ValueError):
    """A delta sync that this side cannot apply: malformed, or against a base it does not hold."""


def always_full_by_default(name: str) -> bool:
    """Per-channel scales: fp32 absmax of a row, whose bits change whenever the row's largest element moves
    (nearly every row, every step: bench/results/delta_sync.md)."""
    return name.endswith("weight_scale")


@dataclass
class ReplicaReport:
    """What a receiver says at the start of a sync about its copy."""

    base: int = NO_BASE
    checksum: int = 0

    def as_numbers(self) -> dict[str, int]:
        return {"delta_base": self.base, "delta_checksum": self.checksum}

    @classmethod
    def from_numbers(cls, numbers: dict | None) -> ReplicaReport | None:
        if not numbers or "delta_base" not in numbers:
            return None
        return cls(int(numbers["delta_base"]), int(numbers.get("delta_checksum", 0)))


@dataclass
class DeltaSyncStats:
    """One sync as the sender encoded it (``qurl_sync/*`` metrics)."""

    sync_id: int = 0
    full_sync: bool = True
    reason: str = ""
    full_resyncs: int = 0  # forced full syncs so far (a replica behind or restarted, a checksum mismatch)
    delta_tensors: int = 0
    full_tensors: int = 0
    delta_numel: int = 0  # elements of the tensors sent as a delta
    changed: int = 0  # ... of which changed
    checksum: int = 0  # of the full tensors of this sync

    @property
    def delta_fraction(self) -> float:
        return self.changed / self.delta_numel if self.delta_numel else 1.0

    def metrics(self, prefix: str = "qurl_sync") -> dict[str, float]:
        return {f"{prefix}/full_sync": float(self.full_sync), f"{prefix}/full_resyncs": float(self.full_resyncs),
                f"{prefix}/delta_fraction": self.delta_fraction, f"{prefix}/delta_tensors": float(self.delta_tensors),
                f"{prefix}/delta_sync_id": float(self.sync_id)}


def _header(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy the caller's tensor does not share (the caller may reuse its buffer)."""
    return t.detach().to("cpu", copy=True).contiguous()


@dataclass
class DeltaSender:
    """The trainer side: what it last sent, and when the next sync must be full.

    ``full_sync_every``: a full sync every K syncs (0: only when forced). ``always_full``: names sent in full in
    every sync (by default the per-channel scales)."""

    full_sync_every: int = 0
    always_full: Callable[[str], bool] = always_full_by_default
    copy: dict[str, torch.Tensor] = field(default_factory=dict)
    last_sync: int = 0
    last_full: int = 0
    full_resyncs: int = 0
    checksums: dict[int, int] = field(default_factory=dict)  # sync id -> checksum, the last two syncs
    unfinished: bool = False  # a sync stopped half-way: the copy mixes two syncs

    def plan(self, reports: Sequence[ReplicaReport | None]) -> tuple[SyncMode, str]:
        """This sync's mode from every receiver's report (one per receiving rank)."""
        if not self.copy or self.last_sync == 0:
            return SyncMode.FULL, "first"
        forced = "the previous sync did not finish" if self.unfinished else None
        for i, r in enumerate(reports):
            if forced:
                break
            if r is None:
                forced = f"no report from receiver {i}"
            elif r.base != self.last_sync:
                forced = f"receiver {i} holds sync {r.base}, {self.last_sync} was sent last"
            elif self.checksums.get(r.base) != r.checksum:
                forced = f"receiver {i}'s checksum of sync {r.base} differs from the sender's"
        if forced:
            self.full_resyncs += 1
            return SyncMode.FULL, forced
        if self.full_sync_every and self.last_sync - self.last_full + 1 >= self.full_sync_every:
            return SyncMode.FULL, f"every {self.full_sync_every} syncs"
        return SyncMode.DELTA, ""

    def encode(self, tensors: Iterable[tuple[str, torch.Tensor]], mode: SyncMode,
               stats: DeltaSyncStats | None = None,
               checksum_of_tensors: Callable[[], int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The wire tensors of this sync; the copy and the checksum are updated as tensors go out.
        ``checksum_of_tensors``: where ``tensors``' producer leaves their ``StreamStats`` checksum once they are
        all out (the engine's codec computes it anyway: one pass over the model, not two)."""
        stats = stats if stats is not None else DeltaSyncStats()
        sync_id = self.last_sync + 1
        base = self.last_sync if mode is SyncMode.DELTA else NO_BASE
        stats.sync_id, stats.full_sync, stats.full_resyncs = sync_id, mode is SyncMode.FULL, self.full_resyncs
        checksum, seen = StreamStats(), set()
        self.unfinished = True
        if mode is SyncMode.FULL:
            self.copy = {}  # replaced tensor by tensor: one copy in host memory, never two
        yield SYNC_HEADER, _header([int(mode), sync_id, base, 0])
        for name, tensor in tensors:
            host = _host(tensor)
            if checksum_of_tensors is None:
                checksum.add_checksum(((name, host),))
            old = self.copy.get(name) if mode is SyncMode.DELTA else None
            self.copy[name] = host
            seen.add(name)
            if mode is SyncMode.FULL:
                stats.full_tensors += 1
                yield name, tensor
                continue
            same_kind = old is not None and old.shape == host.shape and old.dtype == host.dtype
            encoded = delta_codec.encode(old if same_kind and not self.always_full(name) else None, host)
            yield TENSOR_HEADER_PREFIX + name, _header([_ENCODING_CODES[encoded.encoding], encoded.changed,
                                                        host.numel(), host.element_size(), encoded.index.numel(), 0])
            if encoded.encoding is Encoding.FULL:
                stats.full_tensors += 1
                yield name, tensor
            else:
                stats.delta_tensors += 1
                stats.delta_numel += host.numel()
                stats.changed += encoded.changed
                yield PAYLOAD_PREFIX + name, torch.cat([encoded.index, encoded.values]).to(tensor.device)
        self.copy = {n: t for n, t in self.copy.items() if n in seen}
        self.unfinished = False
        self.last_sync = sync_id
        if mode is SyncMode.FULL:
            self.last_full = sync_id
        stats.checksum = checksum.checksum if checksum_of_tensors is None else checksum_of_tensors()
        self.checksums = {k: v for k, v in self.checksums.items() if k >= sync_id - 1}
        self.checksums[sync_id] = stats.checksum

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copy.values())


@dataclass
class DeltaReceiver:
    """The rollout side: its copy of the last sync (host memory), rebuilt into full tensors every sync.

    A sync is ``begin`` on the first wire tensor, ``take`` on each of the others (each returns the full tensors it
    completed), ``finish`` at the end; ``apply`` and ``apply_async`` run the three over a stream. The full tensors
    are the new copy itself: read them before the next sync, never write them."""

    copy: dict[str, torch.Tensor] = field(default_factory=dict)
    base: int = NO_BASE
    checksum: int = 0
    apply_errors: int = 0  # syncs this side could not apply (its copy then counts as lost)
    _sync: dict | None = field(default=None, repr=False)

    def report(self) -> ReplicaReport:
        return ReplicaReport(self.base, self.checksum)

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copy.values())

    def _lose_copy(self, why: str) -> None:
        logger.warning("qurl_int8 delta sync: this rollout's copy is lost (%s); the next sync will be full", why)
        self.apply_errors += 1
        self.copy, self.base, self.checksum = {}, NO_BASE, 0

    def begin(self, name: str, header: torch.Tensor) -> None:
        sync = {"failed": None, "pending": None, "seen": set(), "checksum": StreamStats(), "id": NO_BASE,
                "mode": SyncMode.FULL}
        self._sync, held = sync, self.base
        self.base, self.checksum = NO_BASE, 0  # until the sync ends complete: the copy changes in place
        if name != SYNC_HEADER or header.dtype != torch.int64 or header.numel() != 4 or int(header[3]):
            sync["failed"] = f"a delta-mode sync starts with {SYNC_HEADER!r}, got {name!r}"
            return
        mode, sync["id"], base, _ = (int(v) for v in header.tolist())
        if mode not in (SyncMode.FULL, SyncMode.DELTA):
            sync["failed"] = f"sync mode {mode}"
        elif mode == SyncMode.DELTA and (base != held or base == NO_BASE):
            sync["failed"] = f"sync {sync['id']} is a delta against sync {base}, this copy holds {held}"
        else:
            sync["mode"] = SyncMode(mode)
            if sync["mode"] is SyncMode.FULL:
                self.copy = {}

    def take(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        sync = self._sync
        if sync is None:
            self.begin(name, tensor)
            return []
        if sync["failed"]:
            return []  # read to the end, never applied
        try:
            full = self._take(sync, name, tensor)
        except DeltaFormatError as exc:
            sync["failed"] = str(exc)
            return []
        if full is None:
            return []
        self.copy[full[0]] = full[1]
        sync["seen"].add(full[0])
        sync["checksum"].add_checksum((full,))
        return [full]

    def finish(self) -> None:
        sync, self._sync = self._sync, None
        if sync is None:
            self._lose_copy("an empty sync")
        elif sync["failed"] or sync["pending"] is not None:
            self._lose_copy(sync["failed"] or f"the sync ended after the header of {sync['pending'][0]!r}")
        else:
            self.copy = {n: t for n, t in self.copy.items() if n in sync["seen"]}
            self.base, self.checksum = sync["id"], sync["checksum"].checksum

    def apply(self, received: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in received:
            yield from self.take(name, tensor)
        self.finish()

    async def apply_async(self, received: AsyncIterable[tuple[str, torch.Tensor]]
                          ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        async for name, tensor in received:
            for out in self.take(name, tensor):
                yield out
        self.finish()

    def _take(self, sync: dict, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if sync["mode"] is SyncMode.FULL:
            return name, _host(tensor)
        if sync["pending"] is None:
            if not name.startswith(TENSOR_HEADER_PREFIX) or tensor.dtype != torch.int64 or tensor.numel() != 6:
                raise DeltaFormatError(f"{name!r} where a tensor header was expected")
            values = [int(v) for v in tensor.tolist()]
            if values[0] not in _CODE_ENCODINGS or min(values) < 0 or values[5]:
                raise DeltaFormatError(f"{name!r}: header {values}")
            sync["pending"] = (name[len(TENSOR_HEADER_PREFIX):], values)
            return None
        (target, (code, changed, numel, element_size, index_bytes, _)), sync["pending"] = sync["pending"], None
        if _CODE_ENCODINGS[code] is Encoding.FULL:
            if name != target or tensor.numel() != numel or tensor.element_size() != element_size:
                raise DeltaFormatError(f"{name!r} where the full tensor {target!r} was announced")
            self.copy.pop(name, None)  # freed before its successor is copied
            return name, _host(tensor)
        base = self.copy.get(target)
        if name != PAYLOAD_PREFIX + target or tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise DeltaFormatError(f"{name!r} where the delta of {target!r} was announced")
        if base is None or base.numel() != numel or base.element_size() != element_size:
            raise DeltaFormatError(f"a delta of {target!r} ({numel} elements of {element_size} bytes) for a copy that "
                                   f"has {None if base is None else (base.numel(), base.element_size())}")
        if index_bytes > tensor.numel():
            raise DeltaFormatError(f"{target!r}: an index of {index_bytes} bytes in a {tensor.numel()}-byte payload")
        body = tensor.cpu()
        encoded = EncodedTensor(_CODE_ENCODINGS[code], changed, body[:index_bytes], body[index_bytes:])
        try:
            return target, delta_codec.decode_into(base, encoded, base.shape, base.dtype)
        except ValueError as exc:
            raise DeltaFormatError(f"{target!r}: {exc}") from None
