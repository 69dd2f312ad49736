"""Which INT8 kernel class, and which GEMM path, vLLM's own selector gives a W8A8 linear on each CPU class.

``vllm_cpu_int8_kernels`` puts the project's classes (``qurl_verl/kernels/cpu_int8.py``) into vLLM's
CPU INT8 kernel list; vLLM's ``init_int8_linear_kernel`` then picks the first class whose ``is_supported`` and
``can_implement`` answer True, and the kernel object picks its path as vLLM post-processes the layer. Each CPU
class is forced through the predicates the classes read (the saturation probe, AMX tiles) and those vLLM reads
(AMX tiles in ``check_cpu_sgl_kernel``, the CPU architecture, 0.24's ``VLLM_CPU_SGL_KERNEL`` opt-in), with
``qurl_testkit/sgl_stand_in.py`` for the AMX ops this machine may lack; the GEMM report names what the engine
holds from the same objects.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from torch.nn import Parameter
from vllm import _custom_ops as ops
from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
from vllm.platforms import CpuArchEnum, PlatformEnum, current_platform

from qurl_verl.kernels import cpu_int8 as cpu_int8_kernels
from qurl_verl.kernels import cpu_int8_paths as paths
from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_int8_kernels as int8_kernels
from qurl_verl.rollout import int8_gemm_report

needs_onednn = pytest.mark.skipif(not ops._supports_onednn, reason="this vLLM build has no CPU oneDNN ops")
pytestmark = [pytest.mark.both_stacks, needs_onednn]  # vLLM's selector and kernel list differ between the stacks

N, K = 48, 128  # sgl-eligible (N % 16 == 0, K % 32 == 0): only the CPU class decides
SATURATION_FREE = "SaturationFreeCPUInt8ScaledMMLinearKernel"
AMX = "AmxFp32OneDNNCPUInt8ScaledMMLinearKernel"
VLLM = "CPUInt8ScaledMMLinearKernel"
REAL_PROBE = paths.onednn_int8_saturates  # the host's answer, kept before any test replaces it


@pytest.fixture
def stock_vllm(monkeypatch):
    """vLLM's own CPU INT8 list and post-processing (restored after the test), whatever the process did before."""
    for name in ("process_weights_for_onednn", "process_weights_for_sgl"):
        monkeypatch.setattr(CPUInt8ScaledMMLinearKernel, name, inspect.unwrap(getattr(CPUInt8ScaledMMLinearKernel, name)))
    possible = linear_kernels._POSSIBLE_INT8_KERNELS
    monkeypatch.setitem(possible, PlatformEnum.CPU, [k for k in possible[PlatformEnum.CPU] if k not in cpu_int8_kernels.KERNELS])
    return possible[PlatformEnum.CPU]


def force_cpu_class(monkeypatch, sgl_gemms, *, saturates: bool, amx: bool, avx2_kernel: bool = True) -> None:
    """This process as on a CPU of that class: x86, oneDNN's int8 GEMM saturating or not, AMX tiles or not
    (with the sgl ops' stand-ins and 0.24's opt-in), the packed AVX2 GEMM buildable or not."""
    from qurl_testkit import sgl_stand_in

    monkeypatch.setattr(type(current_platform), "get_cpu_architecture", classmethod(lambda cls: CpuArchEnum.X86))
    monkeypatch.setattr(type(current_platform), "is_zen_cpu", lambda self: False)
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: saturates)
    sgl_gemms.force_amx(amx)
    if amx:
        sgl_stand_in.install_ops(lambda obj, name, value: monkeypatch.setattr(obj, name, value, raising=False))
    if not avx2_kernel:
        monkeypatch.setattr(paths, "avx2_kernel_available", lambda: False)
    elif saturates:
        from qurl_verl.platform import cpu_int8_gemm

        if not cpu_int8_gemm.cpu_supports_kernel(cpu_int8_gemm.cpu_flags()):
            pytest.skip("this CPU has no AVX2: the packed AVX2 GEMM cannot run here")
        assert cpu_int8_gemm.load(), "the AVX2 INT8 GEMM failed to build (see the warning above)"


