"""The version policy (``qurl_verl/versions.py``): parsing, the installed versions read without importing vLLM or
verl, the verdict a driver, a server or a ``doctor`` reads, and the driver's gate built on it."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from qurl_verl import versions
from qurl_verl.versions import TESTED_VLLM, Verdict, VersionVerdict, release, vllm_release, vllm_verdict

pytestmark = pytest.mark.both_stacks  # the installed vLLM differs between the stacks


@pytest.mark.parametrize("text, want", [
    ("0.24.0", (0, 24)), ("0.32.0+cpu", (0, 32)), ("0.24", (0, 24)), ("1", None), (None, None), ("x.y", None),
])
def test_vllm_release(text, want):
    assert vllm_release(text) == want


def test_release_takes_as_many_numbers_as_asked():
    assert release("0.9.1", 3) == (0, 9, 1) and release("0.9", 3) is None and release("0.9.1+local", 3) == (0, 9, 1)
    assert versions.is_targeted("0.32.0+cpu", ("0.32.0",)) and not versions.is_targeted("0.24.0", ("0.32.0",))


@pytest.mark.parametrize("version, has_reload, verdict", [
    ("0.24.0", True, Verdict.TESTED), ("0.32.0+cpu", True, Verdict.TESTED), ("0.32.0+cpu", None, Verdict.TESTED),
    (None, None, Verdict.ABSENT), ("0.23.0", False, Verdict.REFUSED), ("0.24.0", False, Verdict.REFUSED),
    ("0.28.1", True, Verdict.UNTESTED), ("0.40.0", True, Verdict.UNTESTED),
])
def test_the_vllm_verdict(version, has_reload, verdict):
    """A value, not an exception: the driver's gate raises or warns on it, a ``doctor`` prints it."""
    got = vllm_verdict(version, has_reload)
    assert isinstance(got, VersionVerdict) and (got.package, got.version, got.verdict) == ("vllm", version, verdict)
    assert bool(got.message) == (verdict in (Verdict.REFUSED, Verdict.UNTESTED))
    assert got.refused == (verdict is Verdict.REFUSED) and got.untested == (verdict is Verdict.UNTESTED)
    if verdict is Verdict.REFUSED:
        assert "pip install vllm==0.24.0" in got.message
    if verdict is Verdict.UNTESTED:
        assert got.message.startswith("qurl_vllm has run on vLLM 0.24, 0.32, not on ")


@pytest.mark.parametrize("version, verdict", [
    ("0.9.1", Verdict.TESTED), ("0.9.2", Verdict.UNTESTED), ("0.10.0", Verdict.UNTESTED), (None, Verdict.ABSENT),
])
def test_the_verl_verdict(version, verdict):
    got = versions.verl_verdict(version)
    assert got.verdict is verdict and bool(got.message) == (verdict is Verdict.UNTESTED)


def test_the_installed_stack_is_a_tested_one():
    """Both tested stacks: vLLM's reload package is found without importing vLLM, the release is a tested one,
    and verl is the release the plugin targets; the driver's gate passes it."""
    from qurl_verl.rollout.engine_checks import check_vllm_version

    version = versions.installed_vllm_version()
    if version is None:
        pytest.skip("needs vLLM")
    assert versions.vllm_has_reload_api() is True and vllm_release(version) in TESTED_VLLM
    assert [v.verdict for v in versions.installed_verdicts()] == [Verdict.TESTED, Verdict.TESTED]
    check_vllm_version(version)


def test_a_vllm_without_the_reload_package_is_found_out_without_importing_it(tmp_path, monkeypatch):
    import importlib.machinery
    import importlib.util

    (tmp_path / "vllm" / "model_executor" / "model_loader").mkdir(parents=True)
    spec = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "vllm")]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "vllm" else None)
    assert versions.vllm_has_reload_api() is False
    (tmp_path / "vllm" / "model_executor" / "model_loader" / "reload").mkdir()
    assert versions.vllm_has_reload_api() is True


def test_the_policy_reads_versions_without_importing_vllm_verl_or_torch():
    code = textwrap.dedent("""
        import sys
        for name in ("vllm", "verl", "torch"):
            sys.modules[name] = None
        from qurl_verl import versions
        versions.installed_verdicts()
        print("POLICY OK")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "POLICY OK" in p.stdout, p.stderr[-3000:]


@pytest.mark.parametrize("version, has_reload, verdict", [
    ("0.24.0", True, None), ("0.32.0+cpu", True, None), (None, None, None),
    ("0.23.0", False, "refuse"), ("0.28.1", True, "warn"), ("0.40.0", True, "warn"),
])
def test_the_gate_refuses_a_vllm_without_reload_and_warns_of_an_untested_one(version, has_reload, verdict, monkeypatch):
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
    from qurl_verl.rollout.console_log import engine_logger

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    engine_logger().addHandler(handler)  # its own console logger: shown in a server whose root logger is at ERROR
    try:
        engine_checks.check_vllm_version(version)
        engine_checks.check_vllm_version(version)
    finally:
        engine_logger().removeHandler(handler)
    said = [r.getMessage() for r in records if "has run on vLLM" in r.getMessage()]
    assert len(said) == (1 if verdict == "warn" else 0), said
