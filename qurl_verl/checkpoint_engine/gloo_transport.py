"""The ``qurl_int8`` transport on CPU: gloo, in the shape of verl's ``NCCLCheckpointEngine``.

Ray's gloo collective cannot join processes that already own an FSDP group, so the group is built directly
(``ProcessGroupGloo`` over a ``TCPStore``), neither joining nor reusing the default group both sides own.
One group for the engine's life: actor rank 0 hosts the store, created once (port 0: the store binds and
reports its port, no probe-then-bind race); the group is rebuilt only when the members, a rank or the world
size change. Per sync, as verl's engine: ``prepare`` allocates the buckets, the sender fills one bucket at a
time and broadcasts its metadata (JSON, ``wire_messages``) and then its bytes; ``finalize`` frees the
buckets and keeps the group. The buckets are allocated in ``init_process_group`` by the group's members only
(the actor ranks left out hold none). Every collective waits at most ``timeout_s``.
"""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import uuid
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import torch
import torch.distributed as dist

from .wire_codec import TransferStats, WireFormatError
from .wire_messages import MAX_META_BYTES, REPORT_BYTES, decode_bucket_meta, encode_bucket_meta

logger = logging.getLogger("qurl_verl")

TRANSPORT = "gloo"
_SIZES = 3  # int64 header before each bucket: metadata bytes, payload bytes, is_last


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # noqa: BLE001 - outside Ray: the loopback address
        pass
    return "127.0.0.1"