def w8a8_problem(n=N, k=K, seed=0):
    """Codes, [N, 1] scales 2^-e and inputs whose rows have absmax 127 (per-token scale 1): the W8A8 product
    is exact in float32 (see ``test_cpu_dispatch_branches.w8a8_problem``)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0], codes[1] = 127, -127
    scale = torch.exp2(-torch.randint(0, 3, (n, 1), generator=g).float())
    x = torch.randint(-127, 128, (2, 3, k), generator=g).float()
    x[..., 0] = 127.0
    return codes, scale, x


def exact_product(codes, scale, x):
    acc = (x.reshape(-1, x.shape[-1]).to(torch.int64) @ codes.to(torch.int64).t()).to(torch.float64)
    return (acc * scale.to(torch.float64).t()).reshape(*x.shape[:-1], codes.shape[0])


def selected_linear(codes, scale, dtype):
    """A layer as the compressed-tensors W8A8 scheme builds it in ``dtype``, its kernel from vLLM's selector,
    post-processed (as at the first load and every reload)."""
    kernel = linear_kernels.init_int8_linear_kernel(
        is_channelwise=True, is_static_input_scheme=False, input_symmetric=True, module_name="model.layers.0.mlp")
    layer = torch.nn.Module()
    layer.weight = Parameter(codes.clone(), requires_grad=False)
    layer.weight_scale = Parameter(scale.clone(), requires_grad=False)
    layer.input_scale = layer.input_zero_point = layer.azp_adj = layer.bias = None
    layer.logical_widths = [codes.shape[0]]
    layer.params_dtype = dtype
    kernel.process_weights_after_loading(layer)
    return kernel, layer


CPU_CLASSES = [
    # CPU class: (oneDNN saturates, AMX tiles, packed AVX2 GEMM built, engine dtype) -> (kernel class, path, GEMM)
    pytest.param(True, False, True, torch.bfloat16, (SATURATION_FREE, "avx2_packed", "avx2_packed"), id="avx2"),
    pytest.param(True, False, False, torch.bfloat16, (SATURATION_FREE, "onednn_split", "onednn_split"),
                 id="avx2-no-compiler"),
    pytest.param(False, False, True, torch.bfloat16, (VLLM, None, "onednn"), id="avx512_vnni-no-amx"),
    pytest.param(False, True, True, torch.bfloat16, (AMX, "amx_sgl", "amx_sgl"), id="amx-bf16-engine"),
    pytest.param(False, True, True, torch.float32, (AMX, "onednn", "onednn"), id="amx-fp32-engine"),
]


@pytest.mark.parametrize("saturates,amx,avx2_kernel,dtype,want", CPU_CLASSES)
def test_each_cpu_class_gets_its_kernel_class_and_path(stock_vllm, sgl_gemms, monkeypatch,
                                                       saturates, amx, avx2_kernel, dtype, want):
    """The class vLLM's selector picks and the path its object takes, on each CPU class, as the worker installs
    the list (``before_model_load``); the GEMM report names the same, and the output is the exact W8A8 product
    rounded once to the engine's dtype where the path is exact on any CPU (not vLLM's single oneDNN GEMM,
    exact only where oneDNN does not saturate)."""
    force_cpu_class(monkeypatch, sgl_gemms, saturates=saturates, amx=amx, avx2_kernel=avx2_kernel)
    assert bool(int8_kernels.apply()) is (saturates or amx)  # nothing inserted where vLLM's class is right
    codes, scale, x = w8a8_problem()
    kernel, layer = selected_linear(codes, scale, dtype)
    gemm = int8_gemm_report.kernel_gemm(kernel)
    assert (type(kernel).__name__, getattr(kernel, paths.INT8_PATH_ATTR, None), gemm) == want
    if want[0] != VLLM:
        assert kernel.int8_path == want[1]

    module = torch.nn.Module()
    module.scheme = type("Scheme", (), {"kernel": kernel})()
    assert int8_gemm_report.int8_gemms(torch.nn.ModuleDict({"linear": module})) == {"linear": want[2]}
    if gemm == "onednn" and (dtype != torch.float32 or REAL_PROBE()):
        return  # vLLM's handler writes the default dtype (float32 here, the model's in an engine); saturates here
    out = kernel.apply_weights(layer, x.to(dtype))
    assert out.dtype == dtype and torch.equal(out, exact_product(codes, scale, x).to(dtype))


def test_the_path_is_decided_again_at_every_reload(stock_vllm, sgl_gemms, monkeypatch):
    """The class is vLLM's choice for the layer's life; the path follows each sync's codes: a code of -128
    (vLLM's dummy initial weights hold some) takes the split, the next codes the packed AVX2 GEMM."""
    force_cpu_class(monkeypatch, sgl_gemms, saturates=True, amx=False)
    assert int8_kernels.apply()
    codes, scale, x = w8a8_problem()
    dummy = codes.clone()
    dummy[2, 5] = -128
    kernel, layer = selected_linear(dummy, scale, torch.float32)
    assert kernel.int8_path == "onednn_split"
    layer.weight = Parameter(codes.clone(), requires_grad=False)  # the reload: new codes, the same kernel object
    layer.weight_scale = Parameter(scale.clone(), requires_grad=False)
    kernel.process_weights_after_loading(layer)
    assert type(kernel).__name__ == SATURATION_FREE and kernel.int8_path == "avx2_packed"
    assert torch.equal(kernel.apply_weights(layer, x).double(), exact_product(codes, scale, x))


def test_the_classes_go_right_ahead_of_vllm_own_once(stock_vllm, sgl_gemms, monkeypatch):
    """Inserted ahead of vLLM's class (which every CPU supports: appended after it, as vLLM's
    ``register_linear_kernel`` does, they would never be chosen) and behind zentorch's, once per process."""
    force_cpu_class(monkeypatch, sgl_gemms, saturates=False, amx=True)
    before = list(stock_vllm)
    assert int8_kernels.apply() == ("put SaturationFreeCPUInt8ScaledMMLinearKernel, "
                                    "AmxFp32OneDNNCPUInt8ScaledMMLinearKernel ahead of CPUInt8ScaledMMLinearKernel")
    at = before.index(CPUInt8ScaledMMLinearKernel)
    assert stock_vllm == before[:at] + list(cpu_int8_kernels.KERNELS) + before[at:]
    assert int8_kernels.apply() == "" and len(stock_vllm) == len(before) + 2


def test_nothing_is_inserted_into_a_list_without_vllm_own_class(stock_vllm, sgl_gemms, monkeypatch):
    """A list that no longer holds ``CPUInt8ScaledMMLinearKernel`` is not the one the classes were written for."""
    force_cpu_class(monkeypatch, sgl_gemms, saturates=True, amx=True)
    stock_vllm.remove(CPUInt8ScaledMMLinearKernel)
    before = list(stock_vllm)
    assert int8_kernels.apply() == "" and stock_vllm == before


@pytest.mark.parametrize("saturates,amx", [(True, True), (False, False)])
def test_the_classes_say_why_they_are_not_chosen(stock_vllm, sgl_gemms, monkeypatch, saturates, amx):
    """``is_supported`` answers from the predicates alone, with vLLM's (ok, reason) convention."""
    force_cpu_class(monkeypatch, sgl_gemms, saturates=saturates, amx=amx, avx2_kernel=False)
    got = {k.__name__: k.is_supported() for k in cpu_int8_kernels.KERNELS}
    if saturates and amx:  # only where a test forces both: the saturating CPU's exact paths come first
        assert got == {SATURATION_FREE: (True, None), AMX: (True, None)}
        return
    assert not got[SATURATION_FREE][0] and "saturates" in got[SATURATION_FREE][1]
    assert not got[AMX][0] and "AMX" in got[AMX][1]
    assert cpu_int8_kernels.supported() == [] and not int8_kernels.applies()
