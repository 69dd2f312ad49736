"""vLLM worker side of `qurl_vllm`: rebuild the 8-bit rollout copy from the trainer's weights.

One weight sync is one pass of vLLM's layerwise-reload lifecycle
(``vllm/model_executor/model_loader/reload/layerwise.py``):

    initialize_layerwise_reload(model)             once: layers back to checkpoint format, on meta
    per bucket: model.load_weights(quantize(bucket))   each layer is post-processed (int8 prepack,
                                                   transposes) as soon as all its tensors arrived
    finalize_layerwise_reload(model, model_config) once: leftovers and attention layers
    + checks: every layer fully streamed (vocabulary padding rows excepted: vLLM zero-fills them),
      nothing left on meta, weight scales finite and > 0
    + attention's KV-cache scales back to vLLM's defaults: no stream carries them, and a level-2
      sleep (verl's ``enable_sleep_mode``) wipes the ones vLLM 0.24 keeps as parameters

Pass-through tensors are sent in the dtype of the parameter they load into, so the loaders have
nothing to warn about; finalize's warning for the config-only RoPE cache is filtered (see
``_quiet_config_only_layers``). A tied ``lm_head.weight`` in the stream is dropped before it is
copied (``weight_stream.tied_output_embedding``; counted as ``skipped``): the engine's lm_head
reads the embedding's Parameter, reloaded under the embedding's name.

On CPU, vLLM-CPU work-arounds (``qurl_verl.patches.vllm_cpu_worker``): before the model loads, the
oneDNN weight-scale keep-alive (needed by every reload), exact INT8 GEMMs on CPUs whose oneDNN int8
kernel saturates (no VNNI), oneDNN for fp32 INT8 linears on AMX CPUs and 0.24's MoE SiLU fallback; after every reload, the tied lm_head refresh
and the re-packing of full-precision MoE experts.

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
    vllm_cpu_int8_fp32_onednn,
    vllm_cpu_int8_saturation,
    vllm_cpu_moe_prepack_refresh,
    vllm_cpu_moe_silu,
    vllm_cpu_onednn_scale_keepalive,
    vllm_cpu_tied_lm_head_refresh,
)
from qurl_verl.quant import UpdateVisibilityTracker
from qurl_verl.quant.update_visibility import DEFAULT_TRACKER_MAX_BYTES
from qurl_verl.settings import DEFAULT_WEIGHT_BITS, RolloutSettings
from qurl_verl.rollout import int8_gemm_report, vllm_versions
from qurl_verl.rollout.weight_stream import TIED_LM_HEAD_NAMES, WeightStreamQuantizer, tied_output_embedding

logger = logging.getLogger("qurl_verl")


class WeightReloadError(RuntimeError):
    """A weight sync failed part-way; the engine holds no usable model any more."""


@dataclass
class SyncStats:
    """Cost of one weight sync inside the vLLM worker (seconds; bytes as received)."""

    sync: int
    format: str
    weight_bits: int = DEFAULT_WEIGHT_BITS  # integer code width of the quantized weights (8 = INT8)
    total_s: float = 0.0
    quantize_s: float = 0.0
    copy_s: float = 0.0
    load_s: float = 0.0  # model.load_weights, including each layer's post-processing (prepack)
    finalize_s: float = 0.0
    buckets: int = 0
    tensors_in: int = 0
    quantized: int = 0
    skipped: int = 0  # received, never copied: names the engine does not load (a tied lm_head)
    bytes_in: int = 0
    # share of the loaded weight elements sent as 8-bit codes: what the rollout runs quantized
    # (with an MoE model's experts in bf16, a small share)
    quantized_frac: float | None = None
    rss_mb: float = 0.0  # worker resident memory after the sync, to watch for leaks
    # QuRL's weight-update problem: share of the tracked 8-bit codes this sync changed, and
    # ||W_new - W_prev|| / ||Q(W_prev) - W_prev|| (None on the first sync or with tracking off)
    code_change_s: float = 0.0
    changed_code_frac: float | None = None
    update_to_error_ratio: float | None = None
    # The tracker's state (CPU, bounded): bytes held across syncs, and the row stride it samples at
    # (the requested one, or larger where the byte cap needed it; 0 = tracking off)
    tracker_resident_bytes: int = 0
    tracker_row_stride: int = 0

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
            vllm_cpu_int8_fp32_onednn.apply()
            vllm_cpu_moe_silu.apply()

    def _refresh_after_reload(self, model: torch.nn.Module) -> None:
        """Per-sync fixes after finalize, CPU only: the tied lm_head's and the MoE experts' packed copies
        (post-processing the reload skips; on CUDA the first is a no-op and the second does not occur)."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            vllm_cpu_tied_lm_head_refresh.refresh(model)
            vllm_cpu_moe_prepack_refresh.refresh(model)

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

        with self.qurl_weight_reload(code_change_row_stride, code_change_max_bytes, weight_bits) as load_bucket:
            receiver.receive_weights(on_bucket_received=on_bucket_received)
            if errors:
                raise errors[0]
        return self.qurl_last_sync()

    def qurl_last_sync(self) -> dict | None:
        return asdict(self._qurl_last_sync) if self._qurl_last_sync is not None else None

    def qurl_int8_gemms(self) -> dict[str, str]:
        """{module name: GEMM} of every INT8 linear as the engine holds it now (``int8_gemm_report``)."""
        return int8_gemm_report.int8_gemms(self.model_runner.model)

    # ------------------------------------------------------------------ the reload itself

    def qurl_settings(self, weight_bits: int = DEFAULT_WEIGHT_BITS) -> RolloutSettings:
        hf_config = self.model_runner.vllm_config.model_config.hf_config
        return RolloutSettings.from_quantization_config(getattr(hf_config, "quantization_config", None), weight_bits)

    def _code_change_tracker(
        self, settings: RolloutSettings, row_stride: int, max_bytes: int | None
    ) -> UpdateVisibilityTracker | None:
        """One tracker across syncs (it holds the previous sync's sampled weights and codes), its state
        in CPU memory: it lives for the whole run, outside the accelerator memory vLLM budgets for."""
        tracker = self._qurl_tracker
        if not settings.quantized or row_stride <= 0:
            self._qurl_tracker = None
        elif tracker is None or (tracker.fmt.name, tracker.row_stride, tracker.max_resident_bytes) != (
            settings.quant_format, row_stride, max_bytes
        ):
            self._qurl_tracker = UpdateVisibilityTracker(
                settings.quant_format, settings.format.granularity, ignore=settings.ignore_patterns,
                row_stride=row_stride, storage_device="cpu", max_resident_bytes=max_bytes,
            )
        return self._qurl_tracker

    @contextmanager
    def qurl_weight_reload(
        self, code_change_row_stride: int = 0, code_change_max_bytes: int | None = DEFAULT_TRACKER_MAX_BYTES,
        weight_bits: int = DEFAULT_WEIGHT_BITS,
    ):
        """One sync. Yields ``load_bucket(named_tensors)``; call it once per bucket, in stream order."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        self._raise_if_broken()
        if self._use_mtp_drafter_weight_sync():
            raise NotImplementedError("qurl_vllm does not sync MTP drafter weights")
        model = self.model_runner.model
        model_config = self.model_runner.vllm_config.model_config
        attention_layers = _unquantized_kv_cache_layers(model)
        device = self.device or torch.device("cpu")
        settings = self.qurl_settings(weight_bits)
        tracker = self._code_change_tracker(settings, code_change_row_stride, code_change_max_bytes)
        # Read while the model is intact: during the reload a tied lm_head gets its own meta weight.
        skip = TIED_LM_HEAD_NAMES if tied_output_embedding(model) is not None else frozenset()
        tied_lm_head = vllm_cpu_tied_lm_head_refresh.tied_lm_head(model)
        stream = WeightStreamQuantizer(settings, tracker=tracker, skip=skip)
        stats = SyncStats(sync=self._qurl_syncs + 1, format=settings.format.value, weight_bits=settings.weight_bits)
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

        start = time.perf_counter()
        try:
            with torch.device(device):
                initialize_layerwise_reload(model)
            stream.param_dtypes = self._qurl_param_dtypes(model)
            yield load_bucket
            _check_all_layers_loaded(model, allowed_missing=tied_lm_head)
            finalize_start = time.perf_counter()
            with torch.device(device), _quiet_config_only_layers(model), _quiet_skipped_lm_head(tied_lm_head):
                finalize_layerwise_reload(model, model_config)
            self._refresh_after_reload(model)
            with torch.device(device), torch.no_grad():  # 0.24's scale parameters require grad
                _reset_kv_cache_scales(attention_layers)
            apply_buffer_updates(model, buffer_updates)
            stats.finalize_s = time.perf_counter() - finalize_start
            _check_reloaded_model(model)
        except BaseException as e:
            self._poison(model, f"{type(e).__name__}: {e}")
            raise WeightReloadError(f"weight sync {stats.sync} failed; the rollout engine is unusable: {e}") from e
        stats.total_s = time.perf_counter() - start
        stats.rss_mb = psutil.Process().memory_info().rss / 2**20
        for key in ("quantize_s", "copy_s", "code_change_s", "tensors_in", "quantized", "skipped", "bytes_in"):
            setattr(stats, key, getattr(stream.stats, key))
        if stream.stats.numel_in:
            stats.quantized_frac = stream.stats.quantized_numel / stream.stats.numel_in
        if tracker is not None:
            summary = tracker.end_step()
            stats.tracker_resident_bytes = summary["tracker"]["resident_bytes"]
            stats.tracker_row_stride = summary["tracker"]["row_stride"]
            overall = summary["overall"]
            if overall["numel"]:
                stats.changed_code_frac = overall["changed_fraction"]
                stats.update_to_error_ratio = overall["update_to_error_ratio"]
        self._qurl_syncs += 1
        self._qurl_last_sync = stats
        if stats.sync == 1 and stats.quantized:
            gemms = int8_gemm_report.count(int8_gemm_report.int8_gemms(model))
            if gemms:
                logger.warning("qurl_vllm: INT8 linears run %s (pid %d)", gemms, os.getpid())
        logger.info("qurl_vllm weight sync %d (%s): %s", stats.sync, settings.format.value, stats.as_metrics(prefix=""))

    def _qurl_param_dtypes(self, model: torch.nn.Module) -> dict[str, torch.dtype]:
        """The dtype vLLM loads each parameter in, under the names the stream sends (a fused layer's
        under each of its HF shard names too), for the stream to send exactly that dtype.

        Read once, on the first sync right after ``initialize_layerwise_reload``: the model then
        holds its checkpoint-format parameters, the ones the loaders copy into (post-processed
        kernels may be stored differently). The model's structure never changes between syncs."""
        if getattr(self, "_qurl_dtypes", None) is None:
            packed = getattr(model, "packed_modules_mapping", None) or {}
            dtypes: dict[str, torch.dtype] = {}
            for name, param in model.named_parameters():
                dtypes[name] = param.dtype
                module, _, leaf = name.rpartition(".")
                parent, _, layer = module.rpartition(".")
                for shard in packed.get(layer, ()):
                    dtypes.setdefault(f"{parent}.{shard}.{leaf}" if parent else f"{shard}.{leaf}", param.dtype)
                dtypes.update(_expert_names(model.get_submodule(module), name, param))
            self._qurl_dtypes = dtypes
        return self._qurl_dtypes

    def _raise_if_broken(self) -> None:
        if self._qurl_broken:
            raise WeightReloadError(f"an earlier weight sync failed ({self._qurl_broken}); restart the rollout engine")

    def _poison(self, model: torch.nn.Module, reason: str) -> None:
        logger.error("qurl_vllm: weight sync failed mid-reload (%s); poisoning the engine (pid %d)", reason, os.getpid())
        self._qurl_broken = reason

        def refuse(*_):
            raise WeightReloadError(f"the rollout model was left half-reloaded by a failed weight sync ({reason})")

        model.register_forward_pre_hook(refuse)


