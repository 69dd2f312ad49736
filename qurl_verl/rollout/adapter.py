"""Trainer-side client of the `qurl_vllm` engine: verl's vLLM ``ServerAdapter`` plus sync metrics.

The trainer streams full fp32/bf16 tensors exactly as for ``rollout.name=vllm``; the engine
quantizes them (see ``weight_stream``). This subclass only
* sends the engine what its quantization config cannot carry: the code-change tracking stride and
  memory cap (``custom.qurl.code_change_row_stride``, ``code_change_max_mb``) and the weight code
  width (``custom.qurl.weight_bits``);
* keeps what the engine reports about each sync in ``last_sync_stats`` and publishes it through
  ``qurl_verl.patches.qurl_vllm.loss_metrics_channel`` (installed here; any policy loss logs it): ``qurl/sync/*`` (quantize / load / total
  seconds of the slowest TP rank, bytes, worker RSS summed over the engine's ranks, ``ranks``: see
  ``sync_stats.combine_ranks``), ``qurl/sync/checksum/replica_<r>`` (equal across replicas that loaded the
  same bits) and ``qurl/update/changed_code_frac`` and
  ``qurl/update/update_to_error_ratio`` (from the second sync on);
* with ``custom.qurl.kv_cache=fp8``, appends the FP8 KV cache's per-layer q/k/v scales to the stream
  (``qurl_verl.quant.kv_cache``), from the ranges the actor's training forwards saw since the last sync
  (``patches.qurl_vllm.actor_kv_ranges``, same on every rank); a sync with no forward since resends the
  last scales, and the first sync of a run sends none (the engine keeps vLLM's 1.0);
* with LoRA adapters (verl's default), reports step 1's two syncs (the base, quantized once, then the
  adapters) as one (``combine_syncs``), and each later step's adapter sync as is (``base_frozen=1``);
* refuses the delta wire format, which only patches changed bf16 values in place.
"""
from __future__ import annotations

import itertools
import logging

from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

from qurl_verl.patches import qurl_vllm as qurl_vllm_patches
from qurl_verl.patches.qurl_vllm import actor_kv_ranges, loss_metrics_channel
from qurl_verl.quant.kv_cache import kv_scales
from qurl_verl.rollout.sync_stats import combine_ranks, combine_syncs
from qurl_verl.settings import RolloutSettings

logger = logging.getLogger("qurl_verl")

UPDATE_KEYS = ("changed_code_frac", "update_to_error_ratio")


class QurlServerAdapter(ServerAdapter):
    last_sync_stats: dict | None = None
    _sync_future = None
    _kv_scales: dict | None = None  # the FP8 KV cache's scales last sent, {stream name: tensor}
    _lora_base_sync: dict | None = None  # a LoRA run's base sync, reported with the adapter sync that follows it

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        qurl_vllm_patches.apply_all(kv_cache_scales=RolloutSettings.from_rollout_config(self.config).kv_cache.quantized)

    async def _execute_method(self, method, non_block=False, timeout=None, args=(), kwargs=None):
        result = await super()._execute_method(method, non_block=non_block, timeout=timeout, args=args, kwargs=kwargs)
        if method == "update_weights_from_ipc" and non_block:
            self._sync_future = result
        return result

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"qurl_vllm re-quantizes full tensors at every sync; wire_format={wire_format!r} "
                "(checkpoint_engine.backend=delta_sharded) is not supported"
            )
        self._sync_future = None
        lora_base = bool(kwargs.get("peft_config")) and not kwargs.get("base_sync_done", True)
        settings = RolloutSettings.from_rollout_config(self.config)
        if settings.kv_cache.quantized:
            weights = itertools.chain(weights, self.next_kv_scales().items())
        await super().update_weights(
            weights, global_steps=global_steps, wire_format=wire_format,
            code_change_row_stride=settings.code_change_row_stride, code_change_max_bytes=settings.code_change_max_bytes,
            weight_bits=settings.weight_bits, **kwargs,
        )
        if self._sync_future is not None:
            per_worker = await self._sync_future
            stats = combine_ranks(per_worker or ())
            logger.info("qurl_vllm sync (step %s%s): %s", global_steps, ", LoRA base" if lora_base else "", stats)
            if lora_base:  # the adapters follow in this step: one report for both
                self._lora_base_sync = stats
                return
            if self._lora_base_sync is not None and stats is not None:
                stats, self._lora_base_sync = combine_syncs(self._lora_base_sync, stats), None
            self.last_sync_stats = stats
            loss_metrics_channel.publish(self.sync_metrics(), replace_prefix="qurl/sync/")
            update = self.update_metrics()
            if update:
                loss_metrics_channel.publish(update, replace_prefix="qurl/update/")

    def next_kv_scales(self) -> dict:
        """The scales this sync sends: from the ranges observed since the last sync, else the last ones."""
        observed = actor_kv_ranges.observer.take()
        if observed:
            self._kv_scales = kv_scales(observed)
        return self._kv_scales or {}

    def sync_metrics(self) -> dict[str, float]:
        """The last sync's worker-side costs, ``qurl/sync/<field>`` (empty before the first sync)."""
        stats = self.last_sync_stats or {}
        metrics = {
            f"qurl/sync/{k}": float(v)
            for k, v in stats.items()
            if k not in UPDATE_KEYS and k != "checksum" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if stats.get("checksum") is not None:  # one key per replica: verl averages a key over ranks
            metrics[f"qurl/sync/checksum/replica_{getattr(self, 'replica_rank', 0)}"] = float(stats["checksum"])
        return metrics

    def update_metrics(self) -> dict[str, float]:
        """What the last sync changed in the 8-bit codes, ``qurl/update/<field>`` (empty if untracked)."""
        stats = self.last_sync_stats or {}
        return {f"qurl/update/{k}": float(stats[k]) for k in UPDATE_KEYS if stats.get(k) is not None}
