"""Trainer-side client of the `qurl_vllm` engine: verl's vLLM ``ServerAdapter`` plus sync timings.

The trainer streams full fp32/bf16 tensors exactly as for ``rollout.name=vllm``; the engine
quantizes them (see ``weight_stream``). This subclass only keeps what the engine reports about
each sync (quantize / load / total seconds, bytes) in ``last_sync_stats`` and ``sync_metrics()``,
and refuses the delta wire format, which only patches changed bf16 values in place.
"""
from __future__ import annotations

import logging

from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

logger = logging.getLogger("qurl_verl")


class QurlServerAdapter(ServerAdapter):
    last_sync_stats: dict | None = None
    _sync_future = None

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
        await super().update_weights(weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
        if self._sync_future is not None:
            per_worker = await self._sync_future
            self.last_sync_stats = next((s for s in per_worker or () if s), None)
            logger.info("qurl_vllm sync (step %s): %s", global_steps, self.last_sync_stats)

    def sync_metrics(self, prefix: str = "qurl/rollout_sync/") -> dict[str, float]:
        """The last sync's worker-side costs as flat metrics (empty before the first sync)."""
        stats = self.last_sync_stats or {}
        return {prefix + k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
