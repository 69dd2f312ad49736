"""One home for what an engine gets before it starts (``rollout.engine_policy``): the rollout server and the GPU
check (``tests/gpu/check_qurl_vllm_cuda.py``) both run it, so the check proves on a GPU what the server runs there.

The GPU's answers are forced (``Host.probe``, ``torch.cuda.get_device_capability``, ``torch.version.hip``); the
policy's own cases are in ``test_gpu_stack_checks.py``, through the server."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qurl_verl.platform.host import Host
from qurl_verl.rollout.cuda_kernel_env import CUTLASS_INT8_KERNEL, DISABLED_KERNELS_ENV, USE_DEEP_GEMM_ENV
from qurl_verl.rollout.engine_policy import ENGINE_ENV_VARS
from qurl_verl.rollout.fp8_kernel_report import fp8_kernels
from qurl_verl.rollout.model_runner import USE_V2_MODEL_RUNNER_ENV, runner_report
from qurl_verl.settings import QurlConfigError, RolloutSettings

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code (its platform, its runner classes)

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "check_qurl_vllm_cuda.py"


@pytest.fixture(scope="module")
def check():
    pytest.importorskip("vllm", reason="needs vLLM")
    spec = importlib.util.spec_from_file_location("check_qurl_vllm_cuda", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from qurl_recipes.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=256, num_heads=2, num_kv_heads=2, intermediate_size=512)  # whole 128-blocks
    return build_tiny_model(tmp_path_factory.mktemp("policy_model"), spec)


@pytest.fixture
def gpu(monkeypatch):
    """Make this process look like one on an NVIDIA GPU of a given capability (the server reads ``Host.probe``,
    the check ``torch.cuda.get_device_capability``); the policy's variables are restored after the test."""
    for name in ENGINE_ENV_VARS:  # set, then removed: monkeypatch then restores an unset variable to unset too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.version, "hip", None)

    def force(capability):
        forced = dataclasses.replace(Host.probe(), cuda_capability=capability, avx512=True)
        monkeypatch.setattr(Host, "probe", classmethod(lambda cls: forced))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return force


def server_config(fmt: str, model_dir: Path, custom=None) -> SimpleNamespace:
    from transformers import AutoConfig

    return SimpleNamespace(
        config=SimpleNamespace(quantization=fmt, custom=custom, tensor_model_parallel_size=1, enforce_eager=False,
                               dtype="bfloat16"),
        model_config=SimpleNamespace(hf_config=AutoConfig.from_pretrained(model_dir), path=str(model_dir)),
    )


@pytest.mark.parametrize("fmt, capability", [("int8", (10, 0)), ("int8", (9, 0)), ("fp8_block", (9, 0)), ("fp8", (8, 9))])
def test_the_check_gives_its_engine_the_servers_environment(check, model_dir, gpu, monkeypatch, fmt, capability):
    """The check's ``prepare_engine`` returns what the server's ``_apply_quantization`` returns and leaves the same
    engine environment (the V1 runner pinned, Cutlass INT8 disabled on Blackwell, DeepGEMM off for fp8_block)."""
    from qurl_verl.rollout import server

    gpu(capability)
    settings = RolloutSettings(format=fmt)
    got = check.prepare_engine(settings, model_dir, SimpleNamespace(dry_run=False, tp=1))
    checked_env = {name: os.environ.get(name) for name in ENGINE_ENV_VARS}
    for name in ENGINE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert server.QurlvLLMHttpServer._apply_quantization(server_config(fmt, model_dir)) == got
    assert {name: os.environ.get(name) for name in ENGINE_ENV_VARS} == checked_env
    assert checked_env[USE_V2_MODEL_RUNNER_ENV] == "0"
    assert (checked_env[DISABLED_KERNELS_ENV] == CUTLASS_INT8_KERNEL) == (fmt == "int8" and capability >= (10, 0))
    assert (checked_env[USE_DEEP_GEMM_ENV] == "0") == (fmt == "fp8_block")


def test_the_check_refuses_what_the_server_refuses(check, model_dir, gpu):
    gpu((8, 0))  # A100: FP8 would run weight-only
    with pytest.raises(QurlConfigError, match="FP8 tensor cores"):
        check.prepare_engine(RolloutSettings(format="fp8"), model_dir, SimpleNamespace(dry_run=False, tp=1))


