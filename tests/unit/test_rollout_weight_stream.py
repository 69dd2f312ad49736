"""The trainer -> engine stream: which tensors get quantized, under which names, and that nothing
handed to vLLM aliases the transport buffer verl's receiver reuses for the next bucket."""
from __future__ import annotations

import pytest
import torch

from qurl_verl.quant import INT8_CHANNEL, UpdateVisibilityTracker, quantize, update_visibility
from qurl_verl.rollout.weight_stream import WeightStreamQuantizer
from qurl_verl.settings import RolloutSettings
from qurl_verl.tied_lm_head import TIED_LM_HEAD_NAMES, tied_output_embedding

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def state(tiny_causal_lm):
    model = tiny_causal_lm("qwen2", dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def in_one_buffer(named):
    """verl's BucketedWeightReceiver: every tensor is a view into one shared uint8 buffer."""
    size = sum(t.numel() * t.element_size() for _, t in named)
    buffer = torch.empty(size, dtype=torch.uint8)
    views, offset = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        view = buffer[offset : offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append((name, view))
        offset += n
    return buffer, views


def test_int8_quantizes_exactly_the_decoder_projections(state):
    out = dict(WeightStreamQuantizer(RolloutSettings(format="int8")).transform(state.items()))
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJ:
            q = quantize(t, INT8_CHANNEL)
            assert out[name].dtype == torch.int8 and torch.equal(out[name], q.data)
            assert out[module + ".weight_scale"].dtype == torch.float32
            assert torch.equal(out[module + ".weight_scale"], q.scale) and q.scale.shape == (t.shape[0], 1)
        else:  # embeddings, norms, biases, lm_head: unchanged
            assert torch.equal(out[name], t) and out[name].dtype == t.dtype
    assert not any(k.startswith(("model.embed_tokens.weight_scale", "lm_head.weight_scale")) for k in out)


def test_fp8_block_uses_128_blocks(state):
    out = dict(WeightStreamQuantizer(RolloutSettings(format="fp8_block")).transform(state.items()))
    w = state["model.layers.0.mlp.gate_proj.weight"]
    assert out["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.0.mlp.gate_proj.weight_scale"].shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))


def test_ignored_layers_pass_through(state):
    s = RolloutSettings(format="int8", ignore=("model.layers.1.mlp.down_proj",))
    out = dict(WeightStreamQuantizer(s).transform(state.items()))
    assert out["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32
    assert "model.layers.1.mlp.down_proj.weight_scale" not in out
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_nothing_returned_aliases_the_transport_buffer(state, fmt):
    named = list(state.items())
    buffer, views = in_one_buffer(named)
    out = WeightStreamQuantizer(RolloutSettings(format=fmt)).transform(views)
    buffer.fill_(0xFF)  # the next bucket lands in the same buffer
    expected = dict(WeightStreamQuantizer(RolloutSettings(format=fmt)).transform(named))
    assert len(out) == len(expected)
    for name, t in out:
        assert torch.equal(t, expected[name]), name


def test_bf16_format_quantizes_nothing(state):
    stream = WeightStreamQuantizer(RolloutSettings(format="bf16"))
    out = stream.transform(state.items())
    assert [n for n, _ in out] == list(state) and stream.stats.quantized == 0


def test_already_quantized_weights_pass_unchanged(state):
    """A trainer that quantized on its side sends codes + scales; they are loaded as they are."""
    w = state["model.layers.0.self_attn.q_proj.weight"]
    q = quantize(w, INT8_CHANNEL)
    sent = [("model.layers.0.self_attn.q_proj.weight", q.data), ("model.layers.0.self_attn.q_proj.weight_scale", q.scale)]
    out = dict(WeightStreamQuantizer(RolloutSettings(format="int8")).transform(sent))
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], q.data)
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight_scale"], q.scale)


def test_stats_count_the_stream(state):
    stream = WeightStreamQuantizer(RolloutSettings(format="int8"))
    items = list(state.items())
    stream.transform(items[:10])
    stream.transform(items[10:])
    n_proj = sum(1 for n in state if n.endswith(".weight") and n.removesuffix(".weight").rsplit(".", 1)[-1] in PROJ)
    assert stream.stats.tensors_in == len(state) and stream.stats.quantized == n_proj
    assert stream.stats.bytes_in == sum(t.numel() * t.element_size() for t in state.values())


def test_nan_in_a_targeted_weight_raises_with_its_name(state):
    bad = dict(state)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"].clone()
    bad["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        WeightStreamQuantizer(RolloutSettings(format="int8")).transform(bad.items())


def test_tracker_sees_the_codes_the_engine_gets(state):
    """Two syncs through one stream tracker: the code-change rate is quant's own count on the
    sampled rows, computed without a second quantization."""
    s = RolloutSettings(format="int8")
    tracker = UpdateVisibilityTracker(INT8_CHANNEL, ignore=s.ignore, row_stride=2)
    gen = torch.Generator().manual_seed(0)
    stepped = {k: v + 0.002 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    WeightStreamQuantizer(s, tracker=tracker).transform(state.items())
    assert tracker.end_step()["overall"]["numel"] == 0  # first sighting: nothing to compare
    WeightStreamQuantizer(s, tracker=tracker).transform(stepped.items())
    got = tracker.end_step()["overall"]
    rows = lambda w: {n: t[::2] if t.dim() == 2 else t for n, t in w.items()}  # noqa: E731
    want = update_visibility(rows(state), rows(stepped), INT8_CHANNEL)["overall"]
    assert got["changed_fraction"] == want["changed_fraction"] and 0 < got["changed_fraction"] < 1
    assert got["update_to_error_ratio"] == pytest.approx(want["update_to_error_ratio"], rel=1e-6)


def test_pass_through_tensors_are_sent_in_the_engine_dtype(state):
    """With the engine's parameter dtypes, each pass-through float tensor arrives in its parameter's
    dtype, holding exactly what vLLM's loader would have stored (its ``copy_`` into that parameter
    rounds the same way); 8-bit codes, their fp32 scales and unknown names are left as they are."""
    dtypes = {name: torch.bfloat16 for name in state}
    dtypes.update({n.replace(".weight", ".weight_scale"): torch.bfloat16 for n in state})  # never applies to scales
    del dtypes["model.norm.weight"]
    buffer, views = in_one_buffer(list(state.items()))
    out = dict(WeightStreamQuantizer(RolloutSettings(format="int8"), param_dtypes=dtypes).transform(views))
    buffer.fill_(0xFF)
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJ:
            assert out[name].dtype == torch.int8 and out[module + ".weight_scale"].dtype == torch.float32
        elif name == "model.norm.weight":
            assert out[name].dtype == torch.float32 and torch.equal(out[name], t)
        else:
            engine_param = torch.empty(t.shape, dtype=torch.bfloat16)
            engine_param.copy_(t)
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], engine_param), name


