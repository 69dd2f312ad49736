"""The driver's verdicts on verl 0.9.1's trainers: the legacy trainer refused, the UAQ cache required on shared
storage wherever a worker may run off the driver's node, the warning of a full-precision disaggregated sync.

Each config is composed as verl's entry point composes it (``main_ppo``'s ``ppo_trainer``; the one-step-off and
fully-async configs from ``verl/experimental``) and checked through the path that entry point takes in the
driver: verl's own ``validate_config`` for ``main_ppo``, then ``get_ppo_ray_runtime_env`` (what ``run_ppo``
calls before ``ray.init``), the only driver call of the experimental entry points.
"""
from __future__ import annotations

import logging
import os

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from qurl_recipes.compose import compose_ppo_config, validate_like_main_ppo
from qurl_verl.settings import QurlConfigError

RECIPE = ["+qurl_recipe=tiny_cpu", "data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet"]
INT8 = [*RECIPE, "+qurl=int8"]
# the e2e matrix's separate_async run (tests/e2e/test_main_ppo_runs.py), with verl's full-precision engine
SEPARATE_ASYNC = ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=1",
                  "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.nnodes=1",
                  "actor_rollout_ref.rollout.n_gpus_per_node=1", "ray_kwargs.ray_init.num_gpus=2",
                  "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]
INT8_SYNC = ["actor_rollout_ref.rollout.checkpoint_engine.backend=qurl_int8",
             "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=qurl_verl.checkpoint_engine.int8_engine",
             "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.qurl_int8.rest_dtype=bfloat16",
             "+actor_rollout_ref.rollout.custom.qurl.code_change_row_stride=0"]