def test_the_checks_engine_gets_the_fp8_cache_attention_the_server_gives(check, model_dir, gpu, monkeypatch):
    """Off Hopper an FP8 KV cache needs an attention backend that reads the streamed scales on the device
    (``fp8_kv_attention_backend``); the check's engine arguments get it, and everything else the server adds,
    from the server's own ``_preprocess_engine_kwargs`` code."""
    from qurl_verl.rollout import server

    gpu((8, 9))
    settings = RolloutSettings(format="int8", kv_cache="fp8")
    quantization = settings.engine_quantization()
    args = check.engine_args(model_dir, settings, check.EXTENSION, dry_run=False, tp=1, sleep=False,
                             quantization=quantization)
    assert args["attention_backend"] == "TRITON_ATTN" and args["kv_cache_dtype"] == "fp8_e4m3"
    assert (args["quantization"], args["hf_overrides"]) == quantization
    monkeypatch.setattr(server.vLLMHttpServer, "_preprocess_engine_kwargs", lambda self, kwargs: None)
    fake = server_config("int8", model_dir, custom={"qurl": {"kv_cache": "fp8"}})
    served = server.QurlvLLMHttpServer.__new__(server.QurlvLLMHttpServer)  # no actor, no engine
    served.config, served.model_config = fake.config, fake.model_config
    kwargs = {}
    served._preprocess_engine_kwargs(kwargs)
    assert kwargs and {name: args[name] for name in kwargs} == kwargs


def test_the_check_fails_an_engine_the_policy_rules_out(check):
    """What the engine reports back is held against the policy, so a GPU run that got other kernels or another
    runner than the server's fails rather than passing on a path production does not take."""
    def report(runner="v1", int8=None, fp8=None):
        return {"model_runner": {"runner": runner, "class": "x"}, "int8_kernels": int8 or {}, "fp8_kernels": fp8 or {}}

    assert check.engine_problems(report(int8={"CutlassInt8ScaledMMLinearKernel": 8}), "int8", (9, 0), "v1") == []
    assert check.engine_problems(report(int8={"TritonInt8ScaledMMLinearKernel": 8}), "int8", (10, 0), "v1") == []
    [blackwell] = check.engine_problems(report(int8={CUTLASS_INT8_KERNEL: 8}), "int8", (10, 0), "v1")
    assert CUTLASS_INT8_KERNEL in blackwell
    [deep_gemm] = check.engine_problems(report(fp8={"DeepGemmFp8BlockScaledMMKernel": 8}), "fp8_block", (9, 0), "v1")
    assert "DeepGEMM" in deep_gemm
    [runner] = check.engine_problems(report(runner="v2", int8={"CutlassInt8ScaledMMLinearKernel": 8}), "int8", (9, 0), "v1")
    assert "v1 was asked for" in runner
    [none] = check.engine_problems(report(int8={"CutlassInt8ScaledMMLinearKernel": 8}), "fp8", (9, 0), "v1")
    assert "no fp8 kernel" in none


def test_each_run_starts_from_the_environment_before_it(check, monkeypatch):
    monkeypatch.setenv(DISABLED_KERNELS_ENV, "")
    monkeypatch.delenv(DISABLED_KERNELS_ENV)
    with check.engine_environment():
        os.environ[DISABLED_KERNELS_ENV] = CUTLASS_INT8_KERNEL  # an int8 run on Blackwell
    assert DISABLED_KERNELS_ENV not in os.environ


@pytest.mark.parametrize("flags", [["--quick", "--kv-cache", "fp8"], ["--quick", "--lora"]])
def test_quick_mode_refuses_what_its_gpu_references_do_not_run(check, flags, capsys):
    """Before any model or engine: the FP8-cache and LoRA references run on the CPU only."""
    with pytest.raises(SystemExit) as stop:
        check.main(flags)
    assert stop.value.code == 2 and "runs the INT8 reload alone" in capsys.readouterr().err


@pytest.mark.parametrize("module, name, runner", [
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "v1"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "v1"),
    ("vllm.v1.worker.cpu.model_runner", "CPUModelRunner", "v2"),  # vLLM-CPU's MRv2 subclasses the GPU one
])
def test_the_runner_report_tells_v1_from_mrv2_by_vllms_classes(module, name, runner):
    cls = getattr(pytest.importorskip(module), name)
    assert runner_report(object.__new__(cls)) == {"runner": runner, "class": f"{module}.{name}"}


def test_the_fp8_report_names_each_quantized_linears_kernel_class():
    class CutlassFP8ScaledMMLinearKernel:
        pass

    model = torch.nn.Module()
    model.q = torch.nn.Linear(2, 2)
    model.q.scheme = SimpleNamespace(fp8_linear=CutlassFP8ScaledMMLinearKernel())
    model.lm_head = torch.nn.Linear(2, 2)  # not quantized: no scheme
    model.int8 = torch.nn.Linear(2, 2)
    model.int8.scheme = SimpleNamespace(kernel=object())  # an INT8 scheme holds ``kernel``, no ``fp8_linear``
    assert fp8_kernels(model) == {"q": "CutlassFP8ScaledMMLinearKernel"}
