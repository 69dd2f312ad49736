"""What the GPU recipes start with by default: DAPO's 32k context on Qwen2.5-Math-7B reaches both verl's and
vLLM's copy of the model config (without replacing qurl_vllm's quantization config), and the scripts run the
user's `python` on the full data, the shipped sample only for dry runs."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from qurl_recipes import recipes_check as rc
from qurl_recipes.compose import compose_ppo_config
from qurl_verl.settings import QurlConfigError, RolloutSettings

ROOT = Path(__file__).resolve().parents[2]
MATH_7B = ROOT / "recipes" / "dapo" / "Qwen2.5-Math-7B"  # its config.json as published (no weights)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("MODEL_PATH", "NNODES", "NGPUS_PER_NODE", "QURL_OUTPUT_DIR", "QURL_DATA_DIR", "DATA", "SIZE", "VAL_ONLY",
                 "PYTHON", "PRESET"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("recipe", ["dapo", "dapo_1node"])
def test_dapo_context_reaches_verl_and_vllm(recipe, monkeypatch):
    from transformers import AutoConfig
    from verl.utils.model import update_model_config
    from verl.workers.rollout.utils import get_max_position_embeddings  # verl's check of max_model_len

    monkeypatch.setenv("MODEL_PATH", str(MATH_7B))
    cfg = compose_ppo_config([f"+qurl_recipe={recipe}", "+qurl=int8"])
    published = AutoConfig.from_pretrained(MATH_7B)
    needed = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert published.max_position_embeddings == 4096 < needed  # why the recipe overrides it
    # verl: the trainer's config, through model.override_config (as verl's HFModelConfig applies it)
    trainer = AutoConfig.from_pretrained(MATH_7B)
    update_model_config(trainer, override_config_kwargs=OmegaConf.to_container(cfg.actor_rollout_ref.model.override_config, resolve=True))
    assert get_max_position_embeddings(trainer) == 32768
    # vLLM: config.json with hf_overrides applied, which qurl_vllm's server merges with its quantization config
    rollout = cfg.actor_rollout_ref.rollout
    user = OmegaConf.to_container(rollout.engine_kwargs.vllm.hf_overrides, resolve=True)
    assert user == {"max_position_embeddings": 32768}
    merged = RolloutSettings.from_rollout_config(rollout).merged_hf_overrides(user)
    assert merged["max_position_embeddings"] == 32768 and merged["quantization_config"]["quant_method"] == "compressed-tensors"
    engine = AutoConfig.from_pretrained(MATH_7B, **{k: v for k, v in merged.items() if k != "quantization_config"})
    assert engine.max_position_embeddings == get_max_position_embeddings(trainer) >= needed
    assert not engine.use_sliding_window  # no 4k window left to cap the length


def test_hf_overrides_merge_keeps_the_presets_quantization():
    assert RolloutSettings(format="bf16").merged_hf_overrides({"max_position_embeddings": 8}) == {"max_position_embeddings": 8}
    assert set(RolloutSettings(format="int8").merged_hf_overrides(None)) == {"quantization_config"}
    with pytest.raises(QurlConfigError, match=r"hf_overrides.quantization_config: qurl_vllm builds"):
        RolloutSettings(format="fp8").merged_hf_overrides({"quantization_config": {}})


def test_dapo_dry_run_on_the_published_config(tmp_path, monkeypatch):
    """The driver's checks (dry run) accept the recipe on Qwen2.5-Math-7B's own config.json, no hub."""
    from qurl_recipes.data import math_datasets as md

    md.write_recipe_data("dapo", tmp_path / "dapo")
    monkeypatch.setenv(rc.DATA_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = rc.check_overrides(rc.recipe_overrides("dapo_1node", "int8", extra=[f"actor_rollout_ref.model.path={MATH_7B}"]))
    assert cfg.actor_rollout_ref.model.override_config.max_position_embeddings == 32768


def fake_python(tmp_path: Path) -> Path:
    """A `python` on PATH that records how the script called it (and QURL_DATA_DIR) and succeeds."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "python"
    script.write_text('#!/bin/bash\necho "CALL QURL_DATA_DIR=${QURL_DATA_DIR:-unset} $*" >> "$CALLS"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.mark.parametrize("script", ["deepscaler", "dapo", "gsm8k_ppo"])
def test_gpu_scripts_use_the_users_python_and_full_data(script, tmp_path):
    bin_dir = fake_python(tmp_path)
    calls = tmp_path / "calls"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "CALLS": str(calls)}
    for mode in ("--dry-run", None):
        calls.write_text("")
        args = ["bash", f"recipes/{script}/run.sh", *([mode] if mode else [])]
        p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        lines = calls.read_text().splitlines()
        assert lines and all(x.startswith("CALL ") for x in lines)  # the PATH's python, not the repository's .venv
        write = lines[0]
        assert "-m qurl_recipes.recipes_check --write-data" in write
        hub = script != "gsm8k_ppo" and mode is None
        assert ("--source hub" in write) == hub and ("--source shipped" in write) == (not hub)
        shipped_dir = f"QURL_DATA_DIR={tmp_path}/data/qurl/shipped" if script != "gsm8k_ppo" and not hub else "QURL_DATA_DIR=unset"
        assert write.startswith(f"CALL {shipped_dir} "), write
        if mode is None:
            assert "-m verl.trainer.main_ppo" in lines[1]
    assert not os.path.exists(tmp_path / "data")  # the fake python wrote nothing
