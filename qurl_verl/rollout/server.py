"""The `qurl_vllm` engine server and replica: verl's vLLM ones, built quantized, with our worker.

Only the hooks verl 0.9.1 exposes for subclasses are overridden
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``):

* ``_apply_quantization``: the compressed-tensors ``quantization_config`` for int8 / fp8 /
  fp8_block, nothing for bf16. With verl's default ``load_format=dummy`` the engine starts on
  random weights; the first weight sync, before any rollout, brings in the trainer's. It runs in
  the server process before the engine exists, on the server's GPU: vLLM's V1 model runner is pinned
  (``model_runner``), FP8 is refused below 8.9,
  INT8 on Blackwell gets vLLM's Triton kernel and ``fp8_block`` the Cutlass block kernel, which keeps the
  streamed codes (``cuda_kernel_env``), through the environment the engine's processes inherit. Quantized MoE experts are checked against this
  server's own vLLM and platform (``engine_checks.check_quantized_experts``), as in the driver. All of it is
  ``engine_policy.prepare_engine``, which the GPU check (``tests/gpu/check_qurl_vllm_cuda.py``) calls too.
  First, the model must carry the UAQ record the rollout's config asks for (``engine_checks.check_uaq_record``):
  the safety net of a run whose driver checks were skipped (an entry point started inside a running Ray).
* ``_preprocess_engine_kwargs``: the run's settings into vLLM's ``additional_config``, where every worker
  reads them, and what each sync feature adds to the engine's arguments, checked on this server's host
  (``SyncFeature.engine_kwargs``; ``engine_policy.qurl_engine_kwargs``, as in the GPU check). A user's ``engine_kwargs.vllm.hf_overrides`` (the DAPO recipe's longer
  context) gets the quantization config merged in: verl spreads ``engine_kwargs`` after its own
  ``hf_overrides``, which would otherwise drop it.
* ``_get_worker_extension_cls``: ``QurlWorkerExtension``, which reloads through vLLM's
  layerwise-reload lifecycle at every sync.
* ``launch_server``: marks the engine's worker processes (an inherited environment variable) so
  the plugin leaves out the stock-rollout CPU patch there.
* ``collective_rpc`` returns the workers' results, so the adapter can read the sync timings.
* ``abort_all_requests`` (verl's pause before an asynchronous trainer's sync) goes through an engine that
  takes verl's call on every tested vLLM (``patches.qurl_vllm_server``).

The replica must name its server actors with the prefix the adapter looks up
(``ServerAdapter._get_server_name_prefix`` is ``f"{rollout.name}_"``; verl's vLLM replica
hard-codes ``"vllm_"``, which would make ``ray.get_actor("qurl_vllm_server_0_0")`` fail).
"""
from __future__ import annotations

import os

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from qurl_verl.patches import qurl_vllm_server as qurl_vllm_server_patches
from qurl_verl.platform.host import Host
from qurl_verl.rollout.engine_checks import check_uaq_record, requested_uaq
from qurl_verl.rollout.engine_policy import prepare_engine, qurl_engine_kwargs
from qurl_verl.rollout.worker_extension import QurlWorkerExtension
from qurl_verl.settings import LAYERWISE_RELOAD_WORKER_ENV, RolloutSettings


class QurlvLLMHttpServer(vLLMHttpServer):
    def _apply_quantization(self):
        import vllm
        from vllm.platforms import current_platform

        hf_config = self.model_config.hf_config.to_dict()
        check_uaq_record(requested_uaq(self.config), hf_config, model=str(self.model_config.path))
        host = Host.probe()
        return prepare_engine(
            RolloutSettings.from_rollout_config(self.config), vllm_version=vllm.__version__,
            hf_config=hf_config, model_path=self.model_config.path,
            tensor_parallel=int(self.config.tensor_model_parallel_size or 1), capability=host.cuda_capability,
            on_cpu=current_platform.is_cpu(), amx=host.amx, enforce_eager=bool(self.config.enforce_eager),
            dtype=self.config.dtype)

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        qurl_engine_kwargs(RolloutSettings.from_rollout_config(self.config), engine_kwargs, self.model_config.hf_config,
                           self.model_config.path)

    def _get_worker_extension_cls(self) -> str:
        return f"{QurlWorkerExtension.__module__}.{QurlWorkerExtension.__qualname__}"

    async def launch_server(self, *args, **kwargs):
        os.environ[LAYERWISE_RELOAD_WORKER_ENV] = "1"
        return await super().launch_server(*args, **kwargs)

    async def abort_all_requests(self, *args, **kwargs):
        """verl's pause before a sync of its asynchronous trainers, on an engine that takes verl's call
        (``patches.qurl_vllm_server``)."""
        qurl_vllm_server_patches.apply_all(getattr(self, "engine", None))
        return await super().abort_all_requests(*args, **kwargs)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return await self.engine.collective_rpc(method=method, timeout=timeout, args=args, kwargs=kwargs)


class QurlvLLMReplica(vLLMReplica):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(QurlvLLMHttpServer)

    def _get_server_name_prefix(self) -> str:
        return f"{self.config.name}_"