def _engine_layout(tied: bool, lm_head_is_embedding: bool = False) -> torch.nn.Module:
    """The modules ``tied_output_embedding`` reads, as vLLM builds them: 0.24's Qwen2 reuses the
    embedding module as ``lm_head``; 0.32's Qwen2 and Llama give ``lm_head`` the embedding's Parameter."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(8, 4)
    if lm_head_is_embedding:
        model.lm_head = model.model.embed_tokens
    else:
        model.lm_head = torch.nn.Linear(4, 8, bias=False)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("tied,lm_head_is_embedding", [(True, False), (True, True), (False, False)])
def test_the_engine_decides_whether_its_lm_head_is_tied(tied, lm_head_is_embedding):
    model = _engine_layout(tied, lm_head_is_embedding)
    assert tied_output_embedding(model) is (model.lm_head if tied else None)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_lm_head_is_counted_but_never_copied(state, monkeypatch, tied):
    """Tied (``skip``): ``lm_head.weight`` is neither copied nor returned, only counted as received
    and skipped; untied: it is copied like any pass-through tensor. Everything else is unchanged."""
    sent = dict(state)
    sent["lm_head.weight"] = sent["model.embed_tokens.weight"]  # one tensor under both names, as verl sends it
    skip = TIED_LM_HEAD_NAMES if tied else frozenset()
    stream = WeightStreamQuantizer(RolloutSettings(format="int8"), skip=skip)
    copied = []
    original = stream.pass_through
    monkeypatch.setattr(stream, "pass_through", lambda name, t: copied.append(name) or original(name, t))
    out = dict(stream.transform(sent.items()))
    assert ("lm_head.weight" in copied) is not tied and ("lm_head.weight" in out) is not tied
    expected = dict(WeightStreamQuantizer(RolloutSettings(format="int8")).transform(sent.items()))
    if tied:
        del expected["lm_head.weight"]
    assert out.keys() == expected.keys() and all(torch.equal(out[n], t) for n, t in expected.items())
    assert stream.stats.tensors_in == len(sent) and stream.stats.skipped == (1 if tied else 0)
    assert stream.stats.quantized + stream.stats.passed_through + stream.stats.skipped == len(sent)
    assert stream.stats.bytes_in == sum(t.numel() * t.element_size() for t in sent.values())  # as received


@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16"])
def test_the_checksum_tells_two_replicas_apart_exactly_when_their_bits_differ(state, fmt):
    """Two replicas stream the same tensors, in buckets cut differently: same checksum. One code in one
    weight, or one bit in a pass-through tensor, changes it."""
    settings = RolloutSettings(format=fmt)
    items = list(state.items())

    def checksum(named, bucket=4):
        stream = WeightStreamQuantizer(settings)
        for i in range(0, len(named), bucket):
            stream.transform(named[i:i + bucket])
        return stream.stats.checksum

    base = checksum(items)
    assert base == checksum(items, bucket=7) and 0 < base < 2**40
    name = "model.layers.1.self_attn.q_proj.weight"
    w = state[name]
    bumped = w.clone()
    j = w[1].abs().argmax()
    bumped[1, j] = -w[1, j]  # the row's largest element, negated: same scale, one code of another sign
    assert checksum([(n, bumped if n == name else t) for n, t in items]) != base
    norm = "model.norm.weight"
    flipped = state[norm].clone()
    flipped[0] = torch.nextafter(flipped[0], torch.tensor(float("inf")))
    assert checksum([(n, flipped if n == norm else t) for n, t in items]) != base


def test_tensors_loaded_as_is_count_as_a_full_precision_stream_would(state):
    """A LoRA adapter sync (``StreamStats.count_loaded_as_is``: vLLM's add_lora takes the tensors as they
    are) reports what a bf16 stream passing the same tensors through reports: tensors, bytes, elements,
    checksum; nothing quantized."""
    from qurl_verl.rollout.sync_stats import StreamStats

    adapters = [(f"base_model.model.{n.removesuffix('.weight')}.lora_A.weight", t[:8].clone())
                for n, t in state.items() if n.endswith("q_proj.weight")]
    as_is = StreamStats()
    as_is.count_loaded_as_is(adapters)
    passed = WeightStreamQuantizer(RolloutSettings(format="bf16"))
    passed.transform(adapters)
    assert as_is.report() == passed.stats.report() | {"quantize_s": 0.0, "copy_s": 0.0, "code_change_s": 0.0}
    assert as_is.tensors_in == len(adapters) > 0 and as_is.quantized == 0 and as_is.checksum > 0
