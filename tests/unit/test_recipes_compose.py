"""Every GPU recipe's run.sh x preset composes into verl's config and passes main_ppo's driver checks, with
no GPU and no download; bad presets, data paths and model paths fail with a message that says what to do."""
from __future__ import annotations

import json
import subprocess

import pytest
from omegaconf import OmegaConf

from qurl_recipes import recipes_check as rc
from qurl_recipes.data import math_datasets as md
from qurl_verl import settings as qs
from qurl_verl.driver import model_path as qc_path
from qurl_verl.driver import prepare as qc_prepare

PRESETS = ["bf16", "fp8", "fp8_fp8kv", "int8", "int8_fp8kv", "naive_int8", "tis_fp8", "tis_int8"]
EXPECTED = {  # preset -> (rollout.quantization, loss_mode, UAQ)
    "bf16": ("bf16", "vanilla", False),
    "naive_int8": ("int8", "vanilla", False),
    "tis_int8": ("int8", "qurl_tis", False),
    "tis_fp8": ("fp8", "qurl_tis", False),
    "int8": ("int8", "qurl_acr", True),
    "fp8": ("fp8", "qurl_acr", True),
    "int8_fp8kv": ("int8", "qurl_acr", True),
    "fp8_fp8kv": ("fp8", "qurl_acr", True),
}
# three recipes with every preset of the weights (the FP8 KV presets with one: they change the rollout's
# KV cache only, which test_recipe_group checks against every recipe); the 32B DAPO with the default preset
MATRIX = [(r, p) for r in ("deepscaler", "dapo", "gsm8k_ppo") for p in PRESETS if not p.endswith("_fp8kv")] + [
    ("deepscaler", "int8_fp8kv"), ("dapo_32b", "int8"), ("dapo_1node", "int8")]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    for recipe, folder in (("deepscaler", "deepscaler"), ("dapo", "dapo")):
        md.write_recipe_data(recipe, root / folder)
    return root


@pytest.fixture(scope="module")
def local_qwen2(tmp_path_factory):
    """A local Qwen2 checkpoint folder: verl's check of a critic reads its model's config and tokenizer."""
    from qurl_recipes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "qwen2")


