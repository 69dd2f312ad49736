"""bench/bench_int8_sync.py: its byte counts against models built by transformers, and one measured sync.

The bench's committed ratios (``bench/results/int8_sync.md``) and its 7B / 32B rows come from ``stream_bytes``, a
count from the model's shapes; its measured rows must equal it. Here the count is held to an independent
reference: a real Qwen2 / Qwen3 module's ``state_dict`` (what verl's FSDP engine streams, a tied ``lm_head.weight``
included) for verl's stream, and ``quantize_state_dict`` of that state_dict, the rest cast, the tied lm_head left
out, each tensor as the codec's ``aligned`` puts it on the wire (a shape header and padding where its byte count is
not a multiple of 16), for what ``qurl_int8`` sends; at the published models' shapes and at odd ones that need the
padding. Then syncs through the engine in two processes, as the bench runs them (its own engine_kwargs, both
sides' ``prepare()`` results), whose measured payload must equal the count.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))  # the script and its modules import each other as when run by path

import bench_int8_sync  # noqa: E402
from roofline_shapes import ModelShape  # noqa: E402

from qurl_verl.checkpoint_engine.wire_codec import aligned  # noqa: E402
from qurl_verl.quant.compressed_tensors_format import quantize_state_dict  # noqa: E402
from qurl_verl.settings import RolloutSettings  # noqa: E402

DIMS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96,
            vocab_size=300, head_dim=32)
# byte counts that are not multiples of 16: a 6-wide k/v bias, 50 scale rows, 301 x 36 in bf16, (6, 36) codes
ODD_DIMS = dict(hidden_size=36, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=50, vocab_size=301, head_dim=6)


def tiny_module(arch: str, tied: bool, dims: dict = DIMS):
    import transformers

    config_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    config = config_cls(**dims, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return model_cls(config).float(), config


def shape_of(config, arch: str) -> ModelShape:
    return ModelShape(config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim, config.intermediate_size, config.vocab_size,
                      config.tie_word_embeddings, arch == "qwen2", arch == "qwen3", "test")


def qurl_bytes(state: dict[str, torch.Tensor], fmt: str, tied: bool) -> int:
    """What qurl_int8 sends, counted from a direct quantization of the state_dict, aligned as the codec does."""
    quantization, _, rest = fmt.partition("+")
    settings = RolloutSettings(format=quantization)
    named = ((n, t) for n, t in state.items() if not (tied and n == "lm_head.weight"))
    total = 0
    for name, t in quantize_state_dict(named, settings.quant_scheme, ignore=settings.ignore_patterns):
        if rest and t.element_size() > 1 and not name.endswith("weight_scale"):
            t = t.to(torch.bfloat16)
        total += sum(w.numel() * w.element_size() for _, w in aligned(name, t))
    return total


def fp32_wire_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(w.numel() * w.element_size() for n, t in state.items() for _, w in aligned(n, t))


@pytest.mark.parametrize("arch,tied,dims", [("qwen2", True, DIMS), ("qwen2", False, DIMS), ("qwen3", True, DIMS),
                                            ("qwen2", True, ODD_DIMS), ("qwen3", False, ODD_DIMS)])
def test_stream_bytes_count_what_the_state_dict_and_the_direct_quantization_hold(arch, tied, dims):
    model, config = tiny_module(arch, tied, dims)
    state = model.state_dict()
    shared = state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert shared == tied  # a tied model's state_dict holds the embedding under both names
    s = shape_of(config, arch)
    # verl's stream: every state_dict tensor in fp32, the tied duplicate included
    unaligned = sum(t.numel() * t.element_size() for t in state.values())
    assert bench_int8_sync.stream_bytes(s, "fp32", aligned=False) == unaligned
    assert bench_int8_sync.stream_bytes(s, "fp32") == fp32_wire_bytes(state)
    padded = dims is ODD_DIMS
    assert (bench_int8_sync.stream_bytes(s, "fp32") > unaligned) is padded
    for fmt in ("int8", "int8+bf16", "fp8", "fp8+bf16"):
        assert bench_int8_sync.stream_bytes(s, fmt) == qurl_bytes(state, fmt, tied), fmt
        assert (bench_int8_sync.stream_bytes(s, fmt) > bench_int8_sync.stream_bytes(s, fmt, aligned=False)) is padded
    ratio = bench_int8_sync.stream_bytes(s, "int8+bf16") / bench_int8_sync.stream_bytes(s, "fp32")
    previous = (bench_int8_sync.stream_bytes(s, "int8+bf16", tied_lm_head_sent=False)
                / bench_int8_sync.stream_bytes(s, "fp32", tied_lm_head_sent=False))
    assert (ratio < previous) if tied else ratio == previous


def test_the_bench_streams_the_state_dict_names_and_shapes():
    model, config = tiny_module("qwen2", True)
    s = shape_of(config, "qwen2")
    layer, embed = bench_int8_sync.layer_tensors(s), torch.zeros(s.vocab_size, s.hidden_size)
    streamed = {n: tuple(t.shape) for n, t in bench_int8_sync.model_stream(s, layer, embed, embed)}
    assert streamed == {n: tuple(t.shape) for n, t in model.state_dict().items()}
    counted = sorted(shape for shape, _ in bench_int8_sync.model_tensors(s, "fp32"))
    assert counted == sorted(tuple(t.shape) for t in model.state_dict().values())
    # the engine is told the model ties (the driver's fill from config.json); verl's stream sends the duplicate
    assert bench_int8_sync.engine_kwargs(s, "int8+bf16") == {"quantization": "int8", "rest_dtype": "bfloat16",
                                                            "tie_word_embeddings": True}
    assert bench_int8_sync.engine_kwargs(s, "fp32")["tie_word_embeddings"] is False


@pytest.mark.parametrize("shape", [ModelShape(64, 2, 2, 1, 32, 96, 300, True, True, False, "test"),
                                   ModelShape(36, 2, 2, 1, 6, 50, 301, True, True, False, "odd")],
                         ids=["aligned", "padded"])
def test_one_sync_through_the_engine_carries_the_counted_bytes(shape):
    """``measure`` asserts each payload equals ``stream_bytes`` (padding and shape headers included where the shape
    needs them); the tied duplicate arrives in verl's stream only, left out by the engine from its engine_kwargs."""
    s = shape
    fp32, eight = bench_int8_sync.measure(s, ["fp32", "int8+bf16"], 1, "tiny")
    for row in (fp32, eight):
        assert row["payload_bytes"] == bench_int8_sync.stream_bytes(s, row["format"])
        assert row["baseline_bytes"] == bench_int8_sync.stream_bytes(s, "fp32")
    padded = s.source == "odd"
    assert (eight["payload_bytes"] > bench_int8_sync.stream_bytes(s, "int8+bf16", aligned=False)) is padded
    assert fp32["tied_lm_head_received"] is True and eight["tied_lm_head_received"] is False
    assert set(fp32["dtype_bytes"]) == {"float32"} and set(eight["dtype_bytes"]) == {"int8", "float32", "bfloat16"}
    # what the models were: dtype_bytes counts the tensors before alignment
    assert sum(fp32["dtype_bytes"].values()) == bench_int8_sync.stream_bytes(s, "fp32", aligned=False)
    assert sum(eight["dtype_bytes"].values()) == bench_int8_sync.stream_bytes(s, "int8+bf16", aligned=False)
