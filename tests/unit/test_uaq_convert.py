"""UAQ on a state dict + config.json, and the checkpoint-converting CLI."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from qurl_verl.quant import apply_uaq, apply_uaq_to_state_dict, uaq_record
from qurl_verl.quant.uaq_convert import convert_checkpoint, main


def logits(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits.to(torch.float64)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_state_dict_path_equals_model_path(tiny_causal_lm, model_type):
    model = tiny_causal_lm(model_type)
    state_dict = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    targets = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    folded, new_config = apply_uaq_to_state_dict(state_dict, config, 1.5, targets)
    applied = apply_uaq(copy.deepcopy(model), 1.5, targets)
    for name, tensor in applied.state_dict().items():
        assert torch.equal(folded[name], tensor), name
    assert uaq_record(new_config) == uaq_record(applied.config)
    # inputs untouched
    assert all(torch.equal(state_dict[k], v) for k, v in model.state_dict().items())
    assert "qurl_uaq" not in config
    with pytest.raises(ValueError, match="already applied"):
        apply_uaq_to_state_dict(folded, new_config, 1.5)


def test_state_dict_path_checks_arch_and_layers(tiny_causal_lm):
    model = tiny_causal_lm("llama")
    sd, config = model.state_dict(), model.config.to_dict()
    with pytest.raises(ValueError, match="supported model_types"):
        apply_uaq_to_state_dict(sd, dict(config, model_type="phi3"))
    partial = {k: v for k, v in sd.items() if ".layers.1." not in k}
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        apply_uaq_to_state_dict(partial, config)
    fused = {k: v for k, v in sd.items() if "k_proj" not in k}
    with pytest.raises(ValueError, match="lacks"):
        apply_uaq_to_state_dict(fused, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cli_converts_checkpoint_and_refuses_twice(tiny_causal_lm, tmp_path, dtype, capsys):
    import transformers

    model = tiny_causal_lm("qwen2", dtype=dtype)
    src, out, again = tmp_path / "in", tmp_path / "out", tmp_path / "again"
    model.save_pretrained(src)
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    (src / "chat_template.jinja").write_text("{{ messages }}")

    assert main(["--model", str(src), "--out", str(out), "--scale", "1.5"]) == 0
    assert "UAQ applied" in capsys.readouterr().out
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {dtype}

    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    assert uaq_record(converted.config) == {"scale": 1.5, "targets": ["q_proj", "k_proj", "v_proj"]}
    expected = apply_uaq(copy.deepcopy(model), 1.5)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    if dtype == torch.float32:
        ref = logits(model)
        torch.testing.assert_close(logits(converted), ref, rtol=0, atol=2e-6 * ref.abs().max())

    with pytest.raises(SystemExit):
        main(["--model", str(out), "--out", str(again)])
    assert "already applied" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not empty"):
        convert_checkpoint(src, out)


def test_cli_keeps_shards(tiny_causal_lm, tmp_path):
    import transformers

    model = tiny_causal_lm("llama")
    src, out = tmp_path / "in", tmp_path / "out"
    model.save_pretrained(src, max_shard_size="100KB")
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) > 1
    convert_checkpoint(src, out, 1.5, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    converted = transformers.AutoModelForCausalLM.from_pretrained(out)
    ref = logits(model)
    torch.testing.assert_close(logits(converted), ref, rtol=0, atol=2e-6 * ref.abs().max())
