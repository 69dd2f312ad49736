"""The runtime environment ``main_ppo`` hands ``ray.init``: what a qurl-verl run adds, against stock verl's.

Each case runs in a fresh process that imports ``verl.trainer.main_ppo`` as the command line does,
once with the plugin and once with verl's plugins off (stock verl's verdict), and prints the
``runtime_env`` that ``main_ppo`` itself would pass to ``ray.init``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from qurl_verl.patches.always import ray_runtime_env

PRINT_RUNTIME_ENV = """
    import json, sys
    import verl.trainer.main_ppo as main_ppo
    from qurl_recipes.compose import compose_ppo_config
    cfg = compose_ppo_config(json.loads(sys.argv[1]))
    print("RUNTIME_ENV" + json.dumps(main_ppo.get_ppo_ray_runtime_env(cfg), sort_keys=True))
"""
# verl's own variables our wrapper must leave as verl computes them; the rest of the driver's
# environment is cleared so that both processes see the same one.
DRIVER_ENV = {"QURL_WEIGHT_SYNC_ACK_TIMEOUT_S": "90", "VLLM_CPU_KVCACHE_SPACE": "1",
              ray_runtime_env.FILE_LOGGER_ENV: "metrics/run.jsonl", "HF_HUB_OFFLINE": "1",
              "UNRELATED_VARIABLE": "x"}


def runtime_env(overrides: list[str], env: dict[str, str], plugin: bool, cwd) -> dict:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("QURL_", "VLLM_CPU_", "VERL_")) and k not in ray_runtime_env.FORWARDED}
    if not plugin:
        base["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(PRINT_RUNTIME_ENV), json.dumps(overrides)],
                         capture_output=True, text=True, env={**base, **env}, timeout=240, cwd=cwd)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RUNTIME_ENV")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line[len("RUNTIME_ENV"):])


@pytest.fixture(scope="module")
def qurl_overrides(tmp_path_factory) -> list[str]:
    """A qurl run the driver's checks pass (they run here too: ``run_ppo`` reaches the wrapper before Ray whether
    or not the entry point called verl's ``validate_config``)."""
    from qurl_recipes.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("runtime_env") / "tiny")
    return ["actor_rollout_ref.rollout.name=qurl_vllm", f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
            "actor_rollout_ref.model.use_remove_padding=false",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "+actor_rollout_ref.rollout.enable_sleep_mode=false", "trainer.device=cpu"]


def test_a_qurl_run_forwards_its_variables_and_nothing_else_changes(tmp_path, qurl_overrides):
    stock = runtime_env(qurl_overrides, DRIVER_ENV, plugin=False, cwd=tmp_path)
    ours = runtime_env(qurl_overrides, DRIVER_ENV, plugin=True, cwd=tmp_path)
    added = {k: v for k, v in ours["env_vars"].items() if stock["env_vars"].get(k) != v}
    assert added == {
        "QURL_WEIGHT_SYNC_ACK_TIMEOUT_S": "90",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        ray_runtime_env.FILE_LOGGER_ENV: str(tmp_path / "metrics" / "run.jsonl"),  # the driver's directory
    }
    assert {k: v for k, v in ours.items() if k != "env_vars"} == {k: v for k, v in stock.items() if k != "env_vars"}
    assert set(stock["env_vars"]) <= set(ours["env_vars"])


def test_the_cpu_platform_travels_to_workers_of_an_outside_cluster(tmp_path, qurl_overrides):
    env = {**DRIVER_ENV, "VERL_PLATFORM": "cpu"}
    stock_rollout = [o.replace("name=qurl_vllm", "name=vllm") for o in qurl_overrides]
    ours = runtime_env(stock_rollout, env, plugin=True, cwd=tmp_path)  # the CPU platform alone makes a run a qurl one
    assert ours["env_vars"]["VERL_PLATFORM"] == "cpu"
    assert ours["env_vars"]["VERL_ENGINE_DEVICE"] == "cuda"  # set by the CPU platform's engine-lookup patch


def test_a_run_without_qurl_gets_stock_verls_runtime_env(tmp_path):
    assert runtime_env([], DRIVER_ENV, plugin=True, cwd=tmp_path) == runtime_env([], DRIVER_ENV, plugin=False, cwd=tmp_path)


@pytest.mark.parametrize("path, want", [("m.jsonl", "{cwd}/m.jsonl"), ("/abs/m.jsonl", "/abs/m.jsonl")])
def test_forwarded_env_keeps_only_the_runs_variables(monkeypatch, tmp_path, path, want):
    monkeypatch.chdir(tmp_path)
    env = {"QURL_CACHE_DIR": "/c", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_LOGGING_LEVEL": "INFO",
           "VERL_PLATFORM": "cpu", ray_runtime_env.FILE_LOGGER_ENV: path, "PATH": "/bin"}
    assert ray_runtime_env.forwarded_env(env) == {
        "QURL_CACHE_DIR": "/c", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VERL_PLATFORM": "cpu",
        ray_runtime_env.FILE_LOGGER_ENV: want.format(cwd=tmp_path),
    }


def test_an_entry_point_without_validate_config_still_runs_the_checks_before_ray(tmp_path):
    """verl 0.9.1's fully-async trainer (``fully_async_policy.fully_async_main``) calls ``run_ppo`` without
    ``validate_config``: through the wrapper, a refused ``+qurl=int8`` command line stops in the driver with the
    same one message ``main_ppo`` gives, before Ray starts (stock verl goes on into Ray)."""
    command = [sys.executable, "-m", "verl.experimental.fully_async_policy.fully_async_main", "+qurl=int8",
               f"actor_rollout_ref.model.path={tmp_path}/missing", "trainer.device=cpu"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("QURL_", "VERL_"))}, "VERL_PLATFORM": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    err = done.stdout + done.stderr
    assert done.returncode != 0
    assert "skips verl's validate_config" in err and f"actor_rollout_ref.model.path={tmp_path}/missing does not exist" in err, err[-3000:]
    assert "ray init kwargs" not in err  # stopped before Ray

