"""Trainer-side client of the `qurl_vllm` engine: verl's vLLM ``ServerAdapter`` plus sync metrics.

The trainer streams full fp32/bf16 tensors exactly as for ``rollout.name=vllm``; the engine
quantizes them (see ``weight_stream``) with the settings the server gave it. This subclass only
* appends what the run's sync features add to the stream (``SyncFeature.trainer_tensors``) and lets them
  shape the report (``trainer_report``; ``rollout.features``);
* keeps what the engine reports about each sync in ``last_sync_stats`` and publishes it through
  ``qurl_verl.patches.qurl_vllm.loss_metrics_channel`` (installed here; any policy loss logs it), one
  group per prefix (``sync_stats.metric_groups``): ``qurl/sync/*`` (quantize / load / total seconds of the
  slowest TP rank, bytes, worker RSS summed over the engine's ranks, ``ranks``: see
  ``sync_stats.combine_ranks``), ``qurl/sync/checksum/replica_<r>`` (equal across replicas that loaded the
  same bits) and the code-change rates under ``qurl/update/`` (from the second sync on);
* logs one summary line per step from replica 0's leader, shown by default (``sync_log``), the report at DEBUG;
* refuses the delta wire format, which only patches changed bf16 values in place.
"""
from __future__ import annotations

import itertools
import logging

from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

from qurl_verl.patches import qurl_vllm as qurl_vllm_patches
from qurl_verl.patches.qurl_vllm import loss_metrics_channel
from qurl_verl.rollout import features as sync_features
from qurl_verl.rollout.sync_log import log_sync_summary
from qurl_verl.rollout.sync_stats import combine_ranks, metric_groups, post_rollout_report
from qurl_verl.settings import RolloutSettings

logger = logging.getLogger("qurl_verl")


def with_trainer_tensors(weights, extra):
    """The weights followed by the features' own tensors, as the kind of iterator verl handed in: a generator in
    the colocated sync, an async generator from a checkpoint engine's ``receive_weights`` (disaggregated)."""
    if not hasattr(weights, "__aiter__"):
        return itertools.chain(weights, *extra)

    async def chained():
        async for item in weights:
            yield item
        for item in itertools.chain(*extra):
            yield item

    return chained()


class QurlServerAdapter(ServerAdapter):
    last_sync_stats: dict | None = None
    _sync_future = None  # the workers' results of the sync running now (verl awaits them and drops them)

    _qurl_features = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        qurl_vllm_patches.apply_all()
        self.qurl_features  # noqa: B018 - each feature's trainer setup, now, in the actor's process

    @property
    def qurl_features(self) -> list[sync_features.SyncFeature]:
        """The run's sync features on the trainer's side, built once (they keep state across syncs)."""
        if self._qurl_features is None:
            self._qurl_features = sync_features.build(RolloutSettings.from_rollout_config(self.config))
            for feature in self._qurl_features:
                feature.trainer_setup()
        return self._qurl_features

    async def _execute_method(self, method, non_block=False, timeout=None, args=(), kwargs=None):
        """verl's call into the engine's workers; the one place where the sync's results pass by."""
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
        from_checkpoint_engine = hasattr(weights, "__aiter__")  # a disaggregated rollout's receive_weights
        weights = with_trainer_tensors(weights, [feature.trainer_tensors() for feature in self.qurl_features])
        await super().update_weights(weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
        if self._sync_future is None:
            return
        stats, report = combine_ranks(await self._sync_future or (), sync_features.stats_types()), True
        for feature in self.qurl_features:
            stats, now = feature.trainer_report(stats, kwargs)
            report = report and now
        self.log_sync(stats, global_steps, report)
        if not report:
            return
        self.last_sync_stats = stats
        if from_checkpoint_engine:
            post_rollout_report(getattr(self, "replica_rank", 0), stats)
        for prefix, metrics in metric_groups(stats, getattr(self, "replica_rank", 0), sync_features.stats_types()).items():
            loss_metrics_channel.publish(metrics, replace_prefix=prefix)

    def log_sync(self, stats: dict | None, global_steps, report: bool) -> None:
        """The whole report at DEBUG; one summary line at INFO, shown by default, from replica 0's leader only
        (the rank verl logs its own ``update_weights done`` from) and once per step (after its last sync)."""
        logger.debug("qurl_vllm sync (step %s%s): %s", global_steps, "" if report else ", reported with the next", stats)
        if report and stats and getattr(self, "replica_rank", 0) == 0 and getattr(self, "rollout_rank", 0) == 0:
            log_sync_summary(stats, global_steps)

    def sync_metrics(self) -> dict[str, float]:
        """The last sync's worker-side costs, ``qurl/sync/<field>`` (empty before the first sync)."""
        return metric_groups(self.last_sync_stats, getattr(self, "replica_rank", 0), sync_features.stats_types()).get("qurl/sync/", {})

    def update_metrics(self) -> dict[str, float]:
        """What the last sync changed in the 8-bit codes, ``qurl/update/<field>`` (empty if untracked)."""
        return metric_groups(self.last_sync_stats, getattr(self, "replica_rank", 0), sync_features.stats_types()).get("qurl/update/", {})
