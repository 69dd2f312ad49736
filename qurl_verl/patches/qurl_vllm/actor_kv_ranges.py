"""Observe the K and V ranges of the actor's training forwards, for the FP8 KV cache scales the next
weight sync sends; agree on them across the actor's ranks.

Targets: verl 0.9.1 (``verl/workers/engine_workers.py::TrainingWorker.train_mini_batch``, the actor's
(and a critic's) update: every forward of the batch just trained, on every data-parallel rank).

Why: the rollout's FP8 KV cache needs per-layer scales that follow the weights as they train. The
update's forwards already produce K and V (after RoPE, after ``k_norm``) for the whole batch, so the
ranges cost one reduction per attention call and no extra forward. Each rank sees its share of the
batch (and, with sequence parallelism, of the heads or tokens): the ranges are all-reduced (max)
over the default process group right after the update, which every actor rank runs, so every rank,
and so every rollout replica and TP rank, sends the same scales.

When: applied by the ``qurl_vllm`` adapter in its process when ``custom.qurl.kv_cache=fp8``; it
observes only workers that train a language model (``TrainingWorkerConfig.model_type``), never a
critic (a value model) or the reference model (which does not train). Otherwise the update runs as is.
"""
from __future__ import annotations

import functools

import torch

from qurl_verl.patches.contract import Patch, wrap_once
from qurl_verl.patches.qurl_vllm import attention_kv_hook
from qurl_verl.quant.kv_cache import KVRangeObserver

_MARK = "_qurl_observes_kv_ranges"
OBSERVED_MODEL_TYPE = "language_model"
observer = KVRangeObserver()  # this process's ranges since the last weight sync (the adapter takes them)


def observe_ranges(module, query, key, value):
    observer.observe(attention_kv_hook.layer_index(module), query, key, value)


def all_reduce_max(obs: KVRangeObserver) -> None:
    """Every rank ends with the largest range any rank saw (a no-op outside torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    layers, amax = obs.table()
    count = torch.tensor([len(layers)], dtype=torch.int64, device=amax.device if layers else collective_device())
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    if len({int(c) for c in counts}) != 1:
        raise RuntimeError(f"qurl_verl: the actor's ranks observed K/V in different numbers of layers: {[int(c) for c in counts]}")
    if layers:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        obs.set_table(layers, amax)


def collective_device() -> torch.device:
    """Where a tensor must be for the default group's collectives: the GPU under an NCCL-only group."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend and "gloo" not in backend else torch.device("cpu")


def train_with_kv_ranges_for(original):
    @functools.wraps(original)
    def train_mini_batch(self, *args, **kwargs):
        if getattr(self.config, "model_type", None) != OBSERVED_MODEL_TYPE:
            return original(self, *args, **kwargs)
        with attention_kv_hook.kv_hook(observe_ranges):
            output = original(self, *args, **kwargs)
        all_reduce_max(observer)
        return output

    return train_mini_batch


def _wrap_update() -> str:
    from verl.workers.engine_workers import TrainingWorker

    return wrap_once(TrainingWorker, "train_mini_batch", train_with_kv_ranges_for, _MARK)


PATCH = Patch(
    module=__name__,
    target="verl.workers.engine_workers:TrainingWorker.train_mini_batch",
    package="verl",
    versions=("0.9.1",),
    when="in the process of the qurl_vllm rollout adapter, with custom.qurl.kv_cache=fp8",
    change=_wrap_update,
)


def apply() -> str:
    return PATCH.apply()
