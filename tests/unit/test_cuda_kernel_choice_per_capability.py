"""The CUDA kernel each NVIDIA GPU generation gets, pinned: vLLM 0.24's own kernel selector, shown a CUDA GPU of
compute capability 7.5 (T4), 8.0 (A100), 8.6 (A10), 8.9 (L40S), 9.0 (H100), 10.0 (B200) and 12.0 (RTX PRO 6000),
chooses the linear kernel class of an ``int8``, ``fp8`` and ``fp8_block`` rollout under the environment the rollout
server sets for that GPU (``cuda_kernel_env.kernel_env``), or the project refuses the format there; and the server
gives an FP8 KV cache its attention backend, or refuses it.

What runs is vLLM's: ``init_int8_linear_kernel`` / ``init_fp8_linear_kernel`` (block scales take the block list)
over the real ``_POSSIBLE_*_KERNELS[PlatformEnum.CUDA]`` lists, ``VLLM_DISABLED_KERNELS``, ``VLLM_USE_DEEP_GEMM``, and
every class's own ``is_supported`` / ``can_implement``, with the layer keys vLLM's compressed-tensors W8A8 schemes
derive from the project's quantization config (per-channel weights and dynamic per-token activations; 128 x 128
weight blocks and dynamic 1 x 128 activation groups), bf16 in and out, a 256 x 384 layer (a shape every block kernel
takes).

What is stated, per GPU (``gpu_view``):

* the platform: a ``vllm.platforms.interface.Platform`` of ``PlatformEnum.CUDA`` whose device has the capability
  (vLLM's own ``is_cuda``, ``has_device_capability``, ``is_device_capability_family``, ... answer from it;
  ``support_deep_gemm`` is ``CudaPlatformBase``'s, read from vLLM's source: its module loads the CUDA ops at
  import). It is the ``current_platform`` of the modules the selection reads it in (``VIEWED_MODULES``) only;
* the CUDA library's answers vLLM's Python asks (``csrc/quantization/w8a8/cutlass/scaled_mm_entry.cu``, built with
  CUDA 12.8 or later, as vLLM 0.24's cu130 wheel is): Cutlass FP8 from 8.9, Cutlass block FP8 from 9.0. The
  import-time ``CUTLASS_BLOCK_FP8_SUPPORTED`` is recomputed by vLLM's ``cutlass_block_fp8_supported()`` over them;
* the packages, on every GPU: DeepGEMM importable (verl's GPU image installs it; vLLM 0.24 also looks for a copy in
  its own wheel), and FlashInfer installed with its sm90 block-scale GEMM (``flashinfer-python`` is a requirement of
  vLLM's CUDA wheel). vLLM itself decides by architecture whether they apply (``support_deep_gemm``, FlashInfer's
  ``is_device_capability(90)``). With these, a server that did not set its environment would get DeepGEMM-based
  block kernels on 9.0 and later and Cutlass INT8 on Blackwell (``test_without_the_servers_environment_...``).

This pins the choice against a vLLM upgrade (a changed list, order or predicate fails here); it is no evidence that
the kernels run, which only a GPU shows (``tests/gpu/check_qurl_vllm_cuda.py``). The expectation is read from vLLM
0.24's lists, which other releases change: on another vLLM the module is skipped.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qurl_testkit.cuda_kernel_probe import ON_GPU_USERS_VLLM
from qurl_verl.rollout.cuda_kernel_env import kernel_env, nvidia_capability
from qurl_verl.rollout.engine_checks import check_fp8_hardware, check_int8_hardware
from qurl_verl.rollout.features.kv_cache_scales import check_fp8_kv_cache, fp8_kv_attention_backend
from qurl_verl.settings import QurlConfigError, RolloutSettings
from qurl_verl.settings.rollout import KVCacheFormat

pytestmark = [pytest.mark.both_stacks,
              pytest.mark.skipif(not ON_GPU_USERS_VLLM, reason="the pinned table is vLLM 0.24's (the vLLM verl 0.9.1 "
                                                                 "declares and GPU users run); other releases change "
                                                                 "the kernel lists")]

CUTLASS_INT8, TRITON_INT8 = "CutlassInt8ScaledMMLinearKernel", "TritonInt8ScaledMMLinearKernel"
CUTLASS_FP8, MARLIN_FP8 = "CutlassFP8ScaledMMLinearKernel", "MarlinFP8ScaledMMLinearKernel"
CUTLASS_BLOCK, TRITON_BLOCK = "CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel"
DEEP_GEMM_BLOCK, FLASHINFER_DEEP_GEMM_BLOCK = "DeepGemmFp8BlockScaledMMKernel", "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"
TRITON_ATTN = "TRITON_ATTN"
VLLMS_OWN = "vLLM's own choice"  # the server sets no attention backend
REFUSED = "refused"

# capability: (int8, fp8, fp8_block, FP8 KV cache's attention). A refused format says, after "refused:", the class
# vLLM would have chosen there: the reason for the refusal.
EXPECTED = {
    # Turing, Ampere: Cutlass INT8 (the first CUDA INT8 class; it asks only is_cuda()). No FP8 tensor cores:
    # check_fp8_hardware refuses both FP8 formats, where vLLM's lists would give weight-only Marlin FP8 (W8A16;
    # Marlin takes capabilities from 7.5 below 8.9). An FP8 KV cache: refused, vLLM's Triton attention raises below 8.9
    (7, 5): (CUTLASS_INT8, f"{REFUSED}: {MARLIN_FP8}", f"{REFUSED}: {MARLIN_FP8}", REFUSED),
    (8, 0): (CUTLASS_INT8, f"{REFUSED}: {MARLIN_FP8}", f"{REFUSED}: {MARLIN_FP8}", REFUSED),
    (8, 6): (CUTLASS_INT8, f"{REFUSED}: {MARLIN_FP8}", f"{REFUSED}: {MARLIN_FP8}", REFUSED),
    # Ada: Marlin steps aside from 8.9, FlashInfer's FP8 class takes per-tensor scales only, so Cutlass FP8; block:
    # no DeepGEMM (not this architecture, and the server's VLLM_USE_DEEP_GEMM=0), no Cutlass block kernel below 9.0,
    # Marlin steps aside: Triton's block kernel. KV: the server's Triton attention (FlashInfer keeps host scales)
    (8, 9): (CUTLASS_INT8, CUTLASS_FP8, TRITON_BLOCK, TRITON_ATTN),
    # Hopper: block FP8 would take FlashInfer+DeepGEMM (then DeepGEMM), both gone with VLLM_USE_DEEP_GEMM=0: Cutlass's
    # block kernel, which keeps the streamed codes. KV: vLLM's own choice (FlashAttention 3 reads the device scales)
    (9, 0): (CUTLASS_INT8, CUTLASS_FP8, CUTLASS_BLOCK, VLLMS_OWN),
    # Blackwell (datacenter, then workstation): Cutlass INT8 fails there at run time, the server disables it and
    # vLLM takes Triton INT8; block FP8 as on Hopper (DeepGEMM gone, Cutlass block from 9.0); KV: Triton attention
    (10, 0): (TRITON_INT8, CUTLASS_FP8, CUTLASS_BLOCK, TRITON_ATTN),
    (12, 0): (TRITON_INT8, CUTLASS_FP8, CUTLASS_BLOCK, TRITON_ATTN),
}
# what a server that did not set its environment would get where the environment changes the choice
WITHOUT_THE_SERVERS_ENV = {
    ("int8", (10, 0)): CUTLASS_INT8, ("int8", (12, 0)): CUTLASS_INT8,
    ("fp8_block", (9, 0)): FLASHINFER_DEEP_GEMM_BLOCK,  # FlashInfer's block GEMM is sm90's; DeepGEMM for M >= 32
    ("fp8_block", (10, 0)): DEEP_GEMM_BLOCK, ("fp8_block", (12, 0)): DEEP_GEMM_BLOCK,
}
FORMATS = ("int8", "fp8", "fp8_block")
N, K = 256, 384  # the layer: N a multiple of 64 and K of 128, as DeepGEMM and FlashInfer's block GEMM want
LINEAR = "vllm.model_executor.kernels.linear"
# the modules whose ``current_platform`` the kernel selection reads (the selector, each CUDA class's module, the
# helpers their support questions call)
VIEWED_MODULES = (
    LINEAR, *(f"{LINEAR}.scaled_mm.{m}" for m in ("cutlass", "triton", "marlin", "flashinfer", "deep_gemm", "pytorch",
                                                  "ScaledMMLinearKernel")),
    "vllm.model_executor.layers.quantization.utils.marlin_utils_fp8",
    "vllm.model_executor.layers.quantization.utils.w8a8_utils",
    "vllm.utils.deep_gemm", "vllm.utils.flashinfer",
)
CACHED_ANSWERS = (("vllm.utils.deep_gemm", "is_deep_gemm_supported"), ("vllm.utils.deep_gemm", "is_deep_gemm_e8m0_used"),
                  ("vllm.utils.flashinfer", "has_flashinfer_fp8_blockscale_gemm"),
                  ("vllm.utils.flashinfer", "is_flashinfer_fp8_blockscale_gemm_supported"))


@functools.cache
def _cuda_support_deep_gemm():
    """``CudaPlatformBase.support_deep_gemm`` from vLLM's own source (``vllm/platforms/cuda.py`` loads the CUDA ops
    when imported, so the method is compiled alone)."""
    origin = importlib.util.find_spec("vllm.platforms.cuda").origin
    tree = ast.parse(Path(origin).read_text())
    cuda = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CudaPlatformBase")
    method = next(n for n in cuda.body if isinstance(n, ast.FunctionDef) and n.name == "support_deep_gemm")
    method.decorator_list = []
    namespace: dict = {}
    exec(compile(ast.Module(body=[method], type_ignores=[]), origin, "exec"), namespace)  # noqa: S102 - vLLM's source
    return namespace["support_deep_gemm"]


def cuda_platform(capability: tuple[int, int]):
    """A vLLM CUDA platform whose GPU has ``capability``: vLLM's ``Platform`` answers every capability question
    from it."""
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    device = DeviceCapability(*capability)
    attrs = {
        "_enum": PlatformEnum.CUDA, "device_name": "cuda", "device_type": "cuda", "dispatch_key": "CUDA",
        "get_device_capability": classmethod(lambda cls, device_id=0: device),
        "get_device_name": classmethod(lambda cls, device_id=0: f"NVIDIA GPU sm{device.to_int()}"),
        "support_deep_gemm": classmethod(_cuda_support_deep_gemm()),
    }
    return type(f"CudaSm{device.to_int()}", (Platform,), attrs)()


def _cutlass_library(minimum: int):
    """``vllm._custom_ops.cutlass_scaled_mm_supports_(block_)fp8``: the CUDA library's answer, yes from ``minimum``."""
    return lambda cuda_device_capability: cuda_device_capability >= minimum


@pytest.fixture
def gpu_view(monkeypatch):
    """``gpu_view(capability, server_env=True)``: vLLM's kernel selection sees that GPU (the module docstring), the
    server's environment for it set or not; all undone after the test."""
    vllm = pytest.importorskip("vllm", reason="needs vLLM")
    import vllm.envs as envs
    from vllm import _custom_ops
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    monkeypatch.setattr(torch.version, "hip", None)
    cached = [getattr(importlib.import_module(m), name) for m, name in CACHED_ANSWERS]

    def clear():
        for answer in cached:
            answer.cache_clear()

    def view(capability: tuple[int, int], fmt: str, server_env: bool = True) -> None:
        platform = cuda_platform(capability)
        for name in VIEWED_MODULES:
            module = importlib.import_module(name)
            assert hasattr(module, "current_platform"), name  # a vLLM that moved it: update VIEWED_MODULES
            monkeypatch.setattr(module, "current_platform", platform)
        monkeypatch.setattr(_custom_ops, "cutlass_scaled_mm_supports_fp8", _cutlass_library(89), raising=False)
        monkeypatch.setattr(_custom_ops, "cutlass_scaled_mm_supports_block_fp8", _cutlass_library(90), raising=False)
        w8a8_utils = importlib.import_module("vllm.model_executor.layers.quantization.utils.w8a8_utils")
        monkeypatch.setattr(importlib.import_module(f"{LINEAR}.scaled_mm.cutlass"), "CUTLASS_BLOCK_FP8_SUPPORTED",
                            w8a8_utils.cutlass_block_fp8_supported())
        monkeypatch.setattr(importlib.import_module("vllm.utils.deep_gemm"), "has_deep_gemm", lambda: True)
        flashinfer_utils = importlib.import_module("vllm.utils.flashinfer")
        for name in ("vllm.utils.flashinfer", f"{LINEAR}.scaled_mm.flashinfer"):
            monkeypatch.setattr(importlib.import_module(name), "has_flashinfer", lambda: True)
        gemm = SimpleNamespace(fp8_blockscale_gemm_sm90=object())  # FlashInfer's sm90 block-scale GEMM, present
        real_submodule = flashinfer_utils._get_submodule
        monkeypatch.setattr(flashinfer_utils, "_get_submodule",
                            lambda name: gemm if name == "flashinfer.gemm" else real_submodule(name))
        # the engine's model config, as DeepGEMM's can_implement reads it (a Qwen3 model: not one it excludes)
        model = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(model_type="qwen3")))
        monkeypatch.setattr(importlib.import_module(f"{LINEAR}.scaled_mm.deep_gemm"), "get_current_vllm_config",
                            lambda: model)
        for key in ("VLLM_DISABLED_KERNELS", "VLLM_USE_DEEP_GEMM"):
            monkeypatch.delenv(key, raising=False)
        if server_env:
            for key, value in kernel_env(fmt, nvidia_capability(capability), {}).items():
                monkeypatch.setenv(key, value)
        clear()

    clear()
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))):
        yield view
    monkeypatch.undo()
    clear()
    assert vllm.platforms.current_platform.is_cpu()  # the real platform was never replaced


def chosen_class(fmt: str) -> str:
    """The class vLLM's entry point for ``fmt``'s linears instantiates (vLLM's compressed-tensors keys)."""
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel, init_int8_linear_kernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        create_fp8_quant_key,
        kFp8DynamicTokenSym,
        kFp8StaticChannelSym,
    )

    if fmt == "int8":
        kernel = init_int8_linear_kernel(is_channelwise=True, is_static_input_scheme=False, input_symmetric=True,
                                         module_name="model.layers.0.mlp.down_proj")
    else:
        if fmt == "fp8_block":
            weight = create_fp8_quant_key(static=True, group_shape=GroupShape(128, 128))
            activation = create_fp8_quant_key(static=False, group_shape=GroupShape(1, 128))
        else:
            weight, activation = kFp8StaticChannelSym, kFp8DynamicTokenSym
        kernel = init_fp8_linear_kernel(activation, weight, torch.bfloat16, torch.bfloat16, (N, K),
                                        module_name="model.layers.0.mlp.down_proj")
    return type(kernel).__name__


def project_refusal(fmt: str, capability: tuple[int, int]) -> str | None:
    """The driver's and server's refusal of ``fmt`` on that GPU (None: accepted)."""
    settings = RolloutSettings(format=fmt)
    try:
        check_fp8_hardware(settings, capability)
        check_int8_hardware(settings, capability)
    except QurlConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("capability", list(EXPECTED), ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("column, fmt", list(enumerate(FORMATS)), ids=FORMATS)
def test_the_linear_kernel_each_gpu_generation_gets(gpu_view, capability, column, fmt):
    """The class of ``EXPECTED``, or the project's refusal and the weight-only class it names as the reason."""
    gpu_view(capability, fmt)
    expected = EXPECTED[capability][column]
    refusal = project_refusal(fmt, capability)
    if expected.startswith(REFUSED):
        assert refusal is not None and "weight-only FP8 (W8A16)" in refusal, refusal
        assert chosen_class(fmt) == expected.partition(": ")[2]  # what the refusal says vLLM would run
    else:
        assert refusal is None, refusal
        assert chosen_class(fmt) == expected


def server_fp8_kv_attention(capability: tuple[int, int]) -> str:
    """What the server does with ``kv_cache=fp8`` on that GPU: refuse it, set an attention backend, or leave vLLM's."""
    settings = RolloutSettings(format="int8", kv_cache="fp8")
    try:
        check_fp8_kv_cache(settings, on_cpu=False, avx512=False, amx=False, head_dim=128, uses_mla=False,
                           cuda_capability=capability)
    except QurlConfigError:
        return REFUSED
    return fp8_kv_attention_backend(KVCacheFormat.FP8, nvidia_capability(capability), {}) or VLLMS_OWN


def triton_attention_takes_an_fp8_cache(capability: tuple[int, int], monkeypatch) -> bool:
    """vLLM's own Triton attention, built for an FP8 cache on that GPU: whether it takes it."""
    triton_attn = pytest.importorskip("vllm.v1.attention.backends.triton_attn")
    monkeypatch.setattr(triton_attn, "current_platform", cuda_platform(capability))
    try:
        triton_attn.TritonAttentionImpl(num_heads=4, head_size=128, scale=128 ** -0.5, num_kv_heads=2,
                                        alibi_slopes=None, sliding_window=None, kv_cache_dtype="fp8_e4m3")
    except ValueError as e:
        assert "FP8 KV cache is not supported by the Triton attention backend" in str(e), e
        return False
    return True


@pytest.mark.parametrize("capability", list(EXPECTED), ids=lambda c: f"sm{c[0]}{c[1]}")
def test_the_fp8_kv_cache_attention_each_gpu_generation_gets(capability, monkeypatch):
    """The server's answer, and vLLM's Triton attention (the backend it gives an FP8 cache off Hopper) as the
    independent reference for the refusal: refused exactly where that backend raises."""
    monkeypatch.setattr(torch.version, "hip", None)
    got = server_fp8_kv_attention(capability)
    assert got == EXPECTED[capability][3]
    assert (got == REFUSED) == (not triton_attention_takes_an_fp8_cache(capability, monkeypatch))


@pytest.mark.parametrize("fmt, capability", list(WITHOUT_THE_SERVERS_ENV),
                         ids=[f"{f}-sm{c[0]}{c[1]}" for f, c in WITHOUT_THE_SERVERS_ENV])
def test_without_the_servers_environment_the_choice_differs(gpu_view, fmt, capability):
    """The stated GPU and packages are what make the server's environment matter: without it, vLLM would take
    Cutlass INT8 on Blackwell (which fails there) and a DeepGEMM-based block kernel (which re-rounds the streamed
    codes to power-of-two scales) from Hopper on. With it, the pinned table."""
    gpu_view(capability, fmt, server_env=False)
    assert chosen_class(fmt) == WITHOUT_THE_SERVERS_ENV[(fmt, capability)]
    gpu_view(capability, fmt, server_env=True)
    assert chosen_class(fmt) == EXPECTED[capability][FORMATS.index(fmt)]


def test_every_class_the_table_names_is_in_vllms_cuda_lists():
    """A renamed or dropped class fails here by name, not as a mismatch."""
    linear = pytest.importorskip(LINEAR, reason="vLLM without the kernel registry")
    from vllm.platforms.interface import PlatformEnum

    listed = {k.__name__ for lists in (linear._POSSIBLE_INT8_KERNELS, linear._POSSIBLE_FP8_KERNELS,
                                       linear._POSSIBLE_FP8_BLOCK_KERNELS) for k in lists[PlatformEnum.CUDA]}
    named = {c.rpartition(": ")[2] for row in EXPECTED.values() for c in row[:3]} | set(WITHOUT_THE_SERVERS_ENV.values())
    assert named <= listed, named - listed