# vLLM's fused MoE layer holds all routed experts of a decoder layer in these two parameters
# (gate and up stacked in w13, down in w2), loaded from the per-expert HF tensors.
EXPERT_WEIGHT_PARAMS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}


def _expert_names(module: torch.nn.Module, name: str, param: torch.Tensor) -> dict[str, torch.dtype]:
    """The per-expert HF names (``<...>.mlp.experts.<e>.gate_proj.weight``) that load into a fused expert
    parameter (``<...>.mlp.experts[.routed_experts].w13_weight``), with its dtype; empty for any other."""
    leaf = name.rpartition(".")[2]
    if leaf not in EXPERT_WEIGHT_PARAMS or ".experts." not in name:
        return {}
    base = name.split(".experts.")[0] + ".experts"
    count = int(getattr(module, "global_num_experts", 0) or param.shape[0])
    return {f"{base}.{e}.{proj}.weight": param.dtype for e in range(count) for proj in EXPERT_WEIGHT_PARAMS[leaf]}


def _check_all_layers_loaded(model: torch.nn.Module, allowed_missing: torch.nn.Module | None) -> None:
    """Every layer with a ``weight`` (linears, embeddings, norms) or fused expert weights
    (``EXPERT_WEIGHT_PARAMS``: all of a layer's routed experts) got all the elements a stream can
    deliver; else vLLM would keep stale weights (nothing loaded) or post-process uninitialized
    memory (partly loaded) without an error. Attention layers' KV-cache scales are not streamed and
    are not checked. Vocabulary padding rows are never loaded (``_streamable_numel``).
    ``allowed_missing``: the tied lm_head (a layer of its own sharing the embedding's Parameter),
    whose weight the stream skips; vLLM then keeps the shared Parameter, updated through the
    embedding, which is checked like any layer."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    missing = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or layer is allowed_missing or not ({"weight", *EXPERT_WEIGHT_PARAMS} & set(info.restore_metadata[0])):
            continue
        expected = _streamable_numel(layer, info.load_numel_total)
        if info.load_numel < expected:
            missing.append(f"{name or type(layer).__name__} ({info.load_numel}/{expected})")
    if missing:
        raise WeightReloadError(f"the weight stream did not cover these layers: {', '.join(missing)}")


def _streamable_numel(layer: torch.nn.Module, load_numel_total: int) -> int:
    """How many of the layer's ``load_numel_total`` elements a complete stream loads.

    All of them, except in vLLM's vocabulary layers (``VocabParallelEmbedding``, ``ParallelLMHead``
    in ``vllm/model_executor/layers/vocab_parallel_embedding.py``): their rows are padded to a
    multiple of 64 (and split over tensor-parallel ranks), and their ``weight_loader`` copies only
    this rank's rows of the checkpoint vocabulary (``shard_indices.org_vocab_*``), then zero-fills
    the rest with ``fill_``, which the reload's element count does not see. A vocabulary that is not
    a multiple of 64 (a checkpoint resized to ``len(tokenizer)``) therefore never reaches the total.
    Tensors sharded along the vocabulary (``output_dim`` set) count those rows; others count whole.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    if not isinstance(layer, VocabParallelEmbedding):
        return load_numel_total
    rows, padded_rows = layer.shard_indices.num_org_elements, layer.num_embeddings_per_partition
    padding = 0
    skipped = vllm_versions.skip_load_tensor_names()
    for name, tensor in get_layer_tensors(layer).items():
        if name in skipped or getattr(tensor, "output_dim", None) is None:
            continue
        numel = vllm_versions.tensor_load_numel(tensor)
        padding += numel - numel * rows // padded_rows
    return load_numel_total - padding


