"""What a ``qurl_vllm`` engine gets before it starts: the checks, the environment and the engine arguments.

One home for the rollout server (``server.QurlvLLMHttpServer``) and the GPU check
(``tests/gpu/check_qurl_vllm_cuda.py``), so that what the check proves on a GPU is what the server runs there:

* ``prepare_engine``: the checks against this host's vLLM, GPU and the model, then the engine's environment
  (``set_engine_env``); returns the ``quantization`` and ``hf_overrides`` verl passes to the engine;
* ``qurl_engine_kwargs``: what the run adds to the engine's arguments (``additional_config``, the user's
  ``hf_overrides`` merged with the quantization config, each sync feature's ``engine_kwargs``: the FP8 cache's
  dtype and attention backend).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from qurl_verl.model_info import moe_experts
from qurl_verl.rollout import features as sync_features
from qurl_verl.rollout.console_log import engine_logger
from qurl_verl.rollout.cuda_kernel_env import DISABLED_KERNELS_ENV, USE_DEEP_GEMM_ENV, kernel_env, nvidia_capability
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
from qurl_verl.settings import RolloutSettings

logger = engine_logger()  # shown in a rollout server, whose root logger vLLM sets to ERROR (console_log)

# the variables ``set_engine_env`` may set: what a report of an engine's environment shows
ENGINE_ENV_VARS = (USE_V2_MODEL_RUNNER_ENV, DISABLED_KERNELS_ENV, USE_DEEP_GEMM_ENV)


def set_engine_env(settings: RolloutSettings, capability: tuple[int, int] | None) -> None:
    """The engine's environment, set before the engine (and its workers) start: vLLM's V1 model runner
    (``model_runner``), and on a GPU the kernels this GPU can run that keep the streamed codes (``cuda_kernel_env``)."""
    runner = model_runner_env(os.environ)
    if runner:
        logger.warning("qurl_vllm: %s=%s, vLLM's V1 model runner (the qurl sync has not run under Model Runner V2)",
                       USE_V2_MODEL_RUNNER_ENV, runner[USE_V2_MODEL_RUNNER_ENV])
        os.environ.update(runner)
    elif not user_chose_v2(os.environ):
        logger.warning("qurl_vllm: %s=%s, vLLM's V1 model runner (already set in this environment)",
                       USE_V2_MODEL_RUNNER_ENV, os.environ[USE_V2_MODEL_RUNNER_ENV])
    else:
        logger.warning("qurl_vllm: %s=%s is set: vLLM's Model Runner V2, on which the qurl sync (in-place reload, "
                       "graphs replayed over the new codes, level-2 sleep) has not run; unset it for the V1 runner",
                       USE_V2_MODEL_RUNNER_ENV, os.environ[USE_V2_MODEL_RUNNER_ENV])
    env = kernel_env(settings.format, nvidia_capability(capability), os.environ)
    if env:
        logger.warning("qurl_vllm: %s on compute capability %d.%d, for vLLM's kernel choice: %s",
                       settings.format.value, capability[0], capability[1], env)
        os.environ.update(env)


def prepare_engine(settings: RolloutSettings, *, vllm_version: str | None, hf_config: Mapping[str, Any],
                   model_path: str, tensor_parallel: int, capability: tuple[int, int] | None, on_cpu: bool,
                   amx: bool, enforce_eager: bool, dtype: object) -> tuple[str | None, dict]:
    """Refuse what this host's vLLM and GPU (``capability``, None without one) cannot run for this model
    (``hf_config``: its transformers config as a dict), set the engine's environment, and return (vLLM
    ``quantization``, ``hf_overrides``); ``dtype`` is the engine's (``rollout.dtype``). Runs in the process that builds the engine, before it starts."""
    check_vllm_version(vllm_version)
    check_architecture(hf_config.get("architectures"), model_path)
    if moe_experts(dict(hf_config)) is not None:
        check_quantized_experts(settings, vllm_version, on_cpu=on_cpu, amx=amx, cuda_graphs=not enforce_eager)
    check_fp8_hardware(settings, capability)
    check_int8_hardware(settings, capability)
    check_gpu_rollout_dtype(settings, dtype, capability)
    check_fp8_block_shapes(settings, dict(hf_config), tensor_parallel)
    check_fp8_channel_shapes(settings, dict(hf_config), tensor_parallel, capability)
    set_engine_env(settings, capability)
    return settings.engine_quantization()


def qurl_engine_kwargs(settings: RolloutSettings, engine_kwargs: dict, hf_config: Any, model_path: str) -> None:
    """Add the run's settings and its sync features' arguments to ``engine_kwargs`` (the user's vLLM
    ``engine_kwargs``, which verl passes after its own), in place; ``hf_config`` is the transformers config."""
    engine_kwargs["additional_config"] = settings.additional_config(engine_kwargs.get("additional_config"))
    if engine_kwargs.get("hf_overrides"):  # verl's own hf_overrides (the quantization config) would be replaced
        engine_kwargs["hf_overrides"] = settings.merged_hf_overrides(engine_kwargs["hf_overrides"])
    for feature in sync_features.build(settings):
        feature.engine_kwargs(engine_kwargs, hf_config, model_path)


def engine_env_report(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The values of ``ENGINE_ENV_VARS`` an engine starting now inherits (None: unset)."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in ENGINE_ENV_VARS}