@pytest.fixture(autouse=True)
def offline(monkeypatch, data_root):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a dry run must not need the hub, even to look
    monkeypatch.delenv(qs.DRY_RUN_ENV, raising=False)
    for name in ("MODEL_PATH", "NNODES", "NGPUS_PER_NODE", "QURL_OUTPUT_DIR", "UAQ_CACHE_DIR", "SIZE", "DATA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(rc.DATA_DIR_ENV, str(data_root))


def test_shipped_presets_are_the_ones_checked():
    assert rc.available_presets() == PRESETS


@pytest.mark.parametrize("recipe,preset", MATRIX)
def test_recipe_with_preset_passes_driver_checks(recipe, preset, data_root, local_qwen2, monkeypatch):
    if recipe == "gsm8k_ppo":
        monkeypatch.setenv("MODEL_PATH", str(local_qwen2))
    cfg = rc.check_recipe(recipe, preset, data_root)
    quant, loss, uaq = EXPECTED[preset]
    if recipe == "gsm8k_ppo":
        uaq = False  # the paper's setting: its run.sh turns the preset's UAQ off
    rollout, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    assert (rollout.name, rollout.quantization, actor.policy_loss.loss_mode, bool(cfg.qurl.uaq.enable)) == ("qurl_vllm", quant, loss, uaq)
    if recipe == "gsm8k_ppo":
        assert cfg.actor_rollout_ref.model.path == cfg.critic.model.path == str(local_qwen2)
        assert (cfg.algorithm.adv_estimator, actor.optim.lr, cfg.critic.optim.lr) == ("gae", 1e-5, 1e-5)
        assert (rollout.n, cfg.data.train_batch_size, actor.ppo_mini_batch_size) == (1, 256, 64)
        assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (512, 512)
        assert (rollout.val_kwargs.n, rollout.val_kwargs.do_sample) == (1, False)
        assert cfg.data.train_files == str(data_root / "gsm8k" / "train.parquet")
        assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 1
        return
    assert actor.optim.lr == 1e-6
    assert not cfg.actor_rollout_ref.model.path.startswith("/")  # the hub id, not converted in a dry run
    if recipe == "deepscaler":
        assert cfg.actor_rollout_ref.model.path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
        assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_in_reward
        assert (actor.use_kl_loss, actor.kl_loss_type, actor.kl_loss_coef) == (True, "low_var_kl", 0.001)
        assert (rollout.n, rollout.temperature, cfg.data.train_batch_size, actor.ppo_mini_batch_size) == (8, 0.6, 128, 64)
        assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (2048, 8192)
        assert cfg.reward.custom_reward_function.path == md.RECIPES["deepscaler"].reward_function
        # in training: AIME 2024 at n = 8 every 20 steps, as DeepScaleR; the paper's Avg@32 is the VAL_ONLY run
        assert (rollout.val_kwargs.n, rollout.val_kwargs.do_sample, cfg.trainer.test_freq) == (8, True, 20)
        assert cfg.data.val_files == str(data_root / "deepscaler" / "val_aime2024.parquet")
        assert cfg.trainer.total_training_steps == 1040
    else:
        big, one_node = recipe == "dapo_32b", recipe == "dapo_1node"
        assert cfg.actor_rollout_ref.model.path == ("Qwen/Qwen2.5-32B" if big else "Qwen/Qwen2.5-Math-7B")
        assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c, actor.loss_agg_mode) == (0.2, 0.28, 10.0, "token-mean")
        assert not actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward
        assert (rollout.n, cfg.data.train_batch_size, actor.ppo_mini_batch_size) == (16, 128 if one_node else 512, 32)
        # one node: 4x the steps of 4x fewer prompts, so the same prompts and the same 3,200 optimizer updates
        steps = cfg.trainer.total_training_steps
        assert (steps, steps * cfg.data.train_batch_size // actor.ppo_mini_batch_size) == (800 if one_node else 200, 3200)
        assert cfg.reward.reward_manager.name == "dapo" and cfg.reward.custom_reward_function.path is None
        kw = cfg.reward.reward_kwargs
        assert dict(kw.overlong_buffer_cfg) == {"enable": True, "len": 4096, "penalty_factor": 1.0, "log": False}
        assert kw.max_resp_len == cfg.data.max_response_length == (20480 if big else 8192)
        assert (cfg.algorithm.filter_groups.enable, cfg.algorithm.filter_groups.metric) == (True, "acc")
        assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == (128 if big else 8 if one_node else 64)
        context = (cfg.actor_rollout_ref.model.override_config.get("max_position_embeddings"),
                   OmegaConf.select(rollout, "engine_kwargs.vllm.hf_overrides.max_position_embeddings"))
        assert context == ((None, None) if big else (32768, 32768))
        assert rollout.val_kwargs.n == 32


def test_run_sh_command_lines():
    """The scripts pass the groups the way a user types them, plus the preset's keys a recipe needs."""
    assert rc.recipe_overrides("deepscaler", "int8", extra=["trainer.total_epochs=1"]) == [
        "+qurl_recipe=deepscaler", "+qurl=int8", "trainer.total_epochs=1"]
    assert rc.recipe_overrides("deepscaler", "none") == ["+qurl_recipe=deepscaler", "actor_rollout_ref.rollout.name=vllm"]
    assert rc.recipe_overrides("dapo_32b", "fp8") == ["+qurl_recipe=dapo_32b", "+qurl=fp8", f"++qurl.uaq.cache_dir={rc.REPO}/outputs/uaq-cache"]
    assert rc.recipe_overrides("dapo", "bf16", env={"UAQ_CACHE_DIR": "/shared/uaq"})[2] == "++qurl.uaq.cache_dir=/shared/uaq"
    assert rc.recipe_overrides("dapo", "none") == ["+qurl_recipe=dapo", "actor_rollout_ref.rollout.name=vllm"]
    assert rc.recipe_overrides("dapo_1node", "int8")[:2] == ["+qurl_recipe=dapo_1node", "+qurl=int8"]
    assert rc.recipe_overrides("deepscaler", "int8", env={"VAL_ONLY": "1"}) == [
        "+qurl_recipe=deepscaler", "+qurl=int8", "trainer.val_only=true", "trainer.val_before_train=true",
        "data.val_files=${qurl_recipe.final_val_files}", "actor_rollout_ref.rollout.val_kwargs.n=32"]
    assert rc.recipe_overrides("gsm8k_ppo", "fp8") == ["+qurl_recipe=gsm8k_ppo", "+qurl=fp8", "qurl.uaq.enable=false"]
    assert rc.recipe_overrides("tiny_cpu", "int8") == ["+qurl_recipe=tiny_cpu", "+qurl=int8"]  # no script: the groups alone


def test_stock_rollout_and_extra_overrides():
    cfg = rc.check_overrides(rc.recipe_overrides("deepscaler", "none", extra=["actor_rollout_ref.rollout.n=16"]))
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and "qurl" not in cfg
    assert cfg.actor_rollout_ref.rollout.n == 16  # arguments after the recipe's own win


def test_run_sh_dry_run_entry_point(capsys):
    overrides = rc.recipe_overrides("dapo", "fp8")
    assert rc.main(["--dry-run", "--", *overrides]) == 0
    out = capsys.readouterr().out
    assert "dry run ok: model=Qwen/Qwen2.5-Math-7B rollout=qurl_vllm/fp8 loss=qurl_acr uaq=on adv=grpo" in out
    assert "response=8192 max_position_embeddings=trainer:32768,vllm:32768 steps=200 val=val.parquet@32/10steps gpus=8x8" in out
    assert rc.main(["--dry-run", "--", *rc.recipe_overrides("deepscaler", "int8")]) == 0
    assert "response=8192 steps=1040 val=val_aime2024.parquet@8/20steps gpus=1x8" in capsys.readouterr().out
    assert rc.main(["--dry-run", "--", *rc.recipe_overrides("deepscaler", "bf16", env={"VAL_ONLY": "1"})]) == 0
    assert "val_only val.parquet gpus=1x8" in capsys.readouterr().out


def test_write_data_entry_point(tmp_path, capsys):
    """What run.sh runs before main_ppo: the recipe's data, written once where the composed config reads it."""
    overrides = rc.recipe_overrides("deepscaler", "bf16")
    assert rc.main(["--write-data", "--data-root", str(tmp_path), "--", *overrides]) == 0
    assert f"deepscaler data (shipped): {tmp_path / 'deepscaler'}" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "deepscaler").iterdir()) == [
        "train.parquet", "val.parquet", "val_aime2024.parquet", rc.SOURCE_RECORD]
    assert rc.main(["--write-data", "--dry-run", "--data-root", str(tmp_path), "--", *overrides]) == 0
    assert "dry run ok: model=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B rollout=qurl_vllm/bf16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        rc.main(["--", *overrides])  # neither --dry-run nor --write-data