@contextmanager
def _quiet_config_only_layers(model: torch.nn.Module):
    """Around ``finalize_layerwise_reload``: drop its "<Layer>: Failed to load weights" warning for
    layers that hold buffers only, computed from the config (RoPE's ``cos_sin_cache``).

    vLLM warns for every layer with loadable tensors that received none. For these no checkpoint
    has tensors and the models' ``load_weights`` drops them (Qwen2, Llama skip ``rotary_emb.*``), so
    no stream can avoid the warning on any sync; vLLM puts the engine's own buffers back,
    unchanged. A layer with parameters is never silenced: ``_check_all_layers_loaded`` has already
    raised for one that got nothing, and the filter is scoped to this logger and this call.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    infos = [(type(m).__name__, layerwise.get_layerwise_info(m).restore_metadata) for m in model.modules()]
    with_params = {cls for cls, (params, _) in infos if params}
    with _without_load_warnings({cls for cls, (params, buffers) in infos if buffers and not params} - with_params):
        yield


@contextmanager
def _quiet_skipped_lm_head(lm_head: torch.nn.Module | None):
    """Around ``finalize_layerwise_reload``: drop its "<Layer>: Failed to load weights" warning for the
    tied lm_head, whose weight the stream skips on purpose; vLLM then puts the shared Parameter back,
    the embedding's, already reloaded. Matched by class name, as vLLM logs it: any other layer of
    that class that got nothing has already failed ``_check_all_layers_loaded``."""
    with _without_load_warnings(set() if lm_head is None else {type(lm_head).__name__}):
        yield


@contextmanager
def _without_load_warnings(layer_classes: set[str]):
    """Filter the reload's "<Layer>: Failed to load weights" warning for these layer classes, on its
    own logger, for the duration of the block."""
    from vllm.model_executor.model_loader.reload import layerwise

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in layer_classes)

    log = logging.getLogger(layerwise.__name__)
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


_warned_kv_cache_scales = False


def _unquantized_kv_cache_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention layers (those holding KV-cache scales) whose KV cache is not quantized.

    A quantized (fp8) KV cache needs calibrated scales, which no stream carries: its layers keep
    what vLLM set at start-up (from dummy weights: random), which a level-2 sleep then wipes.
    Warned once per worker; qurl_vllm rolls out with the unquantized cache."""
    global _warned_kv_cache_scales
    from vllm.utils.torch_utils import is_quantized_kv_cache

    layers = [m for m in model.modules() if hasattr(m, "_k_scale") and hasattr(m, "kv_cache_dtype")]
    quantized = sorted({m.kv_cache_dtype for m in layers if is_quantized_kv_cache(m.kv_cache_dtype)})
    if quantized and not _warned_kv_cache_scales:
        _warned_kv_cache_scales = True
        logger.warning(
            "qurl_vllm: the KV cache is %s, but weight syncs carry no KV-cache scales: they keep the "
            "values of the engine's dummy start-up weights. Use kv_cache_dtype=auto.", ", ".join(quantized),
        )
    return [m for m in layers if not is_quantized_kv_cache(m.kv_cache_dtype)]


def _reset_kv_cache_scales(attention_layers: list[torch.nn.Module]) -> None:
    """After a reload: vLLM's defaults (1.0) in the KV-cache scales of attention layers with an
    unquantized KV cache, as vLLM sets them there (``set_default_quant_scales``).

    No stream delivers them, and the reload puts back whatever the layer held. Under vLLM 0.24 a
    compressed-tensors model keeps ``_q_scale``/``_k_scale``/``_v_scale`` as *parameters* (its KV-cache
    method assigns its ``k_scale`` Parameter to them), filled by the dummy load with random values;
    a level-2 sleep (verl, ``enable_sleep_mode``) discards them and restores only buffers, leaving
    uninitialized memory. The same goes for the scale ranges and host copies kept as plain
    attributes. vLLM forces these scales to 1.0 for an unquantized KV cache, yet its GPU
    FlashAttention still receives ``_q/_k/_v_scale`` as descale factors on every call: after the
    reset they hold exactly vLLM's values, whatever the kernel does with them, and the sync
    defines every tensor the engine holds."""
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    for layer in attention_layers:
        set_default_quant_scales(layer, register_buffer=False)


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
