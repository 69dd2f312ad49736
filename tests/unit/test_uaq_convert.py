"""UAQ on a state dict + config.json, and the checkpoint-converting CLI."""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from safetensors import SafetensorError, safe_open
from test_uaq import MOE_LOGIT_ATOL, MOE_MODEL_TYPES, QKV, is_folded, tiny_moe_lm

from qurl_verl.quant import apply_uaq, apply_uaq_to_state_dict, uaq_record
from qurl_verl.quant.uaq_convert import convert_checkpoint, main

pytestmark = pytest.mark.both_stacks  # transformers' checkpoint code, whose version differs between the stacks


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
    lines = []
    convert_checkpoint(src, out, 1.5, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), progress=lines.append)
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    # one line per shard read, then per shard written, with its size on disk
    n = len(shards)
    assert [line.split(" (")[0] for line in lines] == (
        [f"read shard {i}/{n}" for i in range(1, n + 1)] + [f"wrote shard {i}/{n}" for i in range(1, n + 1)])
    sizes = [f"{(src / name).stat().st_size / 1e6:.1f} MB" for name in shards]
    assert [re.fullmatch(r".* \((.*)\) in \d+\.\d s", line).group(1) for line in lines[:n]] == sizes
    converted = transformers.AutoModelForCausalLM.from_pretrained(out)
    ref = logits(model)
    torch.testing.assert_close(logits(converted), ref, rtol=0, atol=2e-6 * ref.abs().max())


# ---------------------------------------------------------------------------------- MoE
def read_checkpoint(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_moe_checkpoint_state_dict_changes_only_input_norm_and_qkv(model_type, tmp_path):
    scale = 1.5
    tiny_moe_lm(model_type).save_pretrained(tmp_path)
    state_dict = read_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # on disk transformers 5 writes one tensor per expert and projection, as checkpoints on the hub have them
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in state_dict
    assert "model.layers.1.mlp.gate.weight" in state_dict

    folded, new_config = apply_uaq_to_state_dict(state_dict, config, scale, QKV)
    assert folded.keys() == state_dict.keys()
    changed = {k for k in state_dict if not torch.equal(folded[k], state_dict[k])}
    assert changed == {k for k in state_dict if is_folded(k)} and len(changed) == 2 * 4
    for key in changed:
        exact = state_dict[key].double() * scale if "layernorm" in key else state_dict[key].double() / scale
        assert torch.equal(folded[key], exact.float()), key
    for key in state_dict.keys() - changed:  # experts, router, shared expert, post_attention_layernorm, biases
        assert folded[key].dtype == state_dict[key].dtype
        assert torch.equal(folded[key].view(torch.int32), state_dict[key].view(torch.int32)), key
    assert uaq_record(new_config) == {"scale": scale, "targets": list(QKV)}
    assert {k: v for k, v in new_config.items() if k != "qurl_uaq"} == config


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_moe_checkpoint_conversion_equals_the_live_fold(model_type, tmp_path):
    import transformers

    model = tiny_moe_lm(model_type)
    src, out = tmp_path / "in", tmp_path / "out"
    model.save_pretrained(src)
    assert convert_checkpoint(src, out, 1.5) == {"scale": 1.5, "targets": list(QKV)}
    assert read_checkpoint(out).keys() == read_checkpoint(src).keys()  # per-expert names kept

    converted = transformers.AutoModelForCausalLM.from_pretrained(out)
    expected = apply_uaq(copy.deepcopy(model), 1.5)  # in memory the experts are fused 3D parameters
    assert converted.state_dict().keys() == expected.state_dict().keys()
    for name, tensor in expected.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    ref = logits(model)
    torch.testing.assert_close(logits(converted), ref, rtol=0, atol=MOE_LOGIT_ATOL * ref.abs().max().item())


def garbage_checkpoint(folder, model_type):
    """A config.json and a model.safetensors that fails the moment anything opens it."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "num_hidden_layers": 2}))
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    return folder


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_moe_gate_up_refused_before_any_tensor_is_read(model_type, tmp_path, capsys):
    src, out = garbage_checkpoint(tmp_path / "in", model_type), tmp_path / "out"
    with pytest.raises(ValueError, match=r"router.*use targets q_proj,k_proj,v_proj"):
        convert_checkpoint(src, out, 1.5, QKV + ("gate_proj", "up_proj"))
    with pytest.raises(SystemExit):
        main(["--model", str(src), "--out", str(out), "--targets", "gate_proj,up_proj"])
    assert "router" in capsys.readouterr().err
    assert not out.exists()
    # the same folder with allowed targets does get read, and the garbage is noticed: the refusal came first
    with pytest.raises(SafetensorError):
        convert_checkpoint(src, out, 1.5, QKV)


@pytest.mark.parametrize("model_type,reason", [("mixtral", "block_sparse_moe"), ("deepseek_v3", "MLA")])
def test_refused_architectures_before_any_tensor_is_read(model_type, reason, tmp_path):
    src = garbage_checkpoint(tmp_path / "in", model_type)
    with pytest.raises(ValueError, match=reason):
        convert_checkpoint(src, tmp_path / "out")
