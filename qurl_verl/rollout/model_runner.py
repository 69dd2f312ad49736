"""Which vLLM model runner a ``qurl_vllm`` engine runs: the V1 runner, pinned by the server.

vLLM 0.24 makes its Model Runner V2 the default on GPUs for ``Qwen3ForCausalLM``, ``LlamaForCausalLM``,
``MistralForCausalLM`` and a few MoE architectures whenever Triton is importable
(``vllm/config/vllm.py``: ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``, ``VllmConfig.use_v2_model_runner``); vLLM
0.32 makes it the default for every architecture. MRv2 captures its own CUDA graphs and allocates its sampler
and model state inside ``load_model``, in the memory pool that level-2 sleep frees; the qurl reload (pointers kept
through ``initialize_layerwise_reload`` / ``finalize_layerwise_reload``, graphs replayed over the new codes) has
run on the V1 runner only. Until a qurl sync has run under MRv2 on a GPU (``tests/gpu/check_qurl_vllm_cuda.py
--model-runner v2``), the server sets ``VLLM_USE_V2_MODEL_RUNNER=0`` before the engine and its workers start.
A user who sets the variable keeps their choice, with a warning when it is MRv2. vLLM reads the variable when
it builds the engine's config (``envs.VLLM_USE_V2_MODEL_RUNNER``, cached once the engine has started), so it
must be in the server's environment before then: ``_apply_quantization`` runs before verl builds the engine.
"""
from __future__ import annotations

from collections.abc import Mapping

USE_V2_MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
V1_RUNNER = "0"


def model_runner_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``VLLM_USE_V2_MODEL_RUNNER=0`` unless ``environ`` already names a runner."""
    if USE_V2_MODEL_RUNNER_ENV in environ:
        return {}
    return {USE_V2_MODEL_RUNNER_ENV: V1_RUNNER}


def user_chose_v2(environ: Mapping[str, str]) -> bool:
    """The user asked for MRv2 themselves (the qurl sync is untested there); read as vLLM reads it
    (``envs.maybe_convert_bool``: ``bool(int(value))``; vLLM itself refuses a value that is not an integer)."""
    try:
        return bool(int(environ.get(USE_V2_MODEL_RUNNER_ENV, "0")))
    except ValueError:
        return False


# vLLM's Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``; vLLM-CPU's MRv2 runner subclasses it); the V1
# runner is ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (and the CPU one, its subclass)
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"


def runner_report(runner: object) -> dict[str, str]:
    """Which model runner a worker holds: {"runner": "v1" or "v2", "class": its module and class}. Read in the
    worker (the environment says what was asked for; this, what vLLM built)."""
    cls = type(runner)
    v2 = any(base.__module__ == V2_RUNNER_MODULE for base in cls.__mro__)
    return {"runner": "v2" if v2 else "v1", "class": f"{cls.__module__}.{cls.__qualname__}"}
