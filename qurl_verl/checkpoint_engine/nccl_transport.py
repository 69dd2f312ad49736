"""The ``qurl_int8`` transport on CUDA: verl's own ``NCCLCheckpointEngine`` (verl 0.9.1), unchanged.

The engine hands verl's ``send_weights`` the codec's encoded generator and decodes what verl's
``receive_weights`` yields, as verl's ``DeltaShardedCheckpointEngine`` reuses the same transport. verl keeps
everything else: the group's life (``rebuild_group=False``: built once, kept across syncs), the two
bucket buffers per sync, its zmq metadata channel (trainer to rollout, verl's own objects, as in a stock run),
the CUDA synchronizations and ``empty_cache`` in ``finalize``.

Relays: with ``multi_sender`` (verl's default, True) the actor ranks on rank 0's node join the group and
recompute the bucket boundaries from their own generator (``_relay_weights``), so they must see the same
encoded sizes as rank 0: every actor rank in the group hands verl the same codec's output (the real encode,
whose sizes depend on shapes and settings only). Ranks left out (-1) hand verl the raw stream, which verl
only drains.

verl's module imports cupy at its top, ``ray.util.collective`` and this module's CUDA calls are imported or
made only when the transport is built, so the package imports on a machine without either.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import torch

from .wire_messages import REPORT_BYTES

GROUP_NAME = "qurl_int8"  # the ray.util.collective group (verl's own engines use "default")


def nccl_engine_class():
    """verl's ``NCCLCheckpointEngine`` (imports cupy)."""
    from verl.checkpoint_engine.nccl_checkpoint_engine import NCCLCheckpointEngine

    return NCCLCheckpointEngine


def worker_metadata_class():
    from verl.checkpoint_engine.nccl_checkpoint_engine import WorkerMetadata

    return WorkerMetadata


def transport_device() -> torch.device:
    """The GPU verl's worker selected for this process."""
    return torch.device("cuda", torch.cuda.current_device())


def synchronize() -> None:
    torch.cuda.synchronize()


class NcclTransport:
    def __init__(self, bucket_size: int, is_master: bool, multi_sender: bool = True) -> None:
        self.engine = nccl_engine_class()(bucket_size, group_name=GROUP_NAME, rebuild_group=False,
                                          is_master=is_master, multi_sender=multi_sender)
        self.device = transport_device()

    @property
    def rank(self) -> int | None:
        return getattr(self.engine, "rank", None)

    @property
    def num_senders(self) -> int:
        return self.engine.num_senders

    def prepare(self) -> Any:
        return self.engine.prepare()

    @staticmethod
    def build_topology(actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        return nccl_engine_class().build_topology(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(self, **kwargs) -> None:
        self.engine.init_process_group(**kwargs)

    def finalize(self) -> None:
        self.engine.finalize()

    async def gather_reports(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Every group member's packed report (relays send an empty one), through verl's collective group."""
        import ray.util.collective as collective

        mine = packed.to(self.device)
        out = [torch.zeros(REPORT_BYTES, dtype=torch.uint8, device=self.device)
               for _ in range(self.engine.world_size)]
        # in a thread, as verl runs its broadcasts: the caller's event loop stays free while the group gathers
        await asyncio.to_thread(collective.allgather, out, mine, group_name=GROUP_NAME)
        synchronize()
        return [t.cpu() for t in out]

    async def send(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        await self.engine.send_weights(stream)

    def receive(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        return self.engine.receive_weights()


def counted(stream: Iterable[tuple[str, torch.Tensor]], bucket_size: int, stats) -> Iterable[tuple[str, torch.Tensor]]:
    """``stream`` unchanged, its buckets counted as verl's sender cuts them (``split_weight_chunks``, then a new
    bucket where a chunk would overflow): payload bytes and buckets exactly; metadata bytes as the same bucket
    metadata takes in JSON (verl pickles its own, of the same order)."""
    from .wire_messages import encode_bucket_meta

    entries, offset = [], 0
    for name, tensor in stream:
        nbytes = tensor.numel() * tensor.element_size()
        for chunk_offset in range(0, nbytes, bucket_size):
            size = min(bucket_size, nbytes - chunk_offset)
            if offset + size > bucket_size:
                stats.meta_bytes += len(encode_bucket_meta(entries, offset, False))
                stats.buckets += 1
                entries, offset = [], 0
            entries.append((name, tuple(tensor.shape), tensor.dtype, chunk_offset, size, offset))
            offset += size
        stats.payload_bytes += nbytes
        yield name, tensor
    stats.meta_bytes += len(encode_bucket_meta(entries, offset, True))
    stats.buckets += 1
