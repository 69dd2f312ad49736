"""``qurl_int8``: an 8-bit weight sync for verl's disaggregated rollouts, as a verl checkpoint engine.

Trainer side (``send_weights``, actor rank 0): the trainer's tensors are quantized where they are, with
the same ``quantize_state_dict`` and ignore rule the ``qurl_vllm`` worker uses (``RolloutSettings``:
per-channel scales from whole rows, or 128 x 128 blocks for fp8_block), and the codes, their fp32
``weight_scale`` and the full-precision rest are packed into byte buckets and broadcast to every rollout
worker. Rollout side (``receive_weights``): the tensors are yielded as they arrived; verl hands them to
the ``qurl_vllm`` worker, whose stream loads tensors that are already 8-bit (with their scale) as they
are, without quantizing again.

The group is the engine's own, rebuilt at every sync: actor rank 0 (rank 0) plus every rollout worker,
over a ``TCPStore`` hosted by rank 0 on a port chosen in ``prepare``; gloo on CPU, NCCL on CUDA, built
directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), so it neither joins nor reuses the default
group that both sides already own. Bucket metadata (names, shapes, dtypes, offsets) travels in the same
group before each bucket's bytes.

What reaches the logger: verl keeps only the sender's return value. It carries the transfer's bytes, times and
the checksum of what was sent, and, gathered from the rollout ranks at the start of each sync, their report of
the previous one (what the ``qurl_vllm`` workers loaded, under the colocated sync's ``actor/qurl/sync/*`` names,
one sync late): a report exists only once the rollout has loaded the weights, after the sender returned.

The trainer side needs the rollout's quantization: ``engine_kwargs.qurl_int8`` carries it
(``quantization``, ``ignore``, ``weight_bits``, ``experts``), and the driver refuses a run whose
engine_kwargs disagree with ``actor_rollout_ref.rollout`` (``qurl_verl.driver.checks``).
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import pickle
import socket
import time
from collections.abc import AsyncGenerator, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)

from qurl_verl.quant.compressed_tensors_format import quantize_state_dict
from qurl_verl.rollout.sync_stats import StreamStats, rollout_report_metrics, take_rollout_report

from .engine_settings import ENGINE_NAME, rollout_settings

logger = logging.getLogger("qurl_verl")

REST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # codes are int8/fp8, scales keep fp32


@dataclass
class TransferStats:
    """One sync as one side saw it: payload (tensor bytes) and metadata bytes through the group."""

    payload_bytes: int = 0
    meta_bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    quantized: int = 0
    seconds: float = 0.0
    quantize_s: float = 0.0
    dtype_bytes: dict[str, int] = field(default_factory=dict)
    # the sender's checksum of what it sent, by name (``StreamStats.add_checksum``): the rollout's stream reports
    # the same number for what it handed its engine when the codes arrived bit for bit
    checksum: int = 0

    def metrics(self, prefix: str = "qurl_sync") -> dict[str, float]:
        return {
            f"{prefix}/payload_bytes": float(self.payload_bytes),
            f"{prefix}/meta_bytes": float(self.meta_bytes),
            f"{prefix}/buckets": float(self.buckets),
            f"{prefix}/quantized_tensors": float(self.quantized),
            f"{prefix}/seconds": self.seconds,
            f"{prefix}/quantize_s": self.quantize_s,
            f"{prefix}/checksum": float(self.checksum),
        }


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # noqa: BLE001 - outside Ray: the loopback address
        pass
    return "127.0.0.1"


@CheckpointEngineRegistry.register(ENGINE_NAME)
class QurlInt8CheckpointEngine(CheckpointEngine):
    """Trainer-side quantization, 8-bit codes + scales over a group of the engine's own.

    Args:
        bucket_size: bytes per broadcast bucket (verl's ``update_weights_bucket_megabytes``).
        is_master: actor rank 0, the one sender (verl sets it on the trainer side).
        quantization, ignore, weight_bits, experts: the rollout's ``RolloutSettings`` (``engine_kwargs``).
        rest_dtype: the dtype the full-precision rest (embeddings, lm_head, norms, biases) is sent in; None
            (default): as the trainer holds it. The rollout's own dtype (``rollout.dtype``, the driver checks it)
            loses nothing: the worker casts the rest to its parameters' dtype anyway.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL); default: cuda where available.
        timeout_s: the group's timeout.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, quantization: str = "int8",
                 ignore: Iterable[str] = (), weight_bits: int = 8, experts: str = "bf16",
                 rest_dtype: str | None = None, device: str | None = None, timeout_s: float = 600.0) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.settings = rollout_settings(quantization, ignore, weight_bits, experts)
        if not self.settings.quantized:
            raise ValueError(f"checkpoint_engine.backend={ENGINE_NAME} sends 8-bit codes; quantization="
                             f"{self.settings.format.value} has none (use nccl or naive for a bf16 rollout)")
        self.rest_dtype = getattr(torch, rest_dtype) if rest_dtype else None
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rank: int | None = None
        self.world_size: int | None = None
        self.group = None
        self.store = None
        self.last_stats = TransferStats()
        self._endpoint: tuple[str, int] | None = None
        self._syncs = 0

    # ---- topology -------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any] | None:
        """Actor rank 0 picks the endpoint of this sync's store; every other worker reports nothing."""
        if not self.is_master:
            return None
        host = local_ip()
        self._endpoint = (host, free_port(host))
        return {"host": host, "port": self._endpoint[1]}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        master = metadata[0]
        assert master is not None, "actor rank 0 must be the checkpoint engine master"
        world_size = 1 + rollout_world_size
        actor = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "master_metadata": [master] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master_metadata": [master] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        """A fresh group for this sync: rank 0 hosts the store, gloo on CPU, NCCL on CUDA."""
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        self.store = dist.TCPStore(master_metadata["host"], int(master_metadata["port"]), world_size,
                                   is_master=rank == 0, timeout=self.timeout, wait_for_workers=False)
        if self.device.type == "cuda":
            torch.cuda.set_device(torch.cuda.current_device())
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, self.timeout)
        self._syncs += 1

    def finalize(self) -> None:
        self.group = None
        self.store = None
        self._endpoint = None

    # ---- transport ------------------------------------------------------------------------------------
    async def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self.group.broadcast([tensor], opts)
        await asyncio.to_thread(work.wait)

    async def _send_bucket(self, buf: torch.Tensor, length: int, meta: dict, stats: TransferStats) -> None:
        blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(self.device)
        await self._broadcast(torch.tensor([blob.numel(), length], dtype=torch.int64, device=self.device))
        await self._broadcast(blob)
        if length:
            await self._broadcast(buf[:length])
        stats.meta_bytes += 16 + blob.numel()
        stats.payload_bytes += length
        stats.buckets += 1

    async def _receive_bucket(self, stats: TransferStats) -> tuple[dict, torch.Tensor]:
        sizes = torch.empty(2, dtype=torch.int64, device=self.device)
        await self._broadcast(sizes)
        meta_len, length = (int(v) for v in sizes.tolist())
        blob = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
        await self._broadcast(blob)
        meta = pickle.loads(blob.cpu().numpy().tobytes())
        # a fresh buffer per bucket: what was yielded stays valid while the consumer holds it
        buf = torch.empty(length, dtype=torch.uint8, device=self.device)
        if length:
            await self._broadcast(buf)
        stats.meta_bytes += 16 + meta_len
        stats.payload_bytes += length
        stats.buckets += 1
        return meta, buf

    async def _gather_reports(self, report: tuple[int, dict] | None) -> list[tuple[int, dict]]:
        """Every rank's report of the previous sync (the rollout adapters'; none from the sender), gathered at
        the start of this one: the sender's return value is the channel verl keeps to the logger."""
        blob = torch.frombuffer(bytearray(pickle.dumps(report)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        await asyncio.to_thread(self.group.allgather([sizes], [torch.tensor([blob.numel()], device=self.device)]).wait)
        longest = max(int(t.item()) for t in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: blob.numel()].copy_(blob)
        blobs = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        await asyncio.to_thread(self.group.allgather([blobs], [padded]).wait)
        reports = (pickle.loads(b[: int(n.item())].cpu().numpy().tobytes()) for b, n in zip(blobs, sizes))
        return [r for r in reports if r is not None]

    def quantized_stream(self, weights: Iterable[tuple[str, torch.Tensor]],
                         stats: TransferStats | None = None) -> Generator[tuple[str, torch.Tensor], None, None]:
        """What goes on the wire: ``quantize_state_dict`` of the trainer's tensors, as the worker would run it."""
        s = self.settings
        clock = time.perf_counter
        checksum = StreamStats() if stats is not None else None
        it = iter(quantize_state_dict(weights, s.quant_scheme, ignore=s.ignore_patterns))
        while True:
            start = clock()
            try:
                name, tensor = next(it)
            except StopIteration:
                if stats is not None:
                    stats.checksum = checksum.checksum
                return
            if stats is not None:
                stats.quantize_s += clock() - start
                stats.tensors += 1
                stats.quantized += name.endswith("weight_scale")
            if self.rest_dtype is not None and tensor.dtype in REST_DTYPES and not name.endswith("weight_scale"):
                tensor = tensor.to(self.rest_dtype)
            tensor = tensor.detach().to(self.device).contiguous()
            if checksum is not None:
                checksum.add_checksum(((name, tensor),))
            yield name, tensor

    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        assert self.rank is not None and self.rank <= 0, "rollout workers do not send weights"
        if self.rank < 0:  # left out of the group: producing each weight is collective over the actor group
            for _ in weights:
                pass
            return {}
        reports = await self._gather_reports(None)
        stats = TransferStats()
        start = time.perf_counter()
        buf = torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device)
        bucket: dict[str, TensorMeta] = {}
        offset = 0
        async for meta, chunk in split_weight_chunks(self.quantized_stream(weights, stats), self.bucket_size):
            if offset + meta.chunk_size > self.bucket_size or meta.name in bucket:
                await self._send_bucket(buf, offset, {"bucket_meta": bucket, "is_last": False}, stats)
                bucket, offset = {}, 0
            meta.offset = offset
            bucket[meta.name] = meta
            buf[offset: offset + meta.chunk_size].copy_(chunk)
            offset += meta.chunk_size
            key = str(meta.dtype).removeprefix("torch.")
            stats.dtype_bytes[key] = stats.dtype_bytes.get(key, 0) + meta.chunk_size
        await self._send_bucket(buf, offset, {"bucket_meta": bucket, "is_last": True}, stats)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        logger.info("qurl_int8 sync %s: %d payload bytes in %d buckets, %.2fs", global_steps,
                    stats.payload_bytes, stats.buckets, stats.seconds)
        return {**stats.metrics(), **self._rollout_metrics(reports)}

    @staticmethod
    def _rollout_metrics(reports: list[tuple[int, dict]]) -> dict[str, float]:
        """The rollout's reports of the previous sync under the colocated sync's names (one sync late: a report
        exists once the rollout has loaded the weights, after the sender returned)."""
        if not reports:
            return {}
        from qurl_verl.rollout import features

        return {**rollout_report_metrics(reports, features.stats_types()), "qurl_sync/rollout_reports": float(len(reports))}

    async def _receive_chunks(self, stats: TransferStats) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        assert self.rank is not None and self.rank > 0, "actor rank 0 does not receive weights"
        while True:
            meta, buf = await self._receive_bucket(stats)
            for tensor_meta in meta["bucket_meta"].values():
                stats.tensors += 1
                yield tensor_meta, buf[tensor_meta.offset: tensor_meta.offset + tensor_meta.chunk_size]
            if meta["is_last"]:
                return

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield the tensors as they arrived: 8-bit codes with their ``weight_scale``, the rest as sent."""
        await self._gather_reports(take_rollout_report())
        stats = TransferStats()
        start = time.perf_counter()
        async for name, tensor in merge_weight_chunks(self._receive_chunks(stats), self.bucket_size):
            yield name, tensor
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
