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
  server's own vLLM and platform (``engine_checks.check_quantized_experts``), as in the driver.
* ``_preprocess_engine_kwargs``: the run's settings into vLLM's ``additional_config``, where every worker
  reads them, and what each sync feature adds to the engine's arguments, checked on this server's host
  (``SyncFeature.engine_kwargs``). A user's ``engine_kwargs.vllm.hf_overrides`` (the DAPO recipe's longer
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

from qurl_verl.model_info import moe_experts
from qurl_verl.patches import qurl_vllm_server as qurl_vllm_server_patches
from qurl_verl.platform.host import Host
from qurl_verl.rollout import features as sync_features
from qurl_verl.rollout.console_log import engine_logger
from qurl_verl.rollout.cuda_kernel_env import kernel_env, nvidia_capability
from qurl_verl.rollout.engine_checks import (
    check_architecture,
    check_fp8_block_shapes,
    check_fp8_channel_shapes,
    check_fp8_hardware,
    check_gpu_rollout_dtype,
    check_int8_hardware,
    check_quantized_experts,
    check_vllm_version,
)
from qurl_verl.rollout.model_runner import USE_V2_MODEL_RUNNER_ENV, model_runner_env, user_chose_v2
from qurl_verl.rollout.worker_extension import QurlWorkerExtension
from qurl_verl.settings import LAYERWISE_RELOAD_WORKER_ENV, RolloutSettings

logger = engine_logger()  # shown in the server process, whose root logger vLLM sets to ERROR (console_log)


def set_engine_env(settings: RolloutSettings, capability: tuple[int, int] | None) -> None:
    """The engine's environment, set before the engine (and its workers) start: vLLM's V1 model runner
    (``model_runner``), and on a GPU the kernels this GPU can run that keep the streamed codes (``cuda_kernel_env``).
    The rollout server and the GPU check call it alike."""
    runner = model_runner_env(os.environ)
    if runner:
        logger.warning("qurl_vllm: %s=%s, vLLM's V1 model runner (the qurl sync has not run under Model Runner V2)",
                       USE_V2_MODEL_RUNNER_ENV, runner[USE_V2_MODEL_RUNNER_ENV])
        os.environ.update(runner)
    elif user_chose_v2(os.environ):
        logger.warning("qurl_vllm: %s=%s is set: vLLM's Model Runner V2, on which the qurl sync (in-place reload, "
                       "graphs replayed over the new codes, level-2 sleep) has not run; unset it for the V1 runner",
                       USE_V2_MODEL_RUNNER_ENV, os.environ[USE_V2_MODEL_RUNNER_ENV])
    env = kernel_env(settings.format, nvidia_capability(capability), os.environ)
    if env:
        logger.warning("qurl_vllm: %s on compute capability %d.%d, for vLLM's kernel choice: %s",
                       settings.format.value, capability[0], capability[1], env)
        os.environ.update(env)


class QurlvLLMHttpServer(vLLMHttpServer):
    def _apply_quantization(self):
        import vllm

        settings = RolloutSettings.from_rollout_config(self.config)
        check_vllm_version(vllm.__version__)
        hf_config = self.model_config.hf_config
        check_architecture(getattr(hf_config, "architectures", None), self.model_config.path)
        host = Host.probe()
        if moe_experts(hf_config.to_dict()) is not None:
            from vllm.platforms import current_platform

            check_quantized_experts(settings, vllm.__version__, on_cpu=current_platform.is_cpu(), amx=host.amx,
                                    cuda_graphs=not self.config.enforce_eager)
        check_fp8_hardware(settings, host.cuda_capability)
        check_int8_hardware(settings, host.cuda_capability)
        check_gpu_rollout_dtype(settings, self.config.dtype, host.cuda_capability)
        tensor_parallel = int(self.config.tensor_model_parallel_size or 1)
        check_fp8_block_shapes(settings, hf_config.to_dict(), tensor_parallel)
        check_fp8_channel_shapes(settings, hf_config.to_dict(), tensor_parallel, host.cuda_capability)
        set_engine_env(settings, host.cuda_capability)
        return settings.engine_quantization()

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        settings = RolloutSettings.from_rollout_config(self.config)
        engine_kwargs["additional_config"] = settings.additional_config(engine_kwargs.get("additional_config"))
        if engine_kwargs.get("hf_overrides"):  # verl's own hf_overrides (the quantization config) would be replaced
            engine_kwargs["hf_overrides"] = settings.merged_hf_overrides(engine_kwargs["hf_overrides"])
        for feature in sync_features.build(settings):
            feature.engine_kwargs(engine_kwargs, self.model_config.hf_config, self.model_config.path)

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