class GlooTransport:
    def __init__(self, bucket_size: int, is_master: bool, timeout_s: float) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.member = uuid.uuid4().hex  # this engine among the group's members
        self.store: dist.TCPStore | None = None
        self.endpoint: tuple[str, int] | None = None
        self.group = None
        self.group_id: tuple[int, int, str] | None = None  # (rank, world size, members) of ``group``
        self.rank: int | None = None
        self.world_size: int | None = None
        self.buffers: list[torch.Tensor] = []

    num_senders = 1  # actor rank 0 alone: no relays

    # ---- topology ------------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        meta = {"transport": TRANSPORT, "member": self.member}
        if self.is_master:
            if self.store is None:
                host = node_ip()
                self.store = dist.TCPStore(host, 0, None, True, timeout=self.timeout, wait_for_workers=False)
                self.endpoint = (host, self.store.port)
            meta.update(host=self.endpoint[0], port=self.endpoint[1])
        return meta

    @staticmethod
    def build_topology(actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        master = metadata[0]
        if not master.get("port"):
            raise ValueError("qurl_int8: actor rank 0 must be the checkpoint engine master (is_master=True)")
        world_size = 1 + rollout_world_size
        members = [master["member"], *(m["member"] for m in metadata[actor_wg_world_size:])]
        group = {"host": master["host"], "port": master["port"],
                 "members": hashlib.sha256(",".join(members).encode()).hexdigest()[:16]}
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world_size] * actor_wg_world_size,
                 "master_metadata": [group] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world_size)), "world_size": [world_size] * rollout_world_size,
                   "master_metadata": [group] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        self.rank, self.world_size = rank, world_size
        if rank < 0:  # left out: no buckets, no group
            return
        self.buffers = [torch.empty(self.bucket_size, dtype=torch.uint8) for _ in range(2)]
        endpoint = (master_metadata["host"], int(master_metadata["port"]))
        if self.store is None or endpoint != self.endpoint:
            self.store = dist.TCPStore(*endpoint, None, False, timeout=self.timeout)
            self.endpoint, self.group = endpoint, None
        group_id = (rank, world_size, master_metadata["members"])
        if self.group is None or group_id != self.group_id:
            # a fresh prefix for each build of the same members (a group rebuilt after a change and back)
            builds = self.store.add(f"qurl_int8/builds/{group_id[2]}/{rank}", 1)
            prefix = f"qurl_int8/{group_id[2]}/{world_size}/{builds}/"
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), rank, world_size, self.timeout)
            self.group_id = group_id
            logger.info("qurl_int8: gloo group built (rank %d of %d)", rank, world_size)

    def finalize(self) -> None:
        self.buffers = []

    # ---- collectives ---------------------------------------------------------------------------------------
    async def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        await asyncio.to_thread(self.group.broadcast([tensor], opts).wait)

    async def gather_reports(self, packed: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.zeros(REPORT_BYTES, dtype=torch.uint8) for _ in range(self.world_size)]
        await asyncio.to_thread(self.group.allgather([out], [packed]).wait)
        return out

    async def _send_bucket(self, buf: torch.Tensor, entries: list, length: int, is_last: bool,
                           stats: TransferStats) -> None:
        meta = encode_bucket_meta(entries, length, is_last)
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"qurl_int8: a bucket's metadata takes {len(meta)} bytes (at most {MAX_META_BYTES}); "
                             "lower update_weights_bucket_megabytes")
        await self._broadcast(torch.tensor([len(meta), length, int(is_last)], dtype=torch.int64))
        await self._broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        if length:
            await self._broadcast(buf[:length])
        stats.meta_bytes += 8 * _SIZES + len(meta)
        stats.payload_bytes += length
        stats.buckets += 1

    async def send(self, encoded: Iterable[tuple[str, torch.Tensor]], stats: TransferStats) -> None:
        from verl.checkpoint_engine.base import split_weight_chunks

        buf, spare = self.buffers
        entries, offset = [], 0
        async for meta, chunk in split_weight_chunks(encoded, self.bucket_size):
            if offset + meta.chunk_size > self.bucket_size:
                await self._send_bucket(buf, entries, offset, False, stats)
                buf, spare = spare, buf
                entries, offset = [], 0
            entries.append((meta.name, tuple(meta.shape), meta.dtype, meta.chunk_offset, meta.chunk_size, offset))
            buf[offset: offset + meta.chunk_size].copy_(chunk)
            offset += meta.chunk_size
        await self._send_bucket(buf, entries, offset, True, stats)

    async def receive_chunks(self, stats: TransferStats) -> AsyncGenerator:
        """verl's ``(TensorMeta, chunk)`` pairs, each a view into one of two buckets (valid until the bucket after
        next arrives, as with verl's engine); a bucket's metadata is validated before any of it is yielded."""
        from verl.checkpoint_engine.base import TensorMeta

        buf, spare = self.buffers
        while True:
            sizes = torch.zeros(_SIZES, dtype=torch.int64)
            await self._broadcast(sizes)
            meta_len, length, is_last = (int(v) for v in sizes.tolist())
            if not 0 < meta_len <= MAX_META_BYTES or not 0 <= length <= self.bucket_size:
                raise WireFormatError(f"qurl_int8: refused a bucket header of {meta_len} metadata and {length} "
                                      f"payload bytes (at most {MAX_META_BYTES} and {self.bucket_size})")
            blob = torch.zeros(meta_len, dtype=torch.uint8)
            await self._broadcast(blob)
            entries, meta_length, meta_last = decode_bucket_meta(blob.numpy().tobytes(), self.bucket_size)
            if meta_length != length or meta_last != bool(is_last):
                raise WireFormatError("qurl_int8: refused a bucket whose metadata disagrees with its header")
            if length:
                await self._broadcast(buf[:length])
            stats.meta_bytes += 8 * _SIZES + meta_len
            stats.payload_bytes += length
            stats.buckets += 1
            for name, shape, dtype, chunk_offset, chunk_size, offset in entries:
                yield (TensorMeta(name=name, shape=torch.Size(shape), dtype=dtype, chunk_offset=chunk_offset,
                                  chunk_size=chunk_size, offset=offset), buf[offset: offset + chunk_size])
            if is_last:
                return
            buf, spare = spare, buf
