"""The `qurl_vllm` engine server and replica: verl's vLLM ones, built quantized, with our worker.

Only the hooks verl 0.9.1 exposes for subclasses are overridden
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``):

* ``_apply_quantization``: the compressed-tensors ``quantization_config`` for int8 / fp8 /
  fp8_block, nothing for bf16. With verl's default ``load_format=dummy`` the engine starts on
  random weights; the first weight sync, before any rollout, brings in the trainer's. It runs in
  the server process before the engine exists, on the server's GPU: FP8 is refused below 8.9,
  and INT8 on Blackwell gets vLLM's Triton kernel (``cuda_int8_kernel.int8_kernel_env``) through the
  environment the engine's processes inherit. Quantized MoE experts are checked against this
  server's own vLLM and platform (``engine_checks.check_quantized_experts``), as in the driver.
* ``_preprocess_engine_kwargs``: vLLM's ``kv_cache_dtype`` from ``custom.qurl.kv_cache`` (the driver
  refuses a ``kv_cache_dtype`` in ``engine_kwargs``), checked against this server's CPU and model.
* ``_get_worker_extension_cls``: ``QurlWorkerExtension``, which reloads through vLLM's
  layerwise-reload lifecycle at every sync.
* ``launch_server``: marks the engine's worker processes (an inherited environment variable) so
  the plugin leaves out the stock-rollout CPU patch there.
* ``collective_rpc`` returns the workers' results, so the adapter can read the sync timings.

The replica must name its server actors with the prefix the adapter looks up
(``ServerAdapter._get_server_name_prefix`` is ``f"{rollout.name}_"``; verl's vLLM replica
hard-codes ``"vllm_"``, which would make ``ray.get_actor("qurl_vllm_server_0_0")`` fail).
"""
from __future__ import annotations

import logging
import os

import ray
import torch
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from qurl_verl.model_info import ModelInfo, moe_experts
from qurl_verl.platform.host import Host
from qurl_verl.rollout.cuda_int8_kernel import int8_kernel_env
from qurl_verl.rollout.engine_checks import (
    check_architecture,
    check_fp8_hardware,
    check_fp8_kv_cache,
    check_quantized_experts,
)
from qurl_verl.rollout.worker_extension import QurlWorkerExtension
from qurl_verl.settings import LAYERWISE_RELOAD_WORKER_ENV, RolloutSettings

logger = logging.getLogger("qurl_verl")


def set_int8_kernel_env(settings: RolloutSettings, capability: tuple[int, int] | None) -> None:
    """Steer vLLM off a kernel this GPU cannot run, before the engine (and its workers) start."""
    nvidia = capability if torch.version.hip is None else None  # ROCm capabilities count differently
    env = int8_kernel_env(settings.format, nvidia, os.environ)
    if env:
        logger.info("qurl_vllm: INT8 on compute capability %d.%d, using vLLM's Triton kernel: %s",
                    capability[0], capability[1], env)
        os.environ.update(env)


class QurlvLLMHttpServer(vLLMHttpServer):
    def _apply_quantization(self):
        settings = RolloutSettings.from_rollout_config(self.config)
        hf_config = self.model_config.hf_config
        check_architecture(getattr(hf_config, "architectures", None), self.model_config.path)
        host = Host.probe()
        if moe_experts(hf_config.to_dict()) is not None:
            import vllm
            from vllm.platforms import current_platform

            check_quantized_experts(settings, vllm.__version__, on_cpu=current_platform.is_cpu(), amx=host.amx)
        check_fp8_hardware(settings, host.cuda_capability)
        set_int8_kernel_env(settings, host.cuda_capability)
        return settings.engine_quantization()

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        settings = RolloutSettings.from_rollout_config(self.config)
        if settings.kv_cache.quantized:
            from vllm.platforms import current_platform

            host = Host.probe()
            model = ModelInfo.of_config(self.model_config.hf_config.to_dict(), self.model_config.path)
            check_fp8_kv_cache(settings, on_cpu=current_platform.is_cpu(), avx512=host.avx512, amx=host.amx,
                               head_dim=model.head_dim, uses_mla=model.uses_mla)
        engine_kwargs["kv_cache_dtype"] = settings.kv_cache.engine_dtype

    def _get_worker_extension_cls(self) -> str:
        return f"{QurlWorkerExtension.__module__}.{QurlWorkerExtension.__qualname__}"

    async def launch_server(self, *args, **kwargs):
        os.environ[LAYERWISE_RELOAD_WORKER_ENV] = "1"
        return await super().launch_server(*args, **kwargs)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return await self.engine.collective_rpc(method=method, timeout=timeout, args=args, kwargs=kwargs)


class QurlvLLMReplica(vLLMReplica):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(QurlvLLMHttpServer)

    def _get_server_name_prefix(self) -> str:
        return f"{self.config.name}_"
