"""`rollout.name=qurl_vllm` resolves in verl's two registries, lazily, and the server and replica
hooks return what verl's vLLM server passes to the engine."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from qurl_verl.settings import QurlConfigError

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks


def test_plugin_registers_qurl_vllm_without_importing_vllm():
    code = (
        "import sys, verl\n"
        "from verl.workers.rollout.base import _ROLLOUT_REGISTRY\n"
        "from verl.workers.rollout.replica import RolloutReplicaRegistry\n"
        "assert 'qurl_vllm' in RolloutReplicaRegistry._registry, RolloutReplicaRegistry._registry\n"
        "print(_ROLLOUT_REGISTRY[('qurl_vllm', 'async')])\n"
        "print('vllm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["qurl_verl.rollout.adapter.QurlServerAdapter", "False"], out.stderr[-2000:]


@pytest.fixture(scope="module")
def server_module():
    pytest.importorskip("vllm", reason="needs vLLM")
    from qurl_verl.rollout import server

    return server


def test_replica_actor_names_match_what_the_adapter_looks_up(server_module):
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    import qurl_verl.rollout.registration  # noqa: F401 - registers on import
    replica_cls = RolloutReplicaRegistry.get("qurl_vllm")
    assert replica_cls is server_module.QurlvLLMReplica
    config = {"name": "qurl_vllm"}
    replica_prefix = replica_cls._get_server_name_prefix(SimpleNamespace(config=SimpleNamespace(name="qurl_vllm")))
    adapter_prefix = ServerAdapter._get_server_name_prefix(SimpleNamespace(config=config))
    assert replica_prefix == adapter_prefix == "qurl_vllm_"


def fake_server(quantization, architectures=("Qwen2ForCausalLM",)):
    """What ``_apply_quantization`` reads: the rollout config, and vLLM's model config with a transformers config."""
    from transformers import PretrainedConfig

    return SimpleNamespace(
        config=SimpleNamespace(quantization=quantization, custom=None, tensor_model_parallel_size=1, enforce_eager=False,
                         dtype="bfloat16"),
        model_config=SimpleNamespace(hf_config=PretrainedConfig(architectures=list(architectures)), path="/models/x"),
    )


def test_server_builds_the_engine_quantized_and_with_our_worker(server_module):
    server_cls = server_module.QurlvLLMHttpServer
    quantization, overrides = server_cls._apply_quantization(fake_server("int8"))
    assert quantization == "compressed-tensors"
    assert overrides["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] == "int"
    assert server_cls._apply_quantization(fake_server("bf16")) == (None, {})
    module, _, cls = server_cls._get_worker_extension_cls(None).rpartition(".")
    extension = getattr(__import__(module, fromlist=[cls]), cls)
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    assert issubclass(extension, vLLMColocateWorkerExtension)
    assert "update_weights_from_ipc" in vars(extension)


def test_server_refuses_unknown_architectures(server_module):
    with pytest.raises(QurlConfigError, match="MixtralForCausalLM"):
        server_module.QurlvLLMHttpServer._apply_quantization(fake_server("int8", ["MixtralForCausalLM"]))


def test_adapter_turns_worker_stats_into_metrics():
    pytest.importorskip("vllm", reason="needs vLLM")
    from qurl_verl.rollout.adapter import QurlServerAdapter

    first = SimpleNamespace(last_sync_stats={"sync": 1, "format": "int8", "total_s": 0.5, "quantize_s": 0.1,
                                             "changed_code_frac": None, "update_to_error_ratio": None})
    assert QurlServerAdapter.sync_metrics(first) == {
        "qurl/sync/sync": 1.0, "qurl/sync/total_s": 0.5, "qurl/sync/quantize_s": 0.1,
    }
    assert QurlServerAdapter.update_metrics(first) == {}
    later = SimpleNamespace(last_sync_stats={"sync": 2, "total_s": 0.4, "changed_code_frac": 0.25,
                                             "update_to_error_ratio": 0.02})
    assert QurlServerAdapter.update_metrics(later) == {
        "qurl/update/changed_code_frac": 0.25, "qurl/update/update_to_error_ratio": 0.02,
    }
    assert "qurl/sync/changed_code_frac" not in QurlServerAdapter.sync_metrics(later)


class _Remote:
    """A Ray actor method stand-in: ``.remote(...)`` records the call and returns an awaitable."""

    def __init__(self, result=None):
        self.calls, self.result = [], result

    def remote(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.result)
        return future


async def test_adapter_sync_sends_verls_keywords_only_and_publishes_the_workers_stats(monkeypatch):
    pytest.importorskip("vllm", reason="needs vLLM")
    from verl.workers.rollout.vllm_rollout import vllm_rollout

    from qurl_verl.patches.qurl_vllm import loss_metrics_channel as step_metrics
    from qurl_verl.rollout.adapter import QurlServerAdapter

    sent = []

    class FakeSender:  # the ZMQ transport is verl's; here only what it is handed matters
        def __init__(self, **kwargs):
            pass

        async def async_send_weights(self, weights):
            sent.extend(name for name, _ in weights)

    monkeypatch.setattr(vllm_rollout, "BucketedWeightSender", FakeSender)
    worker_stats = {"sync": 2, "format": "int8", "total_s": 0.3, "quantized": 14, "changed_code_frac": 0.5,
                    "update_to_error_ratio": 0.01}
    adapter = object.__new__(QurlServerAdapter)
    adapter.config = OmegaConf.create({"quantization": "int8", "custom": {"qurl": {"code_change_row_stride": 4}},
                                       "checkpoint_engine": {"update_weights_bucket_megabytes": 1}})
    adapter._has_server, adapter.use_shm, adapter.zmq_handle = True, True, "ipc:///tmp/unused"
    adapter.replica_rank = adapter.rollout_rank = 0
    adapter.server_handle = SimpleNamespace(
        collective_rpc=_Remote([worker_stats]), clear_kv_cache=_Remote(), set_global_steps=_Remote()
    )
    step_metrics.clear()
    try:
        await adapter.update_weights(iter([("model.norm.weight", torch.ones(4))]), global_steps=7,
                                     peft_config=None, base_sync_done=True)
        (_, rpc_kwargs), = adapter.server_handle.collective_rpc.calls
        # verl's own keywords only: the settings travel once, with the engine (additional_config)
        assert rpc_kwargs["kwargs"] == {"peft_config": None, "base_sync_done": True, "use_shm": True}
        assert sent == ["model.norm.weight"]
        assert adapter.server_handle.set_global_steps.calls == [((7,), {})]
        published = step_metrics.current()
        assert published["qurl/sync/total_s"] == 0.3 and published["qurl/sync/quantized"] == 14
        assert published["qurl/update/changed_code_frac"] == 0.5
    finally:
        step_metrics.clear()
