"""A verl user who installs qurl-verl keeps the verdicts of stock verl on every config that does not use it.

Each stock config is composed and validated as ``main_ppo`` does, once in a process where verl
loads the plugin and once with ``VERL_USE_EXTERNAL_PLUGINS=none``; verdicts (and the config
itself) must be identical. A qurl config, checked the same way, must differ: that keeps the
comparison able to fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# From verl's examples/grpo_trainer/run_qwen3-1.7b.sh (volcengine/verl), the data paths written out.
GRPO_EXAMPLE = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=/data/gsm8k/train.parquet",
    "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen3-1.7B",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=80",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=3",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=[console,wandb]",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=-1",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]
BASE = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]
STOCK = {
    "grpo_example": GRPO_EXAMPLE,
    "hdfs_path": [*BASE, "actor_rollout_ref.model.path=hdfs://cluster/models/Qwen3-4B"],
    "hub_id_offline": [*BASE, "actor_rollout_ref.model.path=Qwen/Qwen3-4B"],
    "missing_local_path": [*BASE, "actor_rollout_ref.model.path=/nonexistent/model"],
    "vanilla_loss_with_bypass": [*BASE, "actor_rollout_ref.model.path=/m", "algorithm.rollout_correction.bypass_mode=true"],
    "stock_verl_refuses": [*BASE, "actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.ppo_micro_batch_size=4"],
    # the legacy trainer, which the driver refuses for qurl runs only
    "legacy_trainer": [*BASE, "actor_rollout_ref.model.path=/m", "trainer.use_v1=false"],
}
QURL = {"qurl_rollout_missing_path": [*BASE[:1], *BASE[2:], "actor_rollout_ref.rollout.name=qurl_vllm",
                                      "actor_rollout_ref.model.path=/nonexistent/model"]}

VERDICTS = textwrap.dedent("""
    import json, os, sys
    from qurl_recipes.compose import compose_ppo_config, validate_like_main_ppo
    import verl
    out = {"plugin": sorted(sys.modules.get("qurl_verl._verl_plugin").STATUS) if "qurl_verl._verl_plugin" in sys.modules else []}
    for name, overrides in json.loads(sys.argv[1]).items():
        cfg = compose_ppo_config(overrides)
        before = json.dumps(__import__("omegaconf").OmegaConf.to_container(cfg), sort_keys=True, default=str)
        try:
            validate_like_main_ppo(cfg)
            verdict = "ok"
        except Exception as e:
            verdict = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        after = json.dumps(__import__("omegaconf").OmegaConf.to_container(cfg), sort_keys=True, default=str)
        out[name] = {"verdict": verdict, "config_changed": before != after}
    out["env"] = {k: os.environ.get(k) for k in ("VERL_ENGINE_DEVICE", "QURL_VLLM_LAYERWISE_RELOAD")}
    print("VERDICTS " + json.dumps(out))
""")


def verdicts(configs: dict, plugins: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_PLUGINS", "VERL_ENGINE_DEVICE", "QURL_VLLM_LAYERWISE_RELOAD")}
    env["HF_HUB_OFFLINE"] = "1"
    if not plugins:
        env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    p = subprocess.run([sys.executable, "-c", VERDICTS, json.dumps(configs)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert "VERDICTS " in p.stdout, p.stderr[-3000:]
    return json.loads(p.stdout.split("VERDICTS ", 1)[1])


@pytest.fixture(scope="module")
def both():
    configs = {**STOCK, **QURL}
    return verdicts(configs, plugins=True), verdicts(configs, plugins=False)


def test_the_plugin_was_loaded_in_one_process_only(both):
    with_plugin, without = both
    assert with_plugin["plugin"] == ["config checks", "cpu platform", "losses", "rollout"]
    assert without["plugin"] == []


@pytest.mark.parametrize("name", sorted(STOCK))
def test_stock_config_gets_stock_verls_verdict(both, name):
    with_plugin, without = both
    assert with_plugin[name] == without[name]


def test_stock_verdicts_include_a_refusal_and_a_pass(both):
    """The comparison covers both outcomes of verl's own checks."""
    _, without = both
    assert without["grpo_example"]["verdict"] == "ok"
    assert without["stock_verl_refuses"]["verdict"] != "ok"


def test_no_process_wide_side_effect_without_the_cpu_platform(both):
    with_plugin, without = both
    assert with_plugin["env"] == without["env"] == {"VERL_ENGINE_DEVICE": None, "QURL_VLLM_LAYERWISE_RELOAD": None}


def test_a_qurl_config_is_checked(both):
    with_plugin, without = both
    assert "does not exist" in with_plugin["qurl_rollout_missing_path"]["verdict"]
    assert with_plugin["qurl_rollout_missing_path"] != without["qurl_rollout_missing_path"]
