"""verl's own ``python -m verl.trainer.main_ppo`` (and its ``one_step_off_policy`` and ``fully_async_policy``
entry points) on CPU, through the tiny CPU recipe: every end-to-end run of the suite, written down as one matrix.

A run costs about 60 s of start-up (Ray, vLLM, FSDP) before its first step and a few seconds a step after the
first (measured on a 2-core AMX machine: 87 s for the 3 steps of the two-rank run), so a run carries every check whose settings
combine without hiding each other; ``make demo``'s own settings (``+qurl=int8``, nothing else) are in every
8-bit run, whose checks include the demo's; and a new feature adds its overrides and its
checks to a run here before it adds a run (``tests/README.md``). Each run names the stacks it runs on; the
0.24 stack (GPU users' vLLM) selects its runs with the ``both_stacks`` marker.

| run | overrides | stacks | what it shows |
|---|---|---|---|
| ``stock_vllm`` | verl's own ``rollout.name=vllm``, no preset | 0.32 | the plugin leaves a stock CPU run working: it trains and the engine serves the trainer's weights |
| ``colocate_async_two_fsdp_ranks_tp2_critic_padded_vocab_merged_lora`` | ``trainer.v1.trainer_mode=colocate_async``; 2 FSDP ranks, rollout TP 2, FP8 KV cache; GAE critic; a 520-token vocabulary (vLLM pads it to 576); merged rank-8 LoRA | 0.32 | the demo's checks, 2 steps, under verl's asynchronous colocated trainer with full re-quantization: the engine paused and synced every step, the mismatch beside verl's staleness (0, then 1); both TP ranks load the same bits and KV scales (the FSDP ranks' ranges all-reduced), the whole checkpoint's at step 1; the critic trains beside the INT8 rollout and ACR; the padded embedding syncs every step, with no loader noise in the log; W + BA re-quantized every step, its codes move |
| ``moe_fp8_kv`` | the tiny Qwen3-MoE + FP8 KV cache | 0.24 | the MoE checks (the KL bound of an 8-bit run: the FP8 cache adds its own mismatch); the demo's checks (``int8_acr_uaq_run``: UAQ applied; every step re-quantizes, logs the mismatch, KL and ``w_max``, and the code-change rate, which is > 0); the KV scales: bounded from the streamed weights at step 1, the trainer's (both layers, below 1) after |
| ``colocate_async_lora_adapters`` | ``trainer.v1.trainer_mode=colocate_async``, rank-8 adapters (``lora.merge=false``) | 0.32 | verl's asynchronous colocated trainer: the engine paused and synced every step, the mismatch logged beside verl's staleness (0, then 1), ACR's weight truncated; adapters: UAQ skipped with the reason, the base synced once (quantized), then adapters only, the mismatch small. (UAQ and the code-change rate of the demo: the sync runs) |
| ``separate_async_int8_sync`` | ``trainer.v1.trainer_mode=separate_async``: the actor and a standalone rollout replica on their own logical GPUs, synced through ``checkpoint_engine.backend=qurl_int8`` | 0.32 | verl's disaggregated trainer with the 8-bit sync: the trainer quantizes and sends codes + scales; the rollout loads them as they come (quantizes nothing) and its report (``qurl_sync/rollout/*``) reaches the logger with the next sync; at every sync the replica holds the sender's codes bit for bit (checksums), at the first the checkpoint's direct quantization, new codes after each update; the mismatch beside verl's staleness (0, then 1) |
| ``one_step_off_policy_int8_sync`` | ``python -m verl.experimental.one_step_off_policy.main_ppo``, its ``rollout.*`` pool of one logical GPU, ``qurl_int8`` over gloo; ``hydra.searchpath`` names verl's installed config | 0.32 | verl's one-step-off trainer: UAQ prepared before Ray by the runtime-env wrapper (the entry point skips ``validate_config`` in the driver); the same sync checks, step 1 re-sending the starting weights (the same codes); the first batch's mismatch at 8-bit scale |
| ``fully_async_policy_int8_sync`` | ``python -m verl.experimental.fully_async_policy.fully_async_main``, ``data.train_batch_size=0``, a sync after each step, ``qurl_int8`` over gloo | 0.32 | verl's fully asynchronous trainer: UAQ prepared by the wrapper; each sync's report logged by ``patches/always/fully_async_sync_metrics`` (verl drops it), the init sync's the checkpoint's direct quantization, every later one the codes sent before; verl logs step 1's training metrics with the next sync and never the last step's; the sync in its delta mode (``engine_kwargs.qurl_int8.delta=true``, actor lr 1e-5): the init sync full, each later one the changed elements only, fewer bytes, and still every replica bit for bit |
| ``two_ray_nodes_moe`` | ``trainer.nnodes=2`` on a two-node Ray cluster, the tiny Qwen3-MoE | 0.32 | the CPU platform and metrics reach both nodes; both replicas hold the same codes, new at each sync, the whole masters' at step 1; INT8 attention, full-precision experts re-built every step, verl's own probability diff and the KL at INT8 scale |

The FP8 KV cache runs only where vLLM-CPU has one (AVX-512 or AMX); elsewhere those runs go on without it
and the driver's refusal of it is checked in-process (``tests/unit/test_config_checks.py``). Refusals stop in
the driver hook, before Ray: ``test_driver_refusals_of_recipe_command_lines`` checks them in this process
through verl's own ``validate_config``, and one launch (``test_a_refused_run_stops_before_ray``) shows that
``main_ppo`` itself stops there.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from main_ppo_checks import (
    FP8_KV,
    LORA,
    RunResult,
    acr_truncates,
    async_mismatch_beside_staleness,
    critic_trained,
    delta_int8_sync,
    disaggregated_int8_sync,
    fp8_kv_cache_on_this_cpu,
    fully_async_int8_sync,
    int8_acr_uaq_run,
    kv_scales_streamed,
    lora_adapter_syncs,
    merged_lora_requantized,
    moe_rollout,
    one_step_off_int8_sync,
    padded_vocab_synced_quietly,
    replicas_agree_across_nodes,
    standalone_rollout_trained,
    stock_run_trained,
    tp2_ranks_agree,
    uaq_prepared_by_the_runtime_env,
)

from qurl_testkit.main_ppo_runs import (
    FULLY_ASYNC_POLICY,
    MAIN_PPO,
    ONE_STEP_OFF_POLICY,
    RecipeInputs,
    run_recipe,
)
from qurl_verl.versions import installed_vllm_version, vllm_release

STACK = "{}.{}".format(*(vllm_release(installed_vllm_version()) or (0, 0)))
VOCAB_PADDED = 520  # not a multiple of vLLM's padding of 64
TWO_RANKS = ("trainer.n_gpus_per_node=2", "ray_kwargs.ray_init.num_gpus=2")
INT8_SYNC = "actor_rollout_ref.rollout.checkpoint_engine"
# verl's disaggregated trainer: one logical GPU for the actor, one for a standalone rollout replica, synced through
# the 8-bit checkpoint engine (the tracker off: codes arrive quantized; the driver fills the rest's dtype, the
# rollout's bf16, and the model's tied embedding into engine_kwargs)
QURL_INT8_ENGINE = (
    f"{INT8_SYNC}.backend=qurl_int8", f"{INT8_SYNC}.custom_backend_module=qurl_verl.checkpoint_engine.int8_engine",
    "+actor_rollout_ref.rollout.custom.qurl.code_change_row_stride=0")
SEPARATE_ASYNC_INT8_SYNC = (
    "trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=1",
    "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1", "ray_kwargs.ray_init.num_gpus=2", *QURL_INT8_ENGINE)
# verl's experimental entry points: the actor on one logical GPU, a standalone rollout replica on another (their
# own top-level ``rollout.*`` pool), synced through the 8-bit engine over gloo (their default, nccl, needs GPUs);
# their task runner and trainer actors ask Ray for 10 CPUs each
STANDALONE_ROLLOUT_POOL = (
    "rollout.nnodes=1", "rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
    "ray_kwargs.ray_init.num_gpus=2", "ray_kwargs.ray_init.num_cpus=32", *QURL_INT8_ENGINE)
# one_step_off's config names verl's base config as ``file://verl/trainer/config``, a folder relative to the
# working directory (verl's source checkout); an installed verl is found through its package instead
ONE_STEP_OFF_INT8_SYNC = ("hydra.searchpath=[pkg://verl.trainer.config]", *STANDALONE_ROLLOUT_POOL)
# fully_async counts prompts (one per generation batch): 2 steps of 4 prompts, a sync after each; the 8-bit sync in
# its delta mode, at an RL learning rate (the recipe's 1e-3 changes most codes at every step: a delta of nearly
# everything, sent in full)
FULLY_ASYNC_INT8_SYNC = ("data.train_batch_size=0", "rollout.total_rollout_steps=8",
                         "async_training.trigger_parameter_sync_step=1", *STANDALONE_ROLLOUT_POOL,
                         f"+{INT8_SYNC}.engine_kwargs.qurl_int8.delta=true", "actor_rollout_ref.actor.optim.lr=1e-5")
# verl 0.9.1's separate_async with hybrid_engine=false logs at INFO with print's ``flush=True``
# (trainer_separate_async.py:181), a TypeError in ``logging``; above INFO the call returns before it
VERL_HYBRID_ENGINE_OFF_WORKAROUND = ("VERL_LOGGING_LEVEL", "WARNING")
# the run's own variables, which the test process must not hand the Ray nodes it starts
RUN_VARIABLES = ("VERL_PLATFORM", "VERL_ENGINE_DEVICE", "VERL_FILE_LOGGER_PATH", "VLLM_CPU_OMP_THREADS_BIND")


def critic_overrides(model: str) -> tuple[str, ...]:
    """verl's critic (GAE) on the run's model, with what tiny_cpu.yaml sets for the actor on CPU."""
    return ("algorithm.adv_estimator=gae", f"critic.model.path={model}", "critic.strategy=fsdp2",
            "critic.model.use_remove_padding=false",  # padding removal needs flash-attn
            "+critic.model.override_config.attn_implementation=sdpa", "critic.ppo_micro_batch_size_per_gpu=8",
            "critic.optim.lr=1.0e-3")


def padded_vocab_model(folder: Path) -> Path:
    """The tiny model with a 520-token tokenizer and ``vocab_size=520`` (a checkpoint resized to
    ``len(tokenizer)``): vLLM pads the embedding to 576 rows, which every sync must accept."""
    import json

    from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

    model = build_tiny_model(folder, TinyModelSpec(vocab_size=VOCAB_PADDED))
    assert json.loads((model / "config.json").read_text())["vocab_size"] == VOCAB_PADDED
    return model


def moe_model(folder: Path) -> Path:
    from qurl_recipes.tiny_model import build_tiny_moe_model

    return build_tiny_moe_model(folder)


@dataclass(frozen=True)
class Run:
    name: str
    checks: tuple  # each ``check(result)`` asserts one part of what the run shows
    overrides: tuple[str, ...] = ()
    steps: int = 2
    preset: str = "int8"
    stacks: tuple[str, ...] = ("0.32",)
    model: object = None  # ``model(folder) -> path``: the run's own checkpoint instead of the shared one
    critic: bool = False  # verl's critic on the run's model
    fp8_kv: bool = False  # the FP8 KV cache where vLLM-CPU has one (the KV checks then apply)
    own_uaq_cache: bool = False  # a UAQ cache of its own: its checks read the one checkpoint in it
    ray_nodes: int = 1
    env: tuple[tuple[str, str], ...] = ()  # variables of the run's shell
    main_module: str = MAIN_PPO  # verl's entry point
    trained_rows: int | None = None  # rows of training metrics the trainer logs for ``steps``; None: one a step

    def param(self):
        marks = [pytest.mark.e2e] + ([pytest.mark.both_stacks] if "0.24" in self.stacks else [])
        return pytest.param(self, id=self.name, marks=marks)


RUNS = (
    Run("stock_vllm", preset="none", checks=(stock_run_trained,)),
    Run("colocate_async_two_fsdp_ranks_tp2_critic_padded_vocab_merged_lora", model=padded_vocab_model, critic=True,
        fp8_kv=True, own_uaq_cache=True,
        overrides=(*TWO_RANKS, "actor_rollout_ref.rollout.tensor_model_parallel_size=2", *LORA,
                   "actor_rollout_ref.model.lora.merge=true", "trainer.v1.trainer_mode=colocate_async"),
        checks=(int8_acr_uaq_run, tp2_ranks_agree, kv_scales_streamed, critic_trained, padded_vocab_synced_quietly,
                merged_lora_requantized, async_mismatch_beside_staleness)),
    Run("moe_fp8_kv", model=moe_model, fp8_kv=True, stacks=("0.24",), checks=(moe_rollout, int8_acr_uaq_run, kv_scales_streamed)),
    Run("colocate_async_lora_adapters", overrides=(*LORA, "trainer.v1.trainer_mode=colocate_async"),
        checks=(lora_adapter_syncs, acr_truncates, async_mismatch_beside_staleness)),
    Run("separate_async_int8_sync", own_uaq_cache=True, overrides=SEPARATE_ASYNC_INT8_SYNC,
        env=(VERL_HYBRID_ENGINE_OFF_WORKAROUND,), checks=(async_mismatch_beside_staleness, disaggregated_int8_sync)),
    Run("one_step_off_policy_int8_sync", main_module=ONE_STEP_OFF_POLICY, own_uaq_cache=True,
        overrides=ONE_STEP_OFF_INT8_SYNC,
        checks=(uaq_prepared_by_the_runtime_env, standalone_rollout_trained, one_step_off_int8_sync)),
    # verl logs a step's training metrics with the next sync: the last step's never reach the logger
    Run("fully_async_policy_int8_sync", main_module=FULLY_ASYNC_POLICY, own_uaq_cache=True, trained_rows=1,
        overrides=FULLY_ASYNC_INT8_SYNC,
        checks=(uaq_prepared_by_the_runtime_env, standalone_rollout_trained, fully_async_int8_sync, delta_int8_sync)),
    Run("two_ray_nodes_moe", model=moe_model, ray_nodes=2, own_uaq_cache=True,
        overrides=("trainer.nnodes=2", "trainer.n_gpus_per_node=1", "ray_kwargs.ray_init.num_cpus=null",
                   "ray_kwargs.ray_init.num_gpus=null"),
        checks=(replicas_agree_across_nodes, moe_rollout)),
)


@pytest.fixture(scope="session")
def recipe_inputs(tmp_path_factory) -> RecipeInputs:
    """The tiny model, the data and a UAQ cache, built once for every run of this session."""
    return RecipeInputs(tmp_path_factory.mktemp("recipe_inputs")).build()


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key in RUN_VARIABLES or key.startswith("QURL_") or key in ("MODEL_DIR", "DATA_DIR"):
            monkeypatch.delenv(key)


@pytest.mark.parametrize("run", [r.param() for r in RUNS if STACK in r.stacks])
def test_main_ppo_run(run: Run, recipe_inputs, tmp_path, clean_env, monkeypatch):
    overrides = list(run.overrides)
    model = run.model(tmp_path / "model") if run.model else recipe_inputs.model_dir
    monkeypatch.setenv("MODEL_DIR", str(model))
    for key, value in run.env:
        monkeypatch.setenv(key, value)
    if run.critic:
        overrides += critic_overrides(str(model))
    fp8_kv = run.fp8_kv and fp8_kv_cache_on_this_cpu()
    if fp8_kv:
        overrides.append(FP8_KV)
    uaq_dir = recipe_inputs.root / "cache" / "uaq"
    if run.own_uaq_cache:
        uaq_dir = tmp_path / "uaq"
        overrides.append(f"qurl.uaq.cache_dir={uaq_dir}")
    if run.ray_nodes > 1:
        proc, rows = run_on_a_ray_cluster(run, tmp_path, overrides, recipe_inputs, monkeypatch)
    else:
        proc, rows = run_recipe(tmp_path, run.steps, *overrides, preset=run.preset, timeout=1200, inputs=recipe_inputs,
                                main_module=run.main_module)
    result = RunResult(proc=proc, rows=rows, steps=run.steps, uaq_dir=uaq_dir, fp8_kv=fp8_kv,
                       trained_rows=run.trained_rows)
    result.assert_completed()
    for check in run.checks:
        check(result)


def run_on_a_ray_cluster(run: Run, tmp_path, overrides, recipe_inputs, monkeypatch):
    """``ray.cluster_utils.Cluster`` with one logical GPU a node, started without any of the run's variables;
    stopped, and no process of it left, whatever the run did."""
    import psutil
    from ray.cluster_utils import Cluster

    from qurl_testkit.main_ppo_runs import end_processes

    def children() -> list:
        try:
            return [p for p in psutil.Process().children(recursive=True) if p.is_running()]
        except psutil.Error:
            return []

    before = {p.pid for p in children()}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 8, "num_gpus": 1, "include_dashboard": False})
    try:
        for _ in range(run.ray_nodes - 1):
            cluster.add_node(num_cpus=8, num_gpus=1)
        cluster.wait_for_nodes(timeout=120)
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        return run_recipe(tmp_path, run.steps, *overrides, preset=run.preset, timeout=1200, inputs=recipe_inputs,
                                main_module=run.main_module)
    finally:
        cluster.shutdown()
        end_processes([p for p in children() if p.pid not in before], grace_s=15)
        assert not [p for p in children() if p.pid not in before], "the Ray cluster left processes behind"


@pytest.mark.e2e
def test_a_refused_run_stops_before_ray(tmp_path, recipe_inputs):
    """The one launch of a refused run: ``main_ppo`` stops in the driver with one message, before Ray."""
    proc, rows = run_recipe(tmp_path, 1, f"actor_rollout_ref.model.path={tmp_path}/missing", timeout=300,
                            inputs=recipe_inputs)
    assert proc.returncode != 0 and rows == []
    err = proc.stdout + proc.stderr
    assert f"actor_rollout_ref.model.path={tmp_path}/missing does not exist" in err
    assert "ray init kwargs" not in err  # failed before Ray started


@pytest.mark.parametrize("overrides,message", [
    pytest.param((*LORA, FP8_KV), r"kv_cache=fp8 with LoRA adapters .* Set actor_rollout_ref.model.lora.merge=true",
                 id="fp8_kv_cache_with_lora_adapters"),
    pytest.param(("actor_rollout_ref.rollout.name=vllm",), r"`\+qurl=int8` selects .*rollout.name=qurl_vllm.* sets .*rollout.name=vllm after it: remove that override",
                 id="stock_rollout_name_after_a_preset"),
])
def test_driver_refusals_of_recipe_command_lines(overrides, message, recipe_inputs, monkeypatch):
    """The tiny recipe's command line (``+qurl_recipe=tiny_cpu +qurl=int8``) with a setting the driver refuses,
    composed as verl's CLI composes it and validated by verl's own ``validate_config`` (which runs the qurl
    hook), in this process: the error ``main_ppo`` would stop with, naming the fix."""
    from verl.plugin.platform import platform_manager

    from qurl_recipes.compose import compose_ppo_config, validate_like_main_ppo
    from qurl_verl.platform.cpu import PlatformCPU
    from qurl_verl.settings import QurlConfigError

    # what the recipe's VERL_PLATFORM=cpu gives main_ppo, whatever platform this process resolved before
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.setattr(platform_manager, "_current_platform", PlatformCPU())
    monkeypatch.setenv("QURL_CACHE_DIR", str(recipe_inputs.root / "cache"))
    data = recipe_inputs.data_dir
    cfg = compose_ppo_config(["+qurl_recipe=tiny_cpu", "+qurl=int8", f"actor_rollout_ref.model.path={recipe_inputs.model_dir}",
                              f"data.train_files={data}/train.parquet", f"data.val_files={data}/val.parquet",
                              *overrides])
    with pytest.raises(QurlConfigError, match=message):
        validate_like_main_ppo(cfg)


STUBBORN_DRIVER = """
import os, signal, sys, time
os.setpgrp()  # what Ray's driver does: out of the recipe's process group, still in its session
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("driver", os.getpid(), flush=True)
time.sleep(600)
"""


def test_a_run_past_its_deadline_fails_and_leaves_nothing_behind(tmp_path):
    """The no-hang guarantee every run above relies on (seconds): a driver that left the group and ignores
    SIGTERM is ended at the deadline, and the test fails naming it."""
    import sys

    import psutil

    from qurl_testkit.main_ppo_runs import run_in_own_session

    (tmp_path / "driver.py").write_text(STUBBORN_DRIVER)
    script = f"{sys.executable} {tmp_path / 'driver.py'} & sleep 600; wait"
    with pytest.raises(pytest.fail.Exception, match="deadline") as failure:
        run_in_own_session(["bash", "-c", script], dict(os.environ), tmp_path, timeout=3, grace_s=1)
    driver_pid = int((tmp_path / "stdout.log").read_text().split()[1])
    assert "driver" in str(failure.value)
    assert not psutil.pid_exists(driver_pid) or psutil.Process(driver_pid).status() == psutil.STATUS_ZOMBIE
