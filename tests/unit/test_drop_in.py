"""`+qurl=<preset>` appended to verl's own example command lines, and the cluster layouts they run on:
each composes into a qurl run or stops in the driver with one message that names the fix."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_plugin_neutrality import GRPO_EXAMPLE

from qurl_recipes.compose import compose_ppo_config
from qurl_verl import driver
from qurl_verl.platform.host import Host
from qurl_verl.rollout.engine_checks import check_fp8_hardware
from qurl_verl.settings import QurlConfigError, RolloutSettings

PRESETS = ("bf16", "naive_int8", "tis_int8", "tis_fp8", "int8", "fp8", "int8_fp8kv", "fp8_fp8kv")
UAQ_PRESETS = ("int8", "fp8", "int8_fp8kv", "fp8_fp8kv")

# From verl's recipe/dapo/test_dapo_7b_math.sh (volcengine/verl), shell variables written out and the
# `reward_model.*` keys renamed to verl 0.9.1's `reward.*`; it runs on 8 nodes and resumes automatically.
DAPO_SCRIPT = [
    "data.train_files=/data/dapo-math-17k.parquet", "data.val_files=/data/aime-2024.parquet",
    "data.prompt_key=prompt", "data.truncation=left", "data.max_prompt_length=2048",
    "data.max_response_length=8192", "data.train_batch_size=512", "actor_rollout_ref.rollout.n=16",
    "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.0",
    "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.kl_loss_coef=0.0",
    "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.clip_ratio_c=10.0", "actor_rollout_ref.model.use_remove_padding=True",
    "+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
    "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-Math-7B", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
    "actor_rollout_ref.actor.optim.weight_decay=0.1", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.grad_clip=1.0",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.80", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    "actor_rollout_ref.rollout.enable_chunked_prefill=True", "actor_rollout_ref.rollout.max_num_batched_tokens=10240",
    "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
    "actor_rollout_ref.rollout.val_kwargs.top_k=-1", "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
    "actor_rollout_ref.rollout.val_kwargs.n=1", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4", "actor_rollout_ref.actor.fsdp_config.fsdp_size=32",
    "reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward.reward_kwargs.overlong_buffer_cfg.len=4096", "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward.reward_kwargs.overlong_buffer_cfg.log=False", "+reward.reward_kwargs.max_resp_len=8192",
    "trainer.logger=[console,wandb]", "trainer.project_name=DAPO", "trainer.experiment_name=DAPO-Qwen2.5-7b-MATH",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=8", "trainer.val_before_train=True", "trainer.test_freq=10",
    "trainer.save_freq=10", "trainer.total_epochs=10", "trainer.total_training_steps=200",
    "trainer.default_local_dir=/nonexistent/ckpts/DAPO", "trainer.resume_mode=auto", "trainer.log_val_generations=10",
]


@pytest.fixture(autouse=True)
def offline_dry_run(monkeypatch):
    monkeypatch.setenv("QURL_DRY_RUN", "1")  # hub ids are not fetched, UAQ is not applied
    monkeypatch.delenv("VERL_PLATFORM", raising=False)


@pytest.mark.parametrize("preset", PRESETS)
def test_grpo_example_with_a_preset_names_the_override_to_remove(preset):
    cfg = compose_ppo_config([*GRPO_EXAMPLE, f"+qurl={preset}"])
    with pytest.raises(QurlConfigError) as e:
        driver.check_config(cfg)
    assert str(e.value) == (
        f"`+qurl={preset}` selects actor_rollout_ref.rollout.name=qurl_vllm, but the command line sets "
        f"actor_rollout_ref.rollout.name=vllm after it: remove that override (the preset sets the rollout), "
        f"or drop +qurl={preset} to run verl's stock rollout")


@pytest.mark.parametrize("preset", PRESETS)
def test_grpo_example_without_the_rollout_override_is_a_qurl_run(preset):
    overrides = [o for o in GRPO_EXAMPLE if not o.startswith("actor_rollout_ref.rollout.name=")]
    settings = driver.check_config(compose_ppo_config([*overrides, f"+qurl={preset}"]))
    weights = preset.removesuffix("_fp8kv")
    assert settings.rollout is not None and settings.rollout.format.value == ("bf16" if preset == "bf16" else "fp8" if "fp8" in weights else "int8")
    assert settings.rollout.kv_cache.value == ("fp8" if preset.endswith("_fp8kv") else "auto")
    assert (settings.loss is None) == (preset in ("bf16", "naive_int8"))


@pytest.mark.parametrize("preset", PRESETS)
def test_dapo_script_on_eight_nodes_with_a_preset(preset):
    cfg = compose_ppo_config([*DAPO_SCRIPT, f"+qurl={preset}"])
    if preset not in UAQ_PRESETS:
        assert not driver.check_config(cfg).uaq.enable
        return
    with pytest.raises(QurlConfigError, match=r"trainer.nnodes=8 with UAQ: .*set qurl.uaq.cache_dir=<shared folder>"):
        driver.check_config(cfg)
    shared = compose_ppo_config([*DAPO_SCRIPT, f"+qurl={preset}", "qurl.uaq.cache_dir=/shared/uaq"])
    assert driver.check_config(shared).uaq.cache_dir == "/shared/uaq"


@pytest.mark.parametrize("capability, fmt, refused", [
    ((8, 0), "fp8", True), ((8, 6), "fp8_block", True), ((8, 9), "fp8", False), ((9, 0), "fp8", False),
    ((8, 0), "int8", False), ((8, 0), "bf16", False), (None, "fp8", False),
])
def test_fp8_below_capability_8_9_is_refused(capability, fmt, refused):
    """A100/A6000 would run weight-only FP8 silently; no CUDA (None) leaves the check to the servers."""
    if refused:
        with pytest.raises(QurlConfigError, match=r"needs FP8 tensor cores .* Use actor_rollout_ref.rollout.quantization=int8"):
            check_fp8_hardware(RolloutSettings(format=fmt), capability)
    else:
        check_fp8_hardware(RolloutSettings(format=fmt), capability)


def test_the_driver_asks_the_gpu_it_sees():
    a100 = dataclasses.replace(Host.probe(), cuda_capability=(8, 0))  # an A100's capability, the rest as probed
    overrides = [o for o in GRPO_EXAMPLE if not o.startswith("actor_rollout_ref.rollout.name=")]
    with pytest.raises(QurlConfigError, match="this GPU has 8.0"):
        driver.check_config(compose_ppo_config([*overrides, "+qurl=tis_fp8"]), host=a100)
    driver.check_config(compose_ppo_config([*overrides, "+qurl=tis_int8"]), host=a100)
    v100 = dataclasses.replace(a100, cuda_capability=(7, 0))  # below vLLM's W8A8 INT8 scheme's 7.5
    with pytest.raises(QurlConfigError, match="INT8 tensor cores .* this GPU has 7.0"):
        driver.check_config(compose_ppo_config([*overrides, "+qurl=tis_int8"]), host=v100)


def write_checkpoint(base, step, record):
    hf = base / f"global_step_{step}" / "actor" / "huggingface"
    hf.mkdir(parents=True)
    config = {"architectures": ["Qwen2ForCausalLM"], **({"qurl_uaq": record} if record else {})}
    (hf / "config.json").write_text(json.dumps(config))
    (base / "latest_checkpointed_iteration.txt").write_text(str(step))


RECORD = {"scale": 1.5, "targets": ["q_proj", "k_proj", "v_proj"]}


@pytest.mark.parametrize("record, preset, extra, match", [
    (None, "int8", [], "trained without UAQ, with qurl.uaq.enable=true"),
    (RECORD, "tis_int8", [], r"trained with UAQ .* with qurl.uaq.enable=false"),
    (RECORD, "int8", ["qurl.uaq.scale=2.0"], r"but qurl.uaq.scale=2 and"),
    (RECORD, "int8", ["qurl.uaq.targets=[q_proj,k_proj,v_proj,gate_proj,up_proj]"], "set them to the checkpoint's values"),
    (RECORD, "int8", [], None),
    (None, "tis_int8", [], None),
])
def test_resumed_checkpoint_must_carry_the_configured_uaq(tmp_path, record, preset, extra, match):
    """verl reloads its own checkpoint over model.path, so the run continues with what was saved."""
    write_checkpoint(tmp_path / "ckpts", 20, record)
    overrides = [o for o in GRPO_EXAMPLE if not o.startswith("actor_rollout_ref.rollout.name=")]
    cfg = compose_ppo_config([*overrides, f"+qurl={preset}", *extra, f"trainer.default_local_dir={tmp_path}/ckpts"])
    if match is None:
        driver.check_config(cfg)
    else:
        with pytest.raises(QurlConfigError, match=match):
            driver.check_config(cfg)
    fresh = compose_ppo_config([*overrides, f"+qurl={preset}", *extra, "trainer.resume_mode=disable",
                                f"trainer.default_local_dir={tmp_path}/ckpts"])
    driver.check_config(fresh)  # not resuming: nothing to compare


def test_resume_path_mode_reads_the_named_step(tmp_path):
    write_checkpoint(tmp_path / "ckpts", 7, None)
    overrides = [o for o in GRPO_EXAMPLE if not o.startswith("actor_rollout_ref.rollout.name=")]
    cfg = compose_ppo_config([*overrides, "+qurl=int8", "trainer.resume_mode=resume_path",
                              f"trainer.resume_from_path={tmp_path}/ckpts/global_step_7"])
    with pytest.raises(QurlConfigError, match="global_step_7, which was trained without UAQ"):
        driver.check_config(cfg)


def test_a_checkpoint_already_converted_needs_no_shared_cache(tmp_path):
    """Nothing is written when model.path carries UAQ, so eight nodes can read it where it is."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "qurl_uaq": RECORD}))
    overrides = [o for o in DAPO_SCRIPT if not o.startswith("actor_rollout_ref.model.path=")]
    driver.check_config(compose_ppo_config([*overrides, "+qurl=int8", f"actor_rollout_ref.model.path={tmp_path}"]))


@pytest.mark.parametrize("ignore, refused", [
    ("[model.layers.1.self_attn.q_proj]", True),  # q without k and v: vLLM runs them as one layer
    ("[up_proj]", True),  # a suffix hits up_proj of every layer, never gate_proj
    ("['re:model\\.layers\\.1\\.self_attn\\.[qkv]_proj']", False),
    ("[down_proj,o_proj]", False),
])
def test_ignore_must_keep_fused_groups_whole(tmp_path, ignore, refused):
    """Refused in the driver, on the model's own layer names, instead of by vLLM at engine start."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2}))
    overrides = [o for o in GRPO_EXAMPLE if not o.startswith(("actor_rollout_ref.rollout.name=", "actor_rollout_ref.model.path="))]
    cfg = compose_ppo_config([*overrides, "+qurl=tis_int8", f"actor_rollout_ref.model.path={tmp_path}",
                              f"+actor_rollout_ref.rollout.custom.qurl.ignore={ignore}"])
    if refused:
        with pytest.raises(QurlConfigError, match=r"custom.qurl.ignore: .*ignore all of them or none"):
            driver.check_config(cfg)
    else:
        driver.check_config(cfg)