SHARED = "qurl.uaq.cache_dir=/shared/uaq"
STOCK = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.path=/m",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]
# verl/experimental/<entry point>/config/<name>.yaml
EXPERIMENTAL = {"one_step_off_policy": "one_step_off_ppo_trainer", "fully_async_policy": "fully_async_ppo_trainer"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from qurl_recipes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture
def cpu_driver(monkeypatch, tiny_model):
    """What the tiny recipe's shell gives the driver: the CPU platform, no Ray cluster to join, UAQ checked but
    not converted (``QURL_DRY_RUN``: these tests are about the verdicts)."""
    from verl.plugin.platform import platform_manager

    from qurl_verl.platform.cpu import PlatformCPU

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.setattr(platform_manager, "_current_platform", PlatformCPU())
    monkeypatch.setenv("QURL_DRY_RUN", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return f"actor_rollout_ref.model.path={tiny_model}"


def compose_experimental(entry_point: str, overrides: list[str]):
    """The entry point's own config, with the copy its ``main`` makes before ``run_ppo`` (``rollout.nnodes`` and
    ``rollout.n_gpus_per_node`` into the rollout's config)."""
    import verl.experimental

    GlobalHydra.instance().clear()
    folder = os.path.join(os.path.dirname(verl.experimental.__file__), entry_point, "config")
    # the configs name verl's own as file://verl/trainer/config, which resolves only from verl's parent folder
    with initialize_config_dir(config_dir=folder, version_base=None):
        cfg = compose(config_name=EXPERIMENTAL[entry_point],
                      overrides=[*overrides, "hydra.searchpath=[pkg://verl.trainer.config]"])
    cfg.actor_rollout_ref.rollout.nnodes = cfg.rollout.nnodes
    cfg.actor_rollout_ref.rollout.n_gpus_per_node = cfg.rollout.n_gpus_per_node
    return cfg


def run_ppo_driver(cfg) -> None:
    """The driver's part of ``run_ppo`` before ``ray.init`` (Ray not yet initialized)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    get_ppo_ray_runtime_env(cfg)


def main_ppo_driver(cfg) -> None:
    """``main_ppo.main`` up to ``ray.init``: verl's ``validate_config``, then ``run_ppo``'s driver part."""
    validate_like_main_ppo(cfg)
    run_ppo_driver(cfg)


# ---------------------------------------------------------------------------------- the legacy trainer
@pytest.mark.parametrize("value", ["false", "null", "0"])
def test_the_legacy_trainer_is_refused_before_ray(cpu_driver, value):
    """verl's main_ppo runs main_ppo_v0 for any falsy trainer.use_v1 (``if config.trainer.use_v1``)."""
    cfg = compose_ppo_config([*INT8, cpu_driver, f"trainer.use_v1={value}"])
    with pytest.raises(QurlConfigError, match=rf"trainer.use_v1={value}: verl 0.9.1's main_ppo would run its legacy "
                                              rf"trainer \(main_ppo_v0.* Drop trainer.use_v1={value} from the command line"):
        validate_like_main_ppo(cfg)


@pytest.mark.parametrize("value", ["true", "'false'"])  # a quoted 'false' is a string, truthy: verl runs v1
def test_the_v1_trainer_passes(cpu_driver, value):
    main_ppo_driver(compose_ppo_config([*INT8, cpu_driver, f"trainer.use_v1={value}"]))


def test_a_stock_run_keeps_the_legacy_trainer(monkeypatch):
    """Without qurl, verl's own verdict: the legacy trainer is verl's to deprecate."""
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    validate_like_main_ppo(compose_ppo_config([*STOCK, "trainer.use_v1=false"]))


@pytest.mark.parametrize("entry_point", sorted(EXPERIMENTAL))
def test_entry_points_that_never_read_use_v1_are_not_refused_for_it(cpu_driver, entry_point):
    cfg = compose_experimental(entry_point, [*INT8, cpu_driver, "trainer.use_v1=false"])
    run_ppo_driver(cfg)


# ---------------------------------------------------------------------------------- the UAQ cache
def storage_refusal(reason: str) -> str:
    return rf"{reason} with UAQ: the driver writes the converted checkpoint .* set qurl.uaq.cache_dir=<shared folder>"


@pytest.mark.parametrize("overrides,reason", [
    pytest.param((*SEPARATE_ASYNC, "actor_rollout_ref.rollout.nnodes=2"),
                 r"trainer.v1.trainer_mode=separate_async with actor_rollout_ref.rollout.nnodes=2 \(the rollout's own pool\)",
                 id="separate_async_rollout_on_two_nodes"),
    pytest.param(("trainer.nnodes=2",), r"trainer.nnodes=2", id="two_trainer_nodes"),
    pytest.param(("+ray_kwargs.ray_init.address=10.0.0.1:6379",),
                 r"ray_kwargs.ray_init.address=10.0.0.1:6379 \(a Ray cluster started outside this run\)",
                 id="ray_init_address"),
    pytest.param((*SEPARATE_ASYNC, "+ray_kwargs.ray_init.address=auto"),
                 r"ray_kwargs.ray_init.address=auto \(a Ray cluster started outside this run\)", id="separate_async_in_an_outside_cluster"),
])
def test_uaq_read_off_the_drivers_node_needs_a_shared_cache(cpu_driver, overrides, reason):
    cfg = compose_ppo_config([*INT8, cpu_driver, *overrides])
    with pytest.raises(QurlConfigError, match=storage_refusal(reason)):
        validate_like_main_ppo(cfg)
    main_ppo_driver(compose_ppo_config([*INT8, cpu_driver, *overrides, SHARED]))


def test_uaq_in_a_ray_cluster_named_by_ray_address_needs_a_shared_cache(cpu_driver, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(QurlConfigError, match=storage_refusal(r"RAY_ADDRESS is set \(a Ray cluster started outside this run\)")):
        validate_like_main_ppo(compose_ppo_config([*INT8, cpu_driver]))
    main_ppo_driver(compose_ppo_config([*INT8, cpu_driver, SHARED]))


@pytest.mark.parametrize("entry_point", sorted(EXPERIMENTAL))
def test_uaq_with_an_experimental_rollout_pool_on_two_nodes_needs_a_shared_cache(cpu_driver, entry_point):
    cfg = compose_experimental(entry_point, [*INT8, cpu_driver, "rollout.nnodes=2"])
    with pytest.raises(QurlConfigError, match=storage_refusal(rf"{entry_point} with rollout.nnodes=2 \(the rollout's own pool\)")):
        run_ppo_driver(cfg)
    run_ppo_driver(compose_experimental(entry_point, [*INT8, cpu_driver, "rollout.nnodes=2", SHARED]))
    run_ppo_driver(compose_experimental(entry_point, [*INT8, cpu_driver, "rollout.nnodes=1"]))


@pytest.mark.parametrize("overrides", [
    pytest.param((*SEPARATE_ASYNC, *INT8_SYNC), id="the_e2e_separate_async_run"),
    pytest.param((*SEPARATE_ASYNC, *INT8_SYNC, SHARED), id="with_its_own_cache"),
    pytest.param(("actor_rollout_ref.rollout.nnodes=2",), id="colocated_sync_ignores_the_rollout_pool_size"),
    pytest.param(("+ray_kwargs.ray_init.address=local",), id="ray_init_address_local_starts_a_new_cluster"),
])
def test_everything_on_the_drivers_node_reads_the_default_cache(cpu_driver, overrides):
    main_ppo_driver(compose_ppo_config([*INT8, cpu_driver, *overrides]))


def test_a_converted_checkpoint_needs_no_cache_anywhere(cpu_driver, monkeypatch, tmp_path):
    from qurl_verl.uaq_checkpoint import ensure_uaq_checkpoint

    converted = ensure_uaq_checkpoint(cpu_driver.split("=", 1)[1], cache_dir=tmp_path, log=lambda *_: None)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    main_ppo_driver(compose_ppo_config([*INT8, f"actor_rollout_ref.model.path={converted}", *SEPARATE_ASYNC,
                                        "actor_rollout_ref.rollout.nnodes=2"]))


# ---------------------------------------------------------------------------------- the sync metrics warning
def sync_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "qurl_verl" and r.levelno == logging.WARNING and "stay on the rollout side" in r.getMessage()]


def test_a_full_precision_disaggregated_sync_is_said_once(cpu_driver, caplog):
    caplog.set_level(logging.WARNING, logger="qurl_verl")
    main_ppo_driver(compose_ppo_config([*INT8, cpu_driver, *SEPARATE_ASYNC]))
    said = sync_warnings(caplog)
    assert len(said) == 1, said
    assert ("trainer.v1.trainer_mode=separate_async syncs its own rollout pool through "
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl") in said[0]
    assert "actor_rollout_ref.rollout.checkpoint_engine.backend=qurl_int8 carries them" in said[0]


@pytest.mark.parametrize("entry_point", sorted(EXPERIMENTAL))
def test_the_experimental_entry_points_say_it_once(cpu_driver, caplog, entry_point):
    """Their configs default to verl's nccl engine."""
    caplog.set_level(logging.WARNING, logger="qurl_verl")
    cfg = compose_experimental(entry_point, [*INT8, cpu_driver, "rollout.n_gpus_per_node=1"])
    run_ppo_driver(cfg)
    run_ppo_driver(cfg)  # once prepared, the driver does nothing more
    said = sync_warnings(caplog)
    assert len(said) == 1 and said[0].startswith(f"[qurl] {entry_point} syncs its own rollout pool"), said
    # in fully_async too: patches/always/fully_async_sync_metrics logs what the sender returns for qurl runs
    assert "actor_rollout_ref.rollout.checkpoint_engine.backend=qurl_int8 carries them to the trainer's logger" in said[0], said


@pytest.mark.parametrize("overrides", [
    pytest.param((), id="sync"),
    pytest.param(("trainer.v1.trainer_mode=colocate_async",), id="colocate_async"),
    pytest.param((*SEPARATE_ASYNC, *INT8_SYNC), id="separate_async_with_the_8bit_sync"),
    pytest.param((*SEPARATE_ASYNC, "preset=bf16"), id="separate_async_with_a_bf16_rollout"),
])
def test_no_warning_where_the_metrics_reach_the_trainer(cpu_driver, caplog, overrides):
    caplog.set_level(logging.WARNING, logger="qurl_verl")
    preset = [f"+qurl={o.split('=')[1]}" for o in overrides if o.startswith("preset=")] or ["+qurl=int8"]
    main_ppo_driver(compose_ppo_config([*RECIPE, *preset, cpu_driver, *(o for o in overrides if not o.startswith("preset="))]))
    assert sync_warnings(caplog) == []


# ---------------------------------------------------------------------------------- inside a TaskRunner
class TaskRunnerStandIn:
    """One-step-off's TaskRunner as far as the qurl hook reaches: verl's ``validate_config`` on the config it got,
    inside a Ray actor (``verl/experimental/one_step_off_policy/main_ppo.py``, ``OneStepTaskRunner.run``)."""

    def run(self, overrides: list[str]) -> dict:
        import logging

        said = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())
        logging.getLogger("qurl_verl").addHandler(handler)
        try:
            validate_like_main_ppo(compose_experimental("one_step_off_policy", overrides))
            verdict = "ok"
        except Exception as e:  # noqa: BLE001 - the verdict is the result
            verdict = f"{type(e).__name__}: {e}"
        return {"verdict": verdict, "warnings": [s for s in said if "stay on the rollout side" in s]}


def test_a_taskrunner_actor_leaves_the_trainer_and_the_warning_to_the_driver(cpu_driver):
    """Inside an actor, verl's ``validate_config`` is not ``main_ppo``'s: one-step-off's TaskRunner never runs the
    legacy trainer, whatever ``trainer.use_v1`` says, and the driver has already said what the sync leaves out."""
    import sys

    import ray

    overrides = [*INT8, cpu_driver, "trainer.use_v1=false", "rollout.n_gpus_per_node=1"]
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": ":".join(p for p in sys.path if p), "VERL_PLATFORM": "cpu", "QURL_DRY_RUN": "1"}})
    try:
        result = ray.get(ray.remote(num_cpus=1)(TaskRunnerStandIn).remote().run.remote(overrides), timeout=300)
    finally:
        ray.shutdown()
    assert result["verdict"] == "ok" and result["warnings"] == [], result
    with pytest.raises(QurlConfigError, match=r"trainer.use_v1=false: verl 0.9.1's main_ppo would run"):
        validate_like_main_ppo(compose_experimental("one_step_off_policy", overrides))  # the same call in the driver
