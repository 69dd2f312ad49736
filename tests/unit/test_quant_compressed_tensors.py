"""compressed-tensors emission: tensor names, shapes and dtypes, streaming, and the quantization_config schema."""
from __future__ import annotations

import math

import pytest
import torch

from qurl_verl.quant import (
    FP8_BLOCK,
    INT8_CHANNEL,
    compressed_tensors_config,
    is_quantization_target,
    parse_scheme,
    quantize_state_dict,
)

pytestmark = pytest.mark.both_stacks  # transformers' checkpoint code, whose version differs between the stacks


def fake_llama_state_dict(hidden=160, inter=300, layers=2, vocab=64, bias=True):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    sd = {"model.embed_tokens.weight": r(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        sd[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        for proj, (n, k) in {"q_proj": (hidden, hidden), "k_proj": (hidden // 2, hidden), "v_proj": (hidden // 2, hidden),
                             "o_proj": (hidden, hidden)}.items():
            sd[f"{p}.self_attn.{proj}.weight"] = r(n, k)
            if bias and proj != "o_proj":
                sd[f"{p}.self_attn.{proj}.bias"] = r(n)
        sd[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
        for proj, (n, k) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}.items():
            sd[f"{p}.mlp.{proj}.weight"] = r(n, k)
    sd["model.norm.weight"] = torch.ones(hidden)
    sd["lm_head.weight"] = r(vocab, hidden)
    return sd


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("fmt,granularity", [("int8", "channel"), ("fp8", "channel"), ("fp8", "block")])
def test_targets_get_weight_and_scale_everything_else_passes_through(fmt, granularity):
    sd = fake_llama_state_dict()
    out = dict(quantize_state_dict(sd, parse_scheme(fmt, granularity), ignore=("lm_head", "model.layers.1.mlp.down_proj")))
    targets = {k for k in sd if k.split(".")[-2] in PROJECTIONS and k.endswith(".weight")} - {
        "model.layers.1.mlp.down_proj.weight"
    }
    assert len(targets) == 13
    assert set(out) == set(sd) | {t[: -len("weight")] + "weight_scale" for t in targets}
    code_dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    qmax = 127.0 if fmt == "int8" else 448.0
    for name, tensor in sd.items():
        if name not in targets:
            assert out[name] is tensor, name  # embeddings, norms, biases, lm_head, ignored layer
            continue
        n, k = tensor.shape
        data, scale = out[name], out[name[: -len("weight")] + "weight_scale"]
        assert data.dtype == code_dtype and data.shape == (n, k)
        assert scale.dtype == torch.float32
        w64 = tensor.double()
        if granularity == "channel":
            assert scale.shape == (n, 1)
            torch.testing.assert_close(scale.double(), w64.abs().amax(1, keepdim=True) / qmax, rtol=2**-23, atol=0)
            deq = data.double() * scale.double()
        else:
            assert scale.shape == (math.ceil(n / 128), math.ceil(k / 128))
            torch.testing.assert_close(scale[0, 0].double(), w64[:128, :128].abs().max() / qmax, rtol=2**-23, atol=0)
            torch.testing.assert_close(scale[-1, -1].double(), w64[(n - 1) // 128 * 128 :, (k - 1) // 128 * 128 :].abs().max() / qmax,
                                       rtol=2**-23, atol=0)
            deq = data.double() * scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        rel = (deq - w64).norm() / w64.norm()
        assert rel < (0.01 if fmt == "int8" else 0.05)


def test_streams_one_tensor_at_a_time():
    sd = fake_llama_state_dict(layers=1)
    consumed = []

    def stream():
        for name, tensor in sd.items():
            consumed.append(name)
            yield name, tensor

    out = quantize_state_dict(stream(), INT8_CHANNEL)
    assert consumed == []  # lazy
    first = next(out)
    assert first[0] == "model.embed_tokens.weight" and len(consumed) == 1
    rest = list(out)
    assert len(consumed) == len(sd) and len(rest) + 1 == len(sd) + 7


def test_target_selection():
    w = torch.zeros(8, 8)
    assert is_quantization_target("model.layers.3.self_attn.q_proj.weight", w)
    assert not is_quantization_target("model.layers.3.self_attn.q_proj.bias", torch.zeros(8))
    assert not is_quantization_target("model.layers.3.input_layernorm.weight", torch.zeros(8))
    assert not is_quantization_target("model.embed_tokens.weight", w)
    assert not is_quantization_target("lm_head.weight", w)
    assert not is_quantization_target("visual.q_proj.weight", w)  # not under a decoder's layers.
    assert not is_quantization_target("model.layers.3.self_attn.q_proj.weight", w, ignore=("re:.*layers\\.3\\..*",))
    assert is_quantization_target("model.layers.0.self_attn.qkv_proj.weight", w, targets=("qkv_proj",))
    assert is_quantization_target("anything.weight", w, targets=lambda name, t: name.startswith("any"))
    with pytest.raises(ValueError, match="INT8 block"):
        list(quantize_state_dict({}, parse_scheme("int8", "block")))


def test_quantization_config_top_level():
    cfg = compressed_tensors_config(INT8_CHANNEL, ignore=("lm_head", "model.layers.0.mlp.down_proj"))
    assert cfg["quant_method"] == "compressed-tensors"
    assert cfg["format"] == "int-quantized"
    assert cfg["quantization_status"] == "compressed"
    assert cfg["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj"]
    assert list(cfg["config_groups"]) == ["group_0"] and cfg["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert compressed_tensors_config(FP8_BLOCK)["format"] == "float-quantized"
    with pytest.raises(ValueError, match="INT8 block"):
        compressed_tensors_config(parse_scheme("int8", "block"))


@pytest.mark.parametrize(
    "fmt,granularity,preset", [("int8", "channel", "W8A8"), ("fp8", "channel", "FP8_DYNAMIC"), ("fp8", "block", "FP8_BLOCK")]
)
def test_quantization_config_matches_compressed_tensors_presets(fmt, granularity, preset):
    """The compressed-tensors library (what vLLM parses the config with) is the reference schema."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    cfg = compressed_tensors_config(parse_scheme(fmt, granularity))
    parsed = ct.QuantizationConfig.model_validate(cfg)
    assert parsed.quantization_status == ct.QuantizationStatus.COMPRESSED
    expected_format = CompressionFormat.int_quantized if fmt == "int8" else CompressionFormat.float_quantized
    assert parsed.format == expected_format.value
    scheme = parsed.config_groups["group_0"]
    fields = ("num_bits", "type", "symmetric", "strategy", "dynamic", "block_structure", "group_size")
    for role in ("weights", "input_activations"):
        ours = getattr(scheme, role).model_dump()
        ref = PRESET_SCHEMES[preset][role].model_dump()
        assert {f: ours[f] for f in fields} == {f: ref[f] for f in fields}, role
