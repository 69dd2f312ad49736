"""`rollout.name=qurl_vllm` resolves in verl's two registries, lazily, and the server and replica
hooks return what verl's vLLM server passes to the engine."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from qurl_verl.config import QurlConfigError


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

    import qurl_verl.rollout.registration as registration

    registration.register()
    replica_cls = RolloutReplicaRegistry.get("qurl_vllm")
    assert replica_cls is server_module.QurlvLLMReplica
    config = {"name": "qurl_vllm"}
    replica_prefix = replica_cls._get_server_name_prefix(SimpleNamespace(config=SimpleNamespace(name="qurl_vllm")))
    adapter_prefix = ServerAdapter._get_server_name_prefix(SimpleNamespace(config=config))
    assert replica_prefix == adapter_prefix == "qurl_vllm_"


def fake_server(quantization, architectures=("Qwen2ForCausalLM",)):
    return SimpleNamespace(
        config=SimpleNamespace(quantization=quantization, custom=None),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=list(architectures)), path="/models/x"),
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
