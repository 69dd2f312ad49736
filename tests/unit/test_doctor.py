"""``python -m qurl_verl doctor``: each check forced to fail names its fix; the command runs in seconds without
importing verl or vLLM, and exits 1 on a failure."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qurl_verl import doctor, versions
from qurl_verl.doctor import Status
from qurl_verl.platform.host import Host

ROOT = Path(__file__).resolve().parents[2]
H100, A100, V100, B200 = (9, 0), (8, 0), (7, 0), (10, 0)


def gpu(capability, **kw) -> Host:
    return Host(cuda_available=True, cuda_capability=capability, flash_attn=True, **kw)


def test_python_below_the_minimum_fails():
    assert doctor.check_python((3, 11, 7)).status is Status.OK
    result = doctor.check_python((3, 9, 18))
    assert result.status is Status.FAIL and "3.10+" in result.detail


def test_torch_not_importable_fails_and_names_the_installs(monkeypatch):
    def no_torch():
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(doctor, "import_torch", no_torch)
    result = doctor.check_torch()
    assert result.status is Status.FAIL
    assert "qurl-verl[gpu]" in result.detail and "install_cpu_stack.sh" in result.detail
    # the checks that need torch say so instead of crashing
    skipped = doctor.run_checks()[-2:]
    assert [r.name for r in skipped] == ["flash-attn", "CUDA"] and all(r.status is Status.WARN for r in skipped)


@pytest.mark.parametrize("verdicts, package, status, fix", [
    ([versions.vllm_verdict("0.32.0", True), versions.verl_verdict(None)], "verl", Status.FAIL, "verl>=0.9.1,<0.10"),
    ([versions.vllm_verdict(None, None), versions.verl_verdict("0.9.1")], "vllm", Status.FAIL, "vllm==0.24.0"),
    ([versions.vllm_verdict("0.19.0", False), versions.verl_verdict("0.9.1")], "vllm", Status.FAIL, "vllm==0.24.0"),
    ([versions.vllm_verdict("0.27.0", True), versions.verl_verdict("0.9.1")], "vllm", Status.WARN, "qurl/sync"),
    ([versions.vllm_verdict("0.24.0", True), versions.verl_verdict("0.9.2")], "verl", Status.WARN, "0.9.1"),
    ([versions.vllm_verdict("0.24.0", True), versions.verl_verdict("0.9.1")], "verl", Status.OK, "tested"),
])
def test_verl_and_vllm_take_the_version_policy_verdict(monkeypatch, verdicts, package, status, fix):
    monkeypatch.setattr(versions, "installed_verdicts", lambda: verdicts)
    result = doctor.check_version(package)
    assert result.status is status and fix in result.detail, result


def test_a_missing_or_stale_entry_point_fails(monkeypatch):
    monkeypatch.setattr(doctor, "plugin_entry_points", lambda: [])
    result = doctor.check_entry_point()
    assert result.status is Status.FAIL and "pip install -e ." in result.detail
    from importlib.metadata import EntryPoint

    monkeypatch.setattr(doctor, "plugin_entry_points", lambda: [EntryPoint("qurl", "old_qurl.plugin", "verl.plugins")])
    result = doctor.check_entry_point()
    assert result.status is Status.FAIL and "pip uninstall qurl-verl" in result.detail


def test_the_installed_entry_point_is_found():
    assert doctor.check_entry_point().status is Status.OK


def test_search_path_plugin_missing_or_unknown_preset_fails(monkeypatch):
    assert doctor.check_search_path("int8").status is Status.OK
    result = doctor.check_search_path("int9")
    assert result.status is Status.FAIL and "int8" in result.detail and "fp8_fp8kv" in result.detail
    assert "_quantized_rollout" not in result.detail
    monkeypatch.setattr(doctor, "module_found", lambda name: name != doctor.SEARCH_PATH_PLUGIN)
    result = doctor.check_search_path("int8")
    assert result.status is Status.FAIL and "--force-reinstall" in result.detail
    monkeypatch.setattr(doctor, "module_found", lambda name: name != "hydra")
    assert "pip install hydra-core" in doctor.check_search_path("int8").detail


def test_transferqueue_missing_fails(monkeypatch):
    monkeypatch.setattr(doctor, "module_found", lambda name: name != "transfer_queue")
    result = doctor.check_transferqueue()
    assert result.status is Status.FAIL and "pip install 'transferqueue>=0.1.10'" in result.detail


def test_flash_attn_missing_on_a_gpu_warns_with_both_ways(monkeypatch):
    monkeypatch.setattr(doctor, "nvcc_path", lambda: None)
    result = doctor.check_flash_attn(Host(cuda_available=True, cuda_capability=H100, flash_attn=False))
    assert result.status is Status.WARN
    assert "pip install flash-attn==2.8.3 --no-build-isolation" in result.detail
    assert "nvcc from the CUDA toolkit (not on PATH here)" in result.detail
    assert "+actor_rollout_ref.model.override_config.attn_implementation=sdpa" in result.detail
    assert doctor.check_flash_attn(Host()).status is Status.OK  # no CUDA: the CPU stack uses sdpa


def test_flash_attn_that_does_not_import_fails(monkeypatch):
    def broken():
        raise ImportError("flash_attn_2_cuda...so: undefined symbol: _ZN3c10")

    monkeypatch.setattr(doctor, "import_flash_attn", broken)
    result = doctor.check_flash_attn(gpu(H100))
    assert result.status is Status.FAIL and "--force-reinstall" in result.detail and "sdpa" in result.detail
    monkeypatch.setattr(doctor, "import_flash_attn", lambda: "2.8.3")
    assert doctor.check_flash_attn(gpu(H100)).status is Status.OK


@pytest.mark.parametrize("preset, capability, status, words", [
    ("int8", H100, Status.OK, "runs int8"),
    ("int8", A100, Status.OK, "runs int8"),
    ("int8", V100, Status.FAIL, "compute capability >= 7.5"),
    ("fp8", A100, Status.FAIL, "quantization=int8"),
    ("fp8_fp8kv", A100, Status.FAIL, "quantization=int8"),  # the format comes through the preset's defaults
    ("int8_fp8kv", A100, Status.FAIL, "+qurl=int8 instead"),  # vLLM's Triton attention: no FP8 cache below 8.9
    ("int8_fp8kv", H100, Status.OK, "runs int8"),
    ("tis_fp8", H100, Status.OK, "runs fp8"),
    ("bf16", V100, Status.OK, "runs bf16"),
    ("int8", B200, Status.OK, "VLLM_DISABLED_KERNELS"),  # the server's Blackwell kernel choice, reported
])
def test_the_gpu_against_the_preset(preset, capability, status, words):
    result = doctor.check_cuda(preset, gpu(capability), devices=8)
    assert result.status is status and words in result.detail, result
    assert "8 GPU(s)" in result.detail


def test_the_model_runner_the_server_pins_or_the_users_mrv2(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    result = doctor.check_cuda("int8", gpu(H100), devices=1)
    assert result.status is Status.OK and "'VLLM_USE_V2_MODEL_RUNNER': '0'" in result.detail, result
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    result = doctor.check_cuda("int8", gpu(H100), devices=1)
    assert result.status is Status.WARN and "Model Runner V2" in result.detail and "unset it" in result.detail, result


def test_no_cuda_names_the_cpu_platform():
    result = doctor.check_cuda("int8", Host(), devices=0)
    assert result.status is Status.WARN and "export VERL_PLATFORM=cpu" in result.detail
    assert doctor.check_cuda("int8", Host(cpu_platform=True), devices=0).status is Status.OK
    result = doctor.check_cuda("int8", gpu(H100, cpu_platform=True), devices=1)
    assert result.status is Status.WARN and "unset it" in result.detail


def test_any_failure_exits_1(monkeypatch):
    lines = []
    assert doctor.run("int8", out=lines.append) in (0, 1)
    assert len(lines) == 10 and lines[-1].startswith("doctor (+qurl=int8)")
    monkeypatch.setattr(doctor, "module_found", lambda name: name != "transfer_queue")
    lines = []
    assert doctor.run("int8", out=lines.append) == 1
    assert any(line.startswith("FAIL  transferqueue") for line in lines)


def test_the_command_runs_in_seconds_without_importing_verl_or_vllm():
    code = ("import sys; from qurl_verl.__main__ import main; rc = main(['doctor', '--preset', 'int8']); "
            "print('heavy:', sorted(m for m in ('verl', 'vllm', 'ray', 'transformers') if m in sys.modules))")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert "heavy: []" in done.stdout, done.stdout
    assert "verl.plugins entry point" in done.stdout and "doctor (+qurl=int8)" in done.stdout
    assert took < 30, took
