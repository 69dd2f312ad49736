"""verl 0.9.1's fully_async trainer drops what the checkpoint engine returns at a sync; the patch logs it, for a qurl
run only. verl's own ``FullyAsyncTrainer._fit_update_weights`` runs here, stock and wrapped, on a trainer whose
collaborators (the rollouter actor, the checkpoint manager, the logger) are in-process stand-ins: Ray handles
answer with their values, so no cluster starts. The e2e run ``fully_async_policy_int8_sync`` shows the patch
in verl's real actors."""
from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from qurl_verl.patches.always import fully_async_sync_metrics as patch
from qurl_verl.patches.contract import is_wrapped

trainer_module = pytest.importorskip("verl.experimental.fully_async_policy.fully_async_trainer")
ENGINE_REPORT = {"qurl_sync/checksum": 7.0, "qurl_sync/rollout/checksum/replica_0": 5.0}
ROLLOUTER_TIMING = {"fully_async/rollouter/active_time": 1.0}


class Remote:
    """A Ray actor method's stand-in: ``.remote()`` hands back the value (``ray.get`` of it is the value)."""

    def __init__(self, value):
        self.value = value

    def remote(self):
        return self

    def future(self):
        done = concurrent.futures.Future()
        done.set_result(self.value)
        return done


class Manager:
    """``CheckpointEngineManager.update_weights``: async, returns the engine's report."""

    def __init__(self):
        self.calls = []

    async def update_weights(self, global_steps=None):
        self.calls.append(global_steps)
        return dict(ENGINE_REPORT)


class Logger:
    def __init__(self):
        self.rows = []

    def log(self, data, step):
        self.rows.append((step, dict(data)))


def trainer(config: dict) -> SimpleNamespace:
    """What verl's ``_fit_update_weights`` reads of its trainer, after an update to parameter version 3."""
    rollouter = SimpleNamespace(get_total_produced_samples=Remote(8), get_completed_steps=Remote(2),
                                reset_staleness=Remote(dict(ROLLOUTER_TIMING)), _stop_profiling=Remote(None),
                                _start_profiling=Remote(None))
    return SimpleNamespace(
        config=OmegaConf.create({"global_profiler": {"steps": None}, **config}), local_trigger_step=1,
        current_param_version=3, rollouter=rollouter, checkpoint_manager=Manager(), logger=Logger(),
        dynamic_schedule_ctx=SimpleNamespace(step_required_samples=4), staleness_threshold=0.1,
        dynamic_schedule_enabled=False, only_hybrid=False, timing_raw={}, _step_wait_times=[],
        _step_wait_samples=[])


@pytest.fixture
def ray_get_of_values(monkeypatch):
    """``ray.get`` of the stand-ins' values, as verl's method calls it on the rollouter's refs."""
    monkeypatch.setattr(trainer_module, "ray", SimpleNamespace(get=lambda refs: [r.value for r in refs]))


def stock_method():
    method = patch.remote_class(trainer_module.FullyAsyncTrainer)._fit_update_weights
    return getattr(method, "__wrapped__", method)


QURL = {"qurl": {"preset": "int8"}}


def test_the_plugin_wrapped_the_method_verls_actor_runs():
    """``import verl`` applied the patch to the class ``@ray.remote`` made the actor from and to the subclass Ray
    ships to the actor's process (the one whose method the actor calls)."""
    shipped = trainer_module.FullyAsyncTrainer.__ray_metadata__.modified_class
    assert is_wrapped(shipped._fit_update_weights, patch._MARK)
    assert is_wrapped(patch.remote_class(trainer_module.FullyAsyncTrainer)._fit_update_weights, patch._MARK)
    assert patch.apply() == ""  # already done


def test_stock_verl_logs_the_rollouters_timing_and_drops_the_engines_report(ray_get_of_values):
    t = trainer(QURL)
    returned = asyncio.run(stock_method()(t))
    assert t.checkpoint_manager.calls == [3] and returned == ROLLOUTER_TIMING
    assert t.logger.rows == [(3, ROLLOUTER_TIMING)]  # the engine's report is nowhere


def test_a_qurl_run_logs_the_engines_report_at_the_version_it_installed(ray_get_of_values):
    t = trainer(QURL)
    returned = asyncio.run(patch.logging_sync_metrics(stock_method())(t))
    assert t.checkpoint_manager.calls == [3] and returned == ROLLOUTER_TIMING
    assert t.logger.rows == [(3, ROLLOUTER_TIMING), (3, ENGINE_REPORT)]
    assert "update_weights" not in vars(t.checkpoint_manager)  # the manager's own method again


def test_a_run_without_qurl_is_stock_verls(ray_get_of_values, monkeypatch):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)  # the CPU platform alone makes a run a qurl one
    wrapped, stock = trainer({}), trainer({})
    asyncio.run(patch.logging_sync_metrics(stock_method())(wrapped))
    asyncio.run(stock_method()(stock))
    assert wrapped.logger.rows == stock.logger.rows == [(3, ROLLOUTER_TIMING)]


def test_a_call_that_syncs_nothing_logs_nothing(ray_get_of_values):
    """Between syncs (``local_trigger_step != 1``) verl's method returns None at once, and so does the wrapper."""
    t = trainer(QURL)
    t.local_trigger_step = 2
    assert asyncio.run(patch.logging_sync_metrics(stock_method())(t)) is None
    assert t.logger.rows == [] and t.checkpoint_manager.calls == []


def test_the_method_the_actor_runs_logs_each_sync_once(ray_get_of_values):
    """Both classes are wrapped, and Ray's copy calls the original it captured: one row of the engine's report."""
    t = trainer(QURL)
    shipped = trainer_module.FullyAsyncTrainer.__ray_metadata__.modified_class
    asyncio.run(shipped._fit_update_weights(t))
    assert t.logger.rows == [(3, ROLLOUTER_TIMING), (3, ENGINE_REPORT)]
