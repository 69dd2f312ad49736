"""``export_quantized_checkpoint`` writes the codes and scales the rollout computes, and the engine's config.

The reference is a direct ``qurl_verl.quant.quantize`` of each projection weight read back from
the input checkpoint, and ``RolloutSettings.quantization_config()``: the export must match both
exactly, leave every other tensor and file as it was, and refuse bad inputs before writing.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qurl_verl.export_quantized import export_quantized_checkpoint
from qurl_verl.quant import INT8_CHANNEL, quantize
from qurl_verl.settings import QurlConfigError, RolloutSettings

pytestmark = pytest.mark.both_stacks  # transformers' checkpoint code, whose version differs between the stacks

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _save(model, out: Path, **kwargs) -> Path:
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    (out / "tokenizer_config.json").write_text('{"stand_in": "tokenizer"}')  # any extra file travels along
    return out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tiny_causal_lm) -> Path:
    return _save(tiny_causal_lm("qwen2"), tmp_path_factory.mktemp("qwen2") / "model")


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


@pytest.mark.parametrize("fmt, weight_bits", [("int8", 8), ("int8", 6), ("fp8", 8), ("fp8_block", 8)])
def test_export_equals_direct_quantization(tiny_checkpoint, tmp_path, fmt, weight_bits):
    settings = RolloutSettings(format=fmt, weight_bits=weight_bits)
    config = export_quantized_checkpoint(tiny_checkpoint, tmp_path / "out", format=fmt, weight_bits=weight_bits)
    src, got = _read_all(tiny_checkpoint), _read_all(tmp_path / "out")

    assert config == settings.quantization_config()
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["quantization_config"] == settings.quantization_config()
    assert {k: v for k, v in written.items() if k != "quantization_config"} == json.loads(
        (tiny_checkpoint / "config.json").read_text())
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"stand_in": "tokenizer"}'

    quantized = [n for n in src if _is_projection(n)]
    assert len(quantized) == 7 * 2  # 7 projections x 2 layers
    assert set(got) == set(src) | {n[: -len("weight")] + "weight_scale" for n in quantized}
    for name in quantized:
        ref = quantize(src[name], settings.quant_scheme)
        scale = got[name[: -len("weight")] + "weight_scale"]
        assert got[name].dtype == ref.data.dtype, name
        assert torch.equal(got[name].view(torch.uint8), ref.data.view(torch.uint8)), name  # fp8 too, bit for bit
        assert scale.dtype == torch.float32 and torch.equal(scale, ref.scale), name
    if weight_bits == 6:
        assert max(int(got[n].abs().max()) for n in quantized) == 31
    for name in set(src) - set(quantized):  # embeddings, norms, biases, untied lm_head: bit for bit
        assert got[name].dtype == src[name].dtype and torch.equal(got[name], src[name]), name


def test_ignored_layers_and_sharded_checkpoints(tiny_causal_lm, tmp_path):
    """``ignore`` reaches both the tensors and the config; a sharded index is rewritten with the scales."""
    src_dir = _save(tiny_causal_lm("qwen2", tie_word_embeddings=False), tmp_path / "model", max_shard_size="20KB")
    assert (src_dir / "model.safetensors.index.json").exists()
    config = export_quantized_checkpoint(src_dir, tmp_path / "out", ignore=["down_proj", "model.layers.0.self_attn.o_proj"])
    assert config == RolloutSettings(ignore=("down_proj", "model.layers.0.self_attn.o_proj")).quantization_config()
    src, got = _read_all(src_dir), _read_all(tmp_path / "out")
    scales = {n[: -len("_scale")] for n in got if n.endswith("weight_scale")}
    assert "lm_head.weight" in src and torch.equal(got["lm_head.weight"], src["lm_head.weight"])
    assert scales == {n for n in src if _is_projection(n) and "down_proj" not in n
                      and n != "model.layers.0.self_attn.o_proj.weight"}
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    for name, fname in index["weight_map"].items():
        assert name in load_file(str(tmp_path / "out" / fname)), name


def test_uaq_checkpoint_is_exported_as_it_is(tiny_checkpoint, tmp_path):
    from qurl_verl.quant.uaq_convert import convert_checkpoint
    from qurl_verl.uaq_checkpoint import uaq_record_of

    record = convert_checkpoint(tiny_checkpoint, tmp_path / "uaq")
    export_quantized_checkpoint(tmp_path / "uaq", tmp_path / "out")
    assert uaq_record_of(tmp_path / "out") == record
    src, got = _read_all(tmp_path / "uaq"), _read_all(tmp_path / "out")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(got[name], quantize(src[name], INT8_CHANNEL).data)  # the scaled weights, not undone
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], src["model.layers.0.input_layernorm.weight"])


def test_refusals_happen_before_anything_is_written(tiny_checkpoint, tiny_causal_lm, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        export_quantized_checkpoint(tiny_checkpoint, full)
    with pytest.raises(ValueError, match="input folder"):
        export_quantized_checkpoint(tiny_checkpoint, tiny_checkpoint)
    for bad in ("int4", "bf16"):
        with pytest.raises(ValueError, match="int8, fp8, fp8_block"):
            export_quantized_checkpoint(tiny_checkpoint, tmp_path / "out", format=bad)
    with pytest.raises(QurlConfigError, match="weight_bits"):
        export_quantized_checkpoint(tiny_checkpoint, tmp_path / "out", format="fp8", weight_bits=6)

    mistral = _save(tiny_causal_lm("mistral"), tmp_path / "mistral")
    for f in mistral.glob("*.safetensors"):
        f.write_bytes(b"not safetensors")  # proves the refusal comes before any tensor is read
    with pytest.raises(QurlConfigError, match="MistralForCausalLM"):
        export_quantized_checkpoint(mistral, tmp_path / "out")

    export_quantized_checkpoint(tiny_checkpoint, tmp_path / "once")
    with pytest.raises(ValueError, match="already quantized"):
        export_quantized_checkpoint(tmp_path / "once", tmp_path / "out")

    with pytest.raises(ValueError, match="all of them or none"):  # a half-ignored fused layer: nothing left behind
        export_quantized_checkpoint(tiny_checkpoint, tmp_path / "out", ignore=["q_proj"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "mistral", "once"]


def test_command_line(tiny_checkpoint, tmp_path, capsys):
    from qurl_verl.export_quantized import main

    assert main(["--model", str(tiny_checkpoint), "--out", str(tmp_path / "out"), "--format", "fp8",
                 "--ignore", "down_proj"]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["quantization_config"] == RolloutSettings(format="fp8", ignore=("down_proj",)).quantization_config()
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_checkpoint), "--out", str(tmp_path / "out")])
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize("experts", ["bf16", "quantized"])
def test_moe_export_keeps_routers_and_by_default_experts_in_full_precision(tmp_path, experts):
    """A tiny Qwen3-MoE: attention exported as the rollout quantizes it, routers untouched, experts untouched
    or quantized per expert (codes and scales equal to a direct quantize), as ``custom.qurl.experts``."""
    from qurl_recipes.tiny_model import TinyMoeSpec, build_tiny_moe_model

    model = build_tiny_moe_model(tmp_path / "moe", TinyMoeSpec(), dtype="float32")
    config = export_quantized_checkpoint(model, tmp_path / "out", "int8", experts=experts)
    assert config == RolloutSettings(format="int8", experts=experts).quantization_config()
    source, out = load_file(str(model / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, tensor in source.items():
        module = name.rsplit(".", 1)[0]
        quantized = module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) or (
            experts == "quantized" and ".mlp.experts." in module)
        if quantized:
            want = quantize(tensor, INT8_CHANNEL)
            assert torch.equal(out[name], want.data) and torch.equal(out[f"{module}.weight_scale"], want.scale), name
        else:
            assert torch.equal(out[name], tensor) and f"{module}.weight_scale" not in out, name
    assert any(".mlp.gate." in n for n in source)  # the router was among the untouched tensors


def test_moe_export_refuses_an_ignore_list_that_splits_experts(tmp_path):
    from qurl_recipes.tiny_model import build_tiny_moe_model

    model = build_tiny_moe_model(tmp_path / "moe")
    with pytest.raises(ValueError, match="as one layer: ignore all of them or none"):
        export_quantized_checkpoint(model, tmp_path / "out", "int8", ignore=["down_proj"], experts="quantized")
    assert not (tmp_path / "out").exists()
