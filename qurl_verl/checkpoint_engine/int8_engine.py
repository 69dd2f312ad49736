"""``qurl_int8``: an 8-bit weight sync for verl's disaggregated rollouts, as a verl checkpoint engine.

The codec is the project's (``wire_codec``): on the trainer side (``send_weights``) the trainer's tensors are
quantized where they are, with the same ``quantize_state_dict`` and ignore rule the ``qurl_vllm`` worker uses
(``RolloutSettings``), the rest cast to the rollout's dtype, a tied ``lm_head.weight`` left out, each tensor
aligned for verl's buckets; on the rollout side (``receive_weights``) the tensors come back as they were
encoded and verl hands them to the ``qurl_vllm`` worker, whose stream loads 8-bit tensors (with their scale)
as they are, without quantizing again.

The transport: on CUDA verl's own ``NCCLCheckpointEngine`` (``nccl_transport``: its group, buffers, zmq
metadata channel and synchronization); on CPU a gloo transport of the same shape (``gloo_transport``).
``build_topology`` follows what ``prepare`` returned: verl's ``WorkerMetadata`` on CUDA, a plain dict on CPU.

What reaches the logger: verl keeps only the sender's return value. It carries this sync's bytes, times and
the checksum of what was encoded (``qurl_sync/*``), and the rollout's reports of the previous sync under
``qurl_sync/rollout/*`` (what the ``qurl_vllm`` workers loaded: a report exists only once the rollout has
loaded the weights, after the sender returned), gathered at the start of each sync from every group member as
fixed-size plain-data tensors (``wire_messages``).

The trainer side needs the rollout's quantization, which verl does not hand an engine: ``engine_kwargs.qurl_int8``
carries it (``quantization``, ``ignore``, ``weight_bits``, ``experts``), the driver fills ``rest_dtype`` and
``tie_word_embeddings`` from the run's config and model, and refuses engine_kwargs that disagree with
``actor_rollout_ref.rollout`` (``qurl_verl.driver.int8_sync_checks``).

Delta mode (``engine_kwargs.qurl_int8.delta=true``, off by default): the sender's rank 0 and every receiving rank
keep the last sync's tensors in host memory and a sync after the first carries per tensor only its changed
elements (``delta_sync``, ``delta_codec``); the receiver rebuilds the full tensors, which go to the same reload
path. The receivers' reports carry the sync their copy holds and its checksum (beside the rollout's own
report), and the sender decides from them, before it encodes, whether this sync must be full. On CUDA the
delta mode sends from rank 0 alone (no relays: a relay would need the same copy and the same decision).
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Generator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry, merge_weight_chunks

from qurl_verl.rollout.sync_stats import rollout_report_metrics, take_rollout_report
from qurl_verl.tied_lm_head import TIED_LM_HEAD_NAMES

from .delta_sync import DeltaReceiver, DeltaSender, DeltaSyncStats, ReplicaReport, SyncMode
from .engine_settings import ENGINE_NAME, delta_settings_error, rollout_settings
from .gloo_transport import TRANSPORT as GLOO
from .gloo_transport import GlooTransport
from .wire_codec import ALIGN_BYTES, REST_DTYPES, TransferStats, WireEncoder, WireFormatError, aligned, decode
from .wire_messages import pack_report, unpack_report

logger = logging.getLogger("qurl_verl")

ROLLOUT_METRICS_PREFIX = "qurl_sync/rollout/"
DELTA_REPORT_KEYS = tuple(ReplicaReport().as_numbers())  # the delta state in a receiver's report, not a metric


@CheckpointEngineRegistry.register(ENGINE_NAME)
class QurlInt8CheckpointEngine(CheckpointEngine):
    """Trainer-side quantization; 8-bit codes + scales over verl's NCCL engine (CUDA) or a gloo group (CPU).

    Args:
        bucket_size: bytes per bucket (verl's ``update_weights_bucket_megabytes``), a multiple of 16.
        is_master: actor rank 0, the sender (verl sets it on the trainer side).
        quantization, ignore, weight_bits, experts: the rollout's ``RolloutSettings`` (``engine_kwargs``).
        rest_dtype: the dtype of the full-precision rest (embeddings, norms, biases, kept linears); default
            bfloat16, verl's default ``rollout.dtype`` (the driver sets the run's): the worker casts the rest to
            its parameters' dtype anyway. None: as the trainer holds it.
        tie_word_embeddings: the model ties lm_head to the embedding, so ``lm_head.weight`` is not sent (the
            rollout drops it). Default False: sent, which is right for any model (the driver sets the model's).
        device: ``cuda`` (verl's NCCL engine) or ``cpu`` (gloo); default: cuda where available.
        timeout_s: the gloo group's timeout (verl's NCCL group keeps Ray's).
        multi_sender: verl's NCCL option (relays on rank 0's node); every relay encodes as rank 0 does. Off in
            the delta mode.
        delta: send only what changed since the last sync (``delta_sync``); default False.
        full_sync_every: with ``delta``, a full sync every K syncs (0: only when forced).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, quantization: str = "int8",
                 ignore: Iterable[str] = (), weight_bits: int = 8, experts: str = "bf16",
                 rest_dtype: str | None = "bfloat16", tie_word_embeddings: bool = False, device: str | None = None,
                 timeout_s: float = 600.0, multi_sender: bool = True, delta: bool = False,
                 full_sync_every: int = 0) -> None:
        self.bucket_size = int(bucket_size)
        if self.bucket_size <= 0 or self.bucket_size % ALIGN_BYTES:
            raise ValueError(f"{ENGINE_NAME}: bucket_size={bucket_size} must be a positive multiple of {ALIGN_BYTES} "
                             "bytes (update_weights_bucket_megabytes is)")
        self.is_master = is_master
        self.settings = rollout_settings(quantization, ignore, weight_bits, experts)
        if not self.settings.quantized:
            raise ValueError(f"checkpoint_engine.backend={ENGINE_NAME} sends 8-bit codes; quantization="
                             f"{self.settings.format.value} has none (use nccl or naive for a bf16 rollout)")
        rest = getattr(torch, rest_dtype, None) if rest_dtype else None
        if rest_dtype and rest not in REST_DTYPES:
            raise ValueError(f"{ENGINE_NAME}: rest_dtype={rest_dtype!r} is none of "
                             f"{[str(d).removeprefix('torch.') for d in REST_DTYPES]} (set the rollout's dtype)")
        problem = delta_settings_error(delta, full_sync_every)
        if problem:
            raise ValueError(f"{ENGINE_NAME}: {problem}")
        self.delta_sender = DeltaSender(full_sync_every) if delta else None
        self.delta_receiver = DeltaReceiver() if delta else None
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda":
            from .nccl_transport import NcclTransport

            self.transport = NcclTransport(self.bucket_size, is_master, multi_sender=multi_sender and not delta)
        else:
            self.transport = GlooTransport(self.bucket_size, is_master, timeout_s)
        self.encoder = WireEncoder(self.settings, rest_dtype=rest,
                                   skip=frozenset(TIED_LM_HEAD_NAMES) if tie_word_embeddings else frozenset(),
                                   device=getattr(self.transport, "device", torch.device("cpu")))
        self.last_stats = TransferStats()

    @property
    def on_cuda(self) -> bool:
        return not isinstance(self.transport, GlooTransport)

    # ---- topology ------------------------------------------------------------------------------------------
    def prepare(self) -> Any:
        return self.transport.prepare()

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        """The gloo transport's when ``prepare`` returned its plain dict, verl's NCCL engine's otherwise; every worker
        must have prepared the same transport (one ``device`` for the trainer and the rollout sides)."""
        on_gloo = [isinstance(m, dict) and m.get("transport") == GLOO for m in metadata]
        if any(on_gloo) and not all(on_gloo):
            workers = [i for i, gloo in enumerate(on_gloo) if gloo != on_gloo[0]]
            raise ValueError(
                f"{ENGINE_NAME}: the workers prepared different transports (worker 0 {'gloo' if on_gloo[0] else 'NCCL'}, "
                f"workers {workers} the other): the trainer and the rollout sides must run on the same device type. "
                f"Set engine_kwargs.{ENGINE_NAME}.device to cpu or cuda for both, or leave it unset on GPU machines")
        if on_gloo[0]:
            return GlooTransport.build_topology(actor_wg_world_size, rollout_world_size, metadata)
        from .nccl_transport import NcclTransport

        return NcclTransport.build_topology(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(self, **kwargs) -> None:
        self.transport.init_process_group(**kwargs)

    def finalize(self) -> None:
        self.transport.finalize()

    # ---- reports -------------------------------------------------------------------------------------------
    async def _gather_reports(self, report: tuple[int, dict] | None) -> list[torch.Tensor]:
        """Every member's packed report of the previous sync (the rollout's; none from the actor side), gathered
        at the start of this one as fixed-size tensors (``unpack_reports`` reads them)."""
        return await self.transport.gather_reports(pack_report(report))

    @staticmethod
    def unpack_reports(gathered: list[torch.Tensor]) -> list[tuple[int, dict]]:
        """The reports, validated (``WireFormatError`` on a malformed one); the sender reads them after its sync,
        so that a refused report fails the trainer's call without leaving the rollout waiting for buckets."""
        return [r for r in map(unpack_report, gathered) if r is not None]

    def _delta_reports(self, gathered: list[torch.Tensor]) -> list[ReplicaReport | None]:
        """Each receiving rank's delta state, read before this sync is encoded; a report that does not parse
        counts as missing (a full sync), and is refused after the sync as any malformed report is."""
        states = []
        for packed in gathered[self.transport.num_senders:]:
            try:
                report = unpack_report(packed)
            except WireFormatError:
                report = None
            states.append(ReplicaReport.from_numbers(report[1]) if report else None)
        return states

    @staticmethod
    def _without_delta_state(reports: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
        """The rollout's own reports: the delta state taken out, a report that held nothing else dropped."""
        out = []
        for replica, stats in reports:
            kept = {k: v for k, v in stats.items() if k not in DELTA_REPORT_KEYS}
            if kept or len(kept) == len(stats):
                out.append((replica, kept))
        return out

    def _report_with_delta_state(self) -> tuple[int, dict] | None:
        """The rollout's report of the previous sync, with this rank's delta state (its own, when the rollout
        has none to give)."""
        report = take_rollout_report()
        if self.delta_receiver is None:
            return report
        replica, stats = report if report is not None else (max(0, (self.transport.rank or 0) - 1), {})
        return replica, {**stats, **self.delta_receiver.report().as_numbers()}

    @staticmethod
    def _rollout_metrics(reports: list[tuple[int, dict]]) -> dict[str, float]:
        if not reports:
            return {}
        from qurl_verl.rollout import features

        return {**rollout_report_metrics(reports, features.stats_types(), prefix=ROLLOUT_METRICS_PREFIX),
                "qurl_sync/rollout_reports": float(len(reports))}

    # ---- the sync ------------------------------------------------------------------------------------------
    def encoded(self, weights: Iterable[tuple[str, torch.Tensor]], stats: TransferStats,
                delta: tuple[SyncMode, DeltaSyncStats] | None = None) -> Generator[tuple[str, torch.Tensor], None, None]:
        if delta is None:
            stream = self.encoder.encode(weights, stats)
        else:
            tensors = self.delta_sender.encode(self.encoder.model_tensors(weights, stats), *delta,
                                               checksum_of_tensors=lambda: stats.checksum)
            stream = (pair for name, tensor in tensors for pair in aligned(name, tensor))
        if self.on_cuda:
            from .nccl_transport import counted

            stream = counted(stream, self.bucket_size, stats)
        return stream

    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        rank = self.transport.rank
        assert rank is not None and rank < self.transport.num_senders, "rollout workers do not send weights"
        if rank < 0:  # left out of the group: producing each weight is collective over the actor group
            if self.on_cuda:
                await self.transport.send(weights)
            else:
                for _ in weights:
                    pass
            return {}
        gathered = await self._gather_reports(None)
        stats, delta = TransferStats(), None
        if self.delta_sender is not None:
            mode, reason = self.delta_sender.plan(self._delta_reports(gathered))
            delta = (mode, DeltaSyncStats(reason=reason))
            if reason and mode is SyncMode.FULL and self.delta_sender.last_sync:
                logger.warning("qurl_int8 sync %s: a full sync (%s)", global_steps, reason)
        start = time.perf_counter()
        if self.on_cuda:
            await self.transport.send(self.encoded(weights, stats, delta))  # relays (rank > 0) encode alike
        else:
            await self.transport.send(self.encoded(weights, stats, delta), stats)
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        if rank > 0:
            return {}
        logger.info("qurl_int8 sync %s: %d payload bytes in %d buckets, %.2fs", global_steps,
                    stats.payload_bytes, stats.buckets, stats.seconds)
        delta_metrics = delta[1].metrics() if delta is not None else {}
        reports = self._without_delta_state(self.unpack_reports(gathered))
        return {**stats.metrics(), **delta_metrics, **self._rollout_metrics(reports)}

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The tensors as they were encoded: 8-bit codes with their ``weight_scale``, the rest in ``rest_dtype``."""
        await self._gather_reports(self._report_with_delta_state())
        stats = TransferStats()
        start = time.perf_counter()
        if self.on_cuda:
            merged = self._counted_received(self.transport.receive(), stats)
        else:
            merged = merge_weight_chunks(self.transport.receive_chunks(stats), self.bucket_size)
        if self.delta_receiver is None:
            async for name, tensor in decode(merged, stats):
                yield name, tensor
        else:
            async for full in self.delta_receiver.apply_async(decode(merged, stats)):
                yield full
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats

    @staticmethod
    async def _counted_received(received, stats: TransferStats):
        async for name, tensor in received:
            stats.payload_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor
