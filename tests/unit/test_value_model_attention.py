"""patches/cpu_platform/value_model_attention: verl's critic loads on the CPU platform.

The "needed" half fails when verl's loader honours the configured attention (or trl ships with
the stack): drop the patch then.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from qurl_verl.patches.cpu_platform import value_model_attention

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                                reason="flash-attn is installed: verl's own loader works")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from qurl_recipes.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("critic") / "tiny")


def load(loader, model_dir):
    from transformers import AutoConfig
    from verl.utils.model import load_valuehead_model  # noqa: F401 - the module must be loaded

    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels = 1
    return loader(local_path=str(model_dir), torch_dtype=torch.float32, model_config=config, trust_remote_code=False)


def test_stock_loader_cannot_load_a_critic_without_flash_attn(tiny_model):
    from verl.utils import model as verl_model

    with pytest.raises(RuntimeError, match="is not a value head model"):
        load(getattr(verl_model.load_valuehead_model, "__wrapped__", verl_model.load_valuehead_model), tiny_model)


def test_patched_loader_loads_it_with_sdpa_and_leaves_transformers_as_it_was(tiny_model, monkeypatch):
    import transformers
    from verl.utils import model as verl_model

    before = {c: c.__dict__.get("from_pretrained") for c in (transformers.AutoModelForTokenClassification,
                                                             transformers.AutoModelForCausalLM)}
    monkeypatch.setattr(verl_model, "load_valuehead_model", verl_model.load_valuehead_model)  # restored after
    assert value_model_attention.patch_module(verl_model) or getattr(verl_model.load_valuehead_model,
                                                                     value_model_attention._MARK)
    assert not value_model_attention.patch_module(verl_model)  # idempotent
    critic = load(verl_model.load_valuehead_model, tiny_model)
    assert isinstance(critic, transformers.PreTrainedModel) and critic.config._attn_implementation == "sdpa"
    values = critic(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert values.shape == (1, 3, 1) and torch.isfinite(values).all()
    assert {c: c.__dict__.get("from_pretrained") for c in before} == before


def test_the_swap_restores_the_classes_on_error():
    class Loader:
        @classmethod
        def from_pretrained(cls, *args, attn_implementation=None):
            return attn_implementation

    own = Loader.__dict__["from_pretrained"]
    with value_model_attention.flash_attention_loaded_as("sdpa", (Loader,)):
        assert Loader.from_pretrained(attn_implementation="flash_attention_2") == "sdpa"
        assert Loader.from_pretrained(attn_implementation="eager") == "eager"
    assert Loader.__dict__["from_pretrained"] is own
    with pytest.raises(ZeroDivisionError):
        with value_model_attention.flash_attention_loaded_as("sdpa", (Loader,)):
            raise ZeroDivisionError
    assert Loader.__dict__["from_pretrained"] is own
