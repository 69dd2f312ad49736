"""vLLM worker side of `qurl_vllm`: rebuild the 8-bit rollout copy from the trainer's weights.

One weight sync is one pass of vLLM's layerwise-reload lifecycle
(``vllm/model_executor/model_loader/reload/layerwise.py``):

    initialize_layerwise_reload(model)             once: layers back to checkpoint format, on meta
    per bucket: model.load_weights(quantize(bucket))   each layer is post-processed (int8 prepack,
                                                   transposes) as soon as all its tensors arrived
    finalize_layerwise_reload(model, model_config) once: leftovers and attention layers
    + checks: every layer fully streamed, nothing left on meta, weight scales finite and > 0

On CPU, three vLLM-CPU work-arounds (``qurl_verl.patches``): before the model loads, the oneDNN
weight-scale keep-alive (needed by every reload) and exact INT8 GEMMs on CPUs whose oneDNN int8
kernel saturates (no VNNI); after every reload, the tied lm_head refresh.

vLLM copies the processed tensors into the storage the engine already uses, so CUDA graphs and
compiled code keep valid pointers. Between initialize and finalize the model is half on ``meta``:
an exception there leaves the engine unusable, so it is fatal. The engine is poisoned (its next
forward raises) and every later sync refuses to run, instead of generating from a broken model.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import psutil
import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.weight_update_utils import apply_buffer_updates

from qurl_verl.patches.vllm_cpu_worker import (
    vllm_cpu_int8_saturation,
    vllm_cpu_onednn_scale_keepalive,
    vllm_cpu_tied_lm_head_refresh,
)
from qurl_verl.quant import UpdateVisibilityTracker
from qurl_verl.settings import RolloutSettings
from qurl_verl.rollout.weight_stream import WeightStreamQuantizer

logger = logging.getLogger("qurl_verl")


class WeightReloadError(RuntimeError):
    """A weight sync failed part-way; the engine holds no usable model any more."""


@dataclass
class SyncStats:
    """Cost of one weight sync inside the vLLM worker (seconds; bytes as received)."""

    sync: int
    format: str
    total_s: float = 0.0
    quantize_s: float = 0.0
    copy_s: float = 0.0
    load_s: float = 0.0  # model.load_weights, including each layer's post-processing (prepack)
    finalize_s: float = 0.0
    buckets: int = 0
    tensors_in: int = 0
    quantized: int = 0
    bytes_in: int = 0
    rss_mb: float = 0.0  # worker resident memory after the sync, to watch for leaks
    # QuRL's weight-update problem: share of the tracked 8-bit codes this sync changed, and
    # ||W_new - W_prev|| / ||Q(W_prev) - W_prev|| (None on the first sync or with tracking off)
    code_change_s: float = 0.0
    changed_code_frac: float | None = None
    update_to_error_ratio: float | None = None

    def as_metrics(self, prefix: str = "qurl/sync/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in asdict(self).items() if k != "format" and v is not None}


class QurlWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension, with weight syncs going through layerwise reload."""

    def __new__(cls, **kwargs):
        instance = super().__new__(cls, **kwargs)
        cls._install_cpu_patches()
        instance._qurl_syncs = 0
        instance._qurl_last_sync = None
        instance._qurl_broken = None
        instance._qurl_tracker = None
        return instance

    @classmethod
    def _install_cpu_patches(cls) -> None:
        """Process-wide vLLM-CPU fixes, before the model is built."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            vllm_cpu_onednn_scale_keepalive.apply()
            vllm_cpu_int8_saturation.apply()

    def _refresh_after_reload(self, model: torch.nn.Module) -> None:
        """Per-sync fix after finalize (CPU fix 2; a no-op method on CUDA, so skipped there)."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            vllm_cpu_tied_lm_head_refresh.refresh(model)

    # ------------------------------------------------------------------ verl entry point

    def update_weights_from_ipc(
        self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False, code_change_row_stride: int = 0
    ):
        """verl's per-step sync (`ServerAdapter.update_weights`): receive buckets, reload, return stats.

        ``code_change_row_stride`` (sent by QurlServerAdapter from the rollout settings): track the
        code-change rate on every Nth row of each quantized weight; 0 = off."""
        from verl.utils.device import get_device_name
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        if peft_config:
            raise NotImplementedError(
                "qurl_vllm syncs full weights only; LoRA adapters are not supported "
                "(set actor_rollout_ref.model.lora.merge=True to sync merged weights)"
            )
        if self.device is None:
            self.device = torch.device(f"{get_device_name()}:{self.local_rank}")
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
        # On failure keep acking the remaining buckets: the trainer's sender then finishes and the
        # error reaches the trainer through this call, instead of the sender waiting forever.
        if self._qurl_broken:
            receiver.receive_weights(on_bucket_received=lambda weights, is_last: None)
            self._raise_if_broken()
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

        with self.qurl_weight_reload(code_change_row_stride) as load_bucket:
            receiver.receive_weights(on_bucket_received=on_bucket_received)
            if errors:
                raise errors[0]
        return self.qurl_last_sync()

    def qurl_last_sync(self) -> dict | None:
        return asdict(self._qurl_last_sync) if self._qurl_last_sync is not None else None

    # ------------------------------------------------------------------ the reload itself

    def qurl_settings(self) -> RolloutSettings:
        hf_config = self.model_runner.vllm_config.model_config.hf_config
        return RolloutSettings.from_quantization_config(getattr(hf_config, "quantization_config", None))

    def _code_change_tracker(self, settings: RolloutSettings, row_stride: int) -> UpdateVisibilityTracker | None:
        """One tracker across syncs (it holds the previous sync's sampled weights and codes)."""
        if not settings.quantized or row_stride <= 0:
            self._qurl_tracker = None
        elif self._qurl_tracker is None or self._qurl_tracker.row_stride != row_stride:
            self._qurl_tracker = UpdateVisibilityTracker(
                settings.format.quant_format, settings.format.granularity, ignore=settings.ignore_patterns, row_stride=row_stride
            )
        return self._qurl_tracker

    @contextmanager
    def qurl_weight_reload(self, code_change_row_stride: int = 0):
        """One sync. Yields ``load_bucket(named_tensors)``; call it once per bucket, in stream order."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        self._raise_if_broken()
        if self._use_mtp_drafter_weight_sync():
            raise NotImplementedError("qurl_vllm does not sync MTP drafter weights")
        model = self.model_runner.model
        model_config = self.model_runner.vllm_config.model_config
        device = self.device or torch.device("cpu")
        settings = self.qurl_settings()
        tracker = self._code_change_tracker(settings, code_change_row_stride)
        stream = WeightStreamQuantizer(settings, tracker=tracker)
        stats = SyncStats(sync=self._qurl_syncs + 1, format=settings.format.value)
        buffer_names = {name for name, _ in model.named_buffers()}
        buffer_updates: list[tuple[str, torch.Tensor]] = []

        def load_bucket(named_tensors) -> None:
            tensors = stream.transform(named_tensors)
            buffer_updates.extend((n, t) for n, t in tensors if n in buffer_names)
            params = [(n, t) for n, t in tensors if n not in buffer_names]
            start = time.perf_counter()
            if params:
                model.load_weights(params)
            stats.load_s += time.perf_counter() - start
            stats.buckets += 1

        # A tied lm_head gets its own meta weight during the reload: spot it while still tied.
        tied_lm_head = vllm_cpu_tied_lm_head_refresh.tied_lm_head(model)
        start = time.perf_counter()
        try:
            with torch.device(device):
                initialize_layerwise_reload(model)
            yield load_bucket
            _check_all_layers_loaded(model, allowed_missing=tied_lm_head)
            finalize_start = time.perf_counter()
            with torch.device(device):
                finalize_layerwise_reload(model, model_config)
            self._refresh_after_reload(model)
            apply_buffer_updates(model, buffer_updates)
            stats.finalize_s = time.perf_counter() - finalize_start
            _check_reloaded_model(model)
        except BaseException as e:
            self._poison(model, f"{type(e).__name__}: {e}")
            raise WeightReloadError(f"weight sync {stats.sync} failed; the rollout engine is unusable: {e}") from e
        stats.total_s = time.perf_counter() - start
        stats.rss_mb = psutil.Process().memory_info().rss / 2**20
        for key in ("quantize_s", "copy_s", "code_change_s", "tensors_in", "quantized", "bytes_in"):
            setattr(stats, key, getattr(stream.stats, key))
        if tracker is not None:
            overall = tracker.end_step()["overall"]
            if overall["numel"]:
                stats.changed_code_frac = overall["changed_fraction"]
                stats.update_to_error_ratio = overall["update_to_error_ratio"]
        self._qurl_syncs += 1
        self._qurl_last_sync = stats
        logger.info("qurl_vllm weight sync %d (%s): %s", stats.sync, settings.format.value, stats.as_metrics(prefix=""))

    def _raise_if_broken(self) -> None:
        if self._qurl_broken:
            raise WeightReloadError(f"an earlier weight sync failed ({self._qurl_broken}); restart the rollout engine")

    def _poison(self, model: torch.nn.Module, reason: str) -> None:
        logger.error("qurl_vllm: weight sync failed mid-reload (%s); poisoning the engine (pid %d)", reason, os.getpid())
        self._qurl_broken = reason

        def refuse(*_):
            raise WeightReloadError(f"the rollout model was left half-reloaded by a failed weight sync ({reason})")

        model.register_forward_pre_hook(refuse)


def _check_all_layers_loaded(model: torch.nn.Module, allowed_missing: torch.nn.Module | None) -> None:
    """Every layer with a ``weight`` (linears, embeddings, norms) got all its elements; else vLLM
    would keep stale weights (nothing loaded) or post-process uninitialized memory (partly loaded)
    without an error. Attention layers' KV-cache scales are not streamed and are not checked.
    ``allowed_missing``: the tied lm_head, whose weight a stream may send under the embedding's
    name only (then vLLM keeps the shared Parameter, updated through the embedding)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    missing = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or layer is allowed_missing or "weight" not in info.restore_metadata[0]:
            continue
        if info.load_numel < info.load_numel_total:
            missing.append(f"{name or type(layer).__name__} ({info.load_numel}/{info.load_numel_total})")
    if missing:
        raise WeightReloadError(f"the weight stream did not cover these layers: {', '.join(missing)}")


def _check_reloaded_model(model: torch.nn.Module) -> None:
    """After finalize: no tensor left on meta, every weight scale finite and positive."""
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if on_meta:
        raise WeightReloadError(f"parameters left on meta after the reload: {on_meta[:5]}")
    bad = [
        n
        for n, p in model.named_parameters()
        if n.endswith("weight_scale") and not (torch.isfinite(p).all() and (p > 0).all())
    ]
    if bad:
        raise WeightReloadError(f"non-finite or non-positive weight scales after the reload: {bad[:5]}")