def test_unknown_preset_is_named_with_the_choices(data_root):
    with pytest.raises(rc.RecipeCheckError, match=r"unknown preset 'int4'; choose one of bf16, fp8, fp8_fp8kv, int8, int8_fp8kv, naive_int8, tis_fp8, tis_int8"):
        rc.check_overrides(["+qurl=int4"])
    p = subprocess.run(["bash", "recipes/deepscaler/run.sh", "--print-overrides"], cwd=rc.REPO, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "PRESET": "int4"})
    assert p.returncode == 2 and "unknown PRESET=int4; choose one of: bf16 fp8 fp8_fp8kv int8 int8_fp8kv naive_int8 tis_fp8 tis_int8" in p.stderr
    p = subprocess.run(["bash", "recipes/dapo/run.sh", "--print-overrides"], cwd=rc.REPO, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "SIZE": "70b"})
    assert p.returncode == 2 and "unknown SIZE=70b; choose 7b, 7b_1node or 32b" in p.stderr


def test_missing_data_file(tmp_path, monkeypatch):
    monkeypatch.setenv(rc.DATA_DIR_ENV, str(tmp_path / "nowhere"))
    overrides = rc.recipe_overrides("deepscaler", "int8")
    with pytest.raises(rc.RecipeCheckError, match=r"data.train_files=.*nowhere/deepscaler/train.parquet: no such file.*--write-data"):
        rc.check_overrides(overrides)


def test_unsupported_model_paths(tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(qs.QurlConfigError, match=r"qurl_vllm does not know how to quantize .*GPT2LMHeadModel"):
        rc.check_overrides(rc.recipe_overrides("deepscaler", "int8", extra=[f"actor_rollout_ref.model.path={gpt2}"]))
    with pytest.raises(qs.QurlConfigError, match=r"model.path=/no/such/model does not exist"):
        rc.check_overrides(rc.recipe_overrides("deepscaler", "bf16", extra=["actor_rollout_ref.model.path=/no/such/model"]))


def test_hub_id_check_relaxed_only_in_a_dry_run(monkeypatch):
    from qurl_recipes.compose import compose_ppo_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose_ppo_config(["actor_rollout_ref.rollout.name=qurl_vllm", "actor_rollout_ref.model.path=org/model"])
    with pytest.raises(qs.QurlConfigError, match="HF_HUB_OFFLINE=1 forbids downloading it"):
        qc_path.check_model_path(cfg, qs.UaqSettings())
    monkeypatch.setenv(qs.DRY_RUN_ENV, "1")
    qc_path.check_model_path(cfg, qs.UaqSettings())


def test_dry_run_reports_uaq_without_converting(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"qurl": {"uaq": {"enable": True, "scale": 1.5, "targets": ["q_proj"], "cache_dir": str(tmp_path / "c")}},
                            "actor_rollout_ref": {"model": {"path": "org/model"}}})
    monkeypatch.setenv(qs.DRY_RUN_ENV, "1")
    logs = []
    qc_prepare.prepare_config(cfg, qs.UaqSettings.from_config(cfg), log=logs.append)
    assert cfg.actor_rollout_ref.model.path == "org/model" and not (tmp_path / "c").exists()
    assert logs == ["[qurl] dry run: would apply UAQ (s=1.5, q_proj) to org/model and point the actor at the converted copy"]


def test_uaq_fetches_a_hub_checkpoint_before_converting(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: calls.append(repo) or str(tmp_path))
    assert qc_prepare.local_checkpoint("org/model") == tmp_path and calls == ["org/model"]
    assert qc_prepare.local_checkpoint(str(tmp_path)) == tmp_path and calls == ["org/model"]  # local folders are used as they are

    def offline(repo, **kw):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(qs.QurlConfigError, match=r"cannot fetch actor_rollout_ref.model.path=org/model .*download the checkpoint"):
        qc_prepare.local_checkpoint("org/model")
