"""UAQ on tiny random Llama / Mistral / Qwen2 / Qwen3 and Qwen2-MoE / Qwen3-MoE models: invariance, bookkeeping,
refusals, and its effect on Adam steps."""
from __future__ import annotations

import copy
import re

import pytest
import torch

from qurl_verl.quant import (
    Granularity,
    W8A8Linear,
    apply_uaq,
    matmul,
    parse_scheme,
    quantize_linear_modules_,
    quantizer,
    uaq_record,
    update_visibility,
)
from qurl_verl.quant.uaq import check_uaq_model_type

MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3"]
QKV = ("q_proj", "k_proj", "v_proj")


def logits(model, seed=0, batch=2, length=24):
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits.to(torch.float64)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("targets", [QKV, QKV + ("gate_proj", "up_proj")])
def test_fp32_logits_unchanged_and_only_the_fold_moves(tiny_causal_lm, model_type, targets):
    model = tiny_causal_lm(model_type, attention_bias=True) if model_type == "llama" else tiny_causal_lm(model_type)
    before_logits, before = logits(model), params(model)
    apply_uaq(model, scale=1.5, targets=targets)
    after = params(model)
    ref = before_logits.abs().max()
    torch.testing.assert_close(logits(model), before_logits, rtol=0, atol=2e-6 * ref)

    scaled_norms = {"input_layernorm"} | ({"post_attention_layernorm"} if "gate_proj" in targets else set())
    for name, old in before.items():
        new = after[name]
        parts = name.split(".")
        if name.endswith(".weight") and parts[-2] in scaled_norms:
            assert torch.equal(new, old * 1.5), name
        elif name.endswith(".weight") and parts[-2] in targets:
            assert torch.equal(new, old / 1.5), name
        else:  # biases, o_proj, down_proj, other norms, q_norm/k_norm, embeddings, lm_head
            assert torch.equal(new, old), name
    assert any(n.endswith("q_proj.bias") for n in before) == (model_type in ("llama", "qwen2"))
    assert uaq_record(model.config) == {"scale": 1.5, "targets": list(targets)}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_power_of_two_scale_is_bit_exact(tiny_causal_lm, model_type):
    # Multiplying and dividing by 2 is exact in floating point, so the fold cannot change a single bit.
    model = tiny_causal_lm(model_type)
    before = logits(model)
    apply_uaq(model, scale=2.0, targets=QKV + ("gate_proj", "up_proj"))
    assert torch.equal(logits(model), before)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_bf16_logits_within_bf16_rounding(tiny_causal_lm, model_type):
    fp32 = tiny_causal_lm(model_type)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    ref, base = logits(fp32), logits(bf16)
    bf16_noise = (base - ref).abs().max()
    apply_uaq(bf16, scale=1.5)
    assert bf16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    # UAQ adds one bf16 rounding to a few weights: its effect must stay at the level of bf16's own error.
    assert (logits(bf16) - base).abs().max() <= 2 * bf16_noise


# float32 unit roundoff: one correctly rounded float32 operation has relative error at most U32.
U32 = 2.0**-24


def _grid(fmt):
    """The non-negative values of an 8-bit format, ascending, in float64."""
    if fmt.dtype == torch.int8:
        return torch.arange(0, int(fmt.qmax) + 1, dtype=torch.float64)
    return torch.arange(0, 0x7F, dtype=torch.uint8).view(fmt.dtype).to(torch.float64)  # 0x7F is NaN


def distance_to_rounding_boundary(v, fmt):
    """float64 distance from each pre-rounding code value to the nearest point where round-to-nearest
    switches between two adjacent codes (the midpoints of the format's grid)."""
    grid = _grid(fmt)
    inf = torch.tensor([float("inf")], dtype=torch.float64)
    mids = torch.cat([-inf, (grid[1:] + grid[:-1]) / 2, inf])
    a = v.abs().contiguous()
    i = torch.searchsorted(mids, a, right=True)  # mids[i - 1] <= a < mids[i]
    return torch.minimum(a - mids[i - 1], mids[i] - a)


def code_index(codes):
    """Signed position of each code on its grid: codes one rounding step apart differ by exactly 1."""
    if codes.dtype == torch.int8:
        return codes.to(torch.int64)
    bits = codes.view(torch.uint8).to(torch.int64)  # E4M3: sign bit, then magnitudes in ascending order
    return torch.where(bits >= 128, 128 - bits, bits)


def token_code_values(x, fmt):
    """Exact (float64) pre-rounding values of per-token absmax quantization, x / (absmax / qmax)."""
    x = x.to(torch.float64)
    return x / (x.abs().amax(-1, keepdim=True) / fmt.qmax)


def check_weight_codes_and_undo_flips(fp_model, base_q, uaq_q, scale, folded=QKV):
    """Compare every quantized weight of the UAQ model with the unscaled one; undo near-tie flips.

    Layers outside ``folded`` must be bit-identical. In a folded layer the scale must be the unscaled
    one divided by ``scale`` and each code the same, except where the unscaled weight's exact code value
    sits at a rounding boundary: each side computes it with at most four float32 roundings
    (W/s, absmax/s, /qmax, the division), so a boundary within 8 U32 |v| may fall between them.
    Such codes must differ by one step; they are then set back, so that the forward can be compared.
    Returns (flipped codes, near-tie codes).
    """
    flips = near_total = 0
    for name, uq in uaq_q.named_modules():
        if not isinstance(uq, W8A8Linear):
            continue
        bq = base_q.get_submodule(name)
        same_codes = torch.equal(uq.weight.view(torch.uint8), bq.weight.view(torch.uint8))
        if name.rsplit(".", 1)[-1] not in folded:
            assert same_codes and torch.equal(uq.weight_scale, bq.weight_scale), f"{name} is not folded, yet changed"
            continue
        # fl(fl(absmax/s)/qmax) * s vs fl(absmax/qmax): three float32 roundings apart
        torch.testing.assert_close(uq.weight_scale.double() * scale, bq.weight_scale.double(), rtol=8 * U32, atol=0)
        w = fp_model.get_submodule(name).weight.detach().to(torch.float64)
        v = w / (w.abs().amax(1, keepdim=True) / uq.fmt.qmax)
        near = distance_to_rounding_boundary(v, uq.fmt) <= 8 * U32 * v.abs()
        flipped = uq.weight.view(torch.uint8) != bq.weight.view(torch.uint8)
        assert not (flipped & ~near).any(), f"{name}: codes changed away from any rounding tie"
        assert ((code_index(uq.weight) - code_index(bq.weight))[flipped].abs() == 1).all(), name
        flips += int(flipped.sum())
        near_total += int(near.sum())
        if not same_codes:
            uq.weight.copy_(bq.weight)
    return flips, near_total


class ActivationCodesInLockstep:
    """Records the per-token activation codes of one forward, then checks and undoes flips in a second one.

    With weight flips undone, the UAQ model computes the same function up to float32 rounding: the
    scales of folded layers differ from the unscaled ones by a few ulps, and that drift travels through
    the network. Measured, it stays below 15 U32 x qmax in code units (i.e. relative to the token's
    absmax); DRIFT allows 64. A code may flip only where the base value lies within DRIFT (plus the
    quantizer's own two roundings) of a rounding boundary, by one step, and is then set back to the
    base code, so the following layers see the same codes again.
    """

    DRIFT = 64 * U32

    def __init__(self, monkeypatch):
        self.recorded, self.replaying, self.calls, self.flips = [], False, 0, 0
        real = quantizer.quantize

        def quantize(x, scheme, **kwargs):
            q = real(x, scheme, **kwargs)
            if scheme.granularity is Granularity.TOKEN:
                self._observe(x, q)
            return q

        monkeypatch.setattr(quantizer, "quantize", quantize)  # the fake path (fake_quantize)
        monkeypatch.setattr(matmul, "quantize", quantize)  # the real-codes path (w8a8_linear)

    def _observe(self, x, q):
        v = token_code_values(x, q.fmt)
        if not self.replaying:
            self.recorded.append((v, q.data.clone()))
            return
        base_v, base_codes = self.recorded[self.calls]
        self.calls += 1
        qmax = q.fmt.qmax
        drift = (v - base_v).abs().max().item()
        assert drift <= self.DRIFT * qmax, f"activation {self.calls}: drift {drift / (U32 * qmax):.0f} U32 x qmax"
        flipped = q.data.view(torch.uint8) != base_codes.view(torch.uint8)
        near = distance_to_rounding_boundary(base_v, q.fmt) <= (self.DRIFT + 4 * U32) * qmax
        assert not (flipped & ~near).any(), f"activation {self.calls}: codes changed away from any rounding tie"
        assert ((code_index(q.data) - code_index(base_codes))[flipped].abs() == 1).all()
        self.flips += int(flipped.sum())
        q.data.copy_(base_codes)


@pytest.mark.parametrize("fmt,fake", [("int8", False), ("fp8", True)])
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_quantized_forward_unchanged_at_step_zero(tiny_causal_lm, model_type, fmt, fake, monkeypatch, record_property):
    """Spec §3.4: absmax quantization is scale-equivariant, so UAQ leaves the quantized forward unchanged.

    Exactly so for power-of-two s. For s = 1.5 every W/s, absmax/s and s*x rounds in float32, so a code
    whose exact value sits at a rounding tie, weight or activation, may land on its neighbour; one
    flipped FP8 code moves the logits by far more than rounding does, and shifts every later activation
    enough to flip more codes. The invariant checked instead: only near-tie codes flip, each by one step,
    and with each set back where it happens the forward agrees to float32 rounding.
    """
    model = tiny_causal_lm(model_type)
    fp_logits = logits(model)
    quantized = lambda m: quantize_linear_modules_(copy.deepcopy(m), parse_scheme(fmt, "channel"), fake=fake)  # noqa: E731
    base_q = quantized(model)
    q_base = logits(base_q)
    assert (q_base - fp_logits).abs().max() > 0

    # Multiplying by a power of two is exact in binary floating point (no under/overflow here): every
    # rounding sees the same significands, the codes are identical and the scales exact multiples.
    for power_of_two in (2.0, 0.5):
        assert torch.equal(logits(quantized(apply_uaq(copy.deepcopy(model), scale=power_of_two))), q_base)

    scale = 1.5
    uaq_q = quantized(apply_uaq(copy.deepcopy(model), scale=scale))
    weight_flips, weight_near_ties = check_weight_codes_and_undo_flips(model, base_q, uaq_q, scale)
    n_folded = sum(m.weight.numel() for n, m in uaq_q.named_modules() if n.rsplit(".", 1)[-1] in QKV)
    assert weight_near_ties <= 1e-3 * n_folded  # the tolerance admits ties only, not a share of the weights

    lockstep = ActivationCodesInLockstep(monkeypatch)
    q_base_again = logits(base_q)
    lockstep.replaying = True
    q_uaq = logits(uaq_q)
    assert torch.equal(q_base_again, q_base) and lockstep.calls == len(lockstep.recorded) > 0
    record_property("uaq_flipped_codes", {"weights": weight_flips, "weight_near_ties": weight_near_ties,
                                          "activations": lockstep.flips})
    # Same codes everywhere: what remains is float32 rounding of scales and sums (measured <= 7 U32).
    torch.testing.assert_close(q_uaq, q_base, rtol=0, atol=64 * U32 * q_base.abs().max().item())


def test_refuses_second_application_and_survives_save_pretrained(tiny_causal_lm, tmp_path):
    import transformers

    model = apply_uaq(tiny_causal_lm("qwen2"), scale=1.5)
    with pytest.raises(ValueError, match="already applied"):
        apply_uaq(model, scale=1.5)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert uaq_record(reloaded.config) == {"scale": 1.5, "targets": list(QKV)}
    with pytest.raises(ValueError, match="already applied"):
        apply_uaq(reloaded)


@pytest.mark.parametrize(
    "targets,match",
    [
        (("q_proj",), "must be scaled together"),
        (("q_proj", "k_proj"), "must be scaled together"),
        (QKV + ("gate_proj",), "must be scaled together"),
        (("o_proj",), "fed directly by an RMSNorm"),
        (("down_proj",), "fed directly by an RMSNorm"),
        ((), "at least one"),
    ],
)
def test_rejects_targets_that_break_the_invariance(tiny_causal_lm, targets, match):
    model = tiny_causal_lm("llama")
    before = params(model)
    with pytest.raises(ValueError, match=match):
        apply_uaq(model, targets=targets)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("scale", [0.0, -1.5, float("nan"), float("inf")])
def test_rejects_bad_scales(tiny_causal_lm, scale):
    with pytest.raises(ValueError, match="positive finite"):
        apply_uaq(tiny_causal_lm("llama"), scale=scale)


def test_unknown_architecture_lists_supported_model_types():
    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"gpt2.*llama.*mistral.*qwen2.*qwen3"):
        apply_uaq(model)


def one_adam_step(model, lr):
    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_adam_step_changes_more_quantized_codes_with_uaq(tiny_causal_lm, fmt, record_property):
    """Spec §3.4: under Adam the step on W/s has the same size, its quantization grid is s times finer."""
    scale, lr = 1.5, 1e-4
    base = tiny_causal_lm("qwen2")
    uaq = apply_uaq(copy.deepcopy(base), scale=scale)
    fractions = {}
    for label, model in (("base", base), ("uaq", uaq)):
        before = params(model)
        one_adam_step(model, lr)
        stats = update_visibility(before, params(model), parse_scheme(fmt, "channel"), targets=QKV)
        fractions[label] = stats["overall"]["changed_fraction"]
    assert 0 < fractions["base"] < 0.9 and 0 < fractions["uaq"] < 0.9  # partial changes: the ratio means something
    ratio = fractions["uaq"] / fractions["base"]
    record_property("uaq_changed_code_ratio", ratio)
    print(f"\n{fmt}: changed q/k/v codes after one Adam step (lr={lr}): base {fractions['base']:.4f}, "
          f"UAQ s={scale} {fractions['uaq']:.4f}, ratio {ratio:.3f} (spec: about s)")
    assert ratio > 1.0


# ---------------------------------------------------------------------------------- MoE
MOE_MODEL_TYPES = ["qwen2_moe", "qwen3_moe"]
GATE_UP = ("gate_proj", "up_proj")


MOE_DIMS = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, moe_intermediate_size=64, intermediate_size=256, num_experts=8, num_experts_per_tok=2)


def tiny_moe_lm(model_type, dtype=torch.float32, seed=0):
    """A 2-layer random Qwen2-MoE / Qwen3-MoE (8 experts, top 2); norms and biases randomised as in tiny_causal_lm."""
    from qurl_testkit.tiny_models import build_tiny_causal_lm

    extra = {"shared_expert_intermediate_size": 64} if model_type == "qwen2_moe" else {}
    return build_tiny_causal_lm(model_type, dtype, seed, **MOE_DIMS, **extra)


# The fold rounds each scaled norm weight and q/k/v weight once in float32 (relative error <= U32); through two
# layers of 128-wide sums this moved the logits by at most 10 U32 x max|logit| (measured, both MoE types,
# s in {0.7, 1.3, 1.5, 3}). The router sees the attention output, so a rounding-level change could flip a top-2
# choice at an exact near-tie; that would move the logits by ~1e-3 (see the router test below), not by ulps.
MOE_LOGIT_ATOL = 64 * U32


QKV_FOLD = re.compile(r"layers\.\d+\.(input_layernorm|self_attn\.[qkv]_proj)\.weight$")


def is_folded(name):
    """What UAQ with q/k/v targets may change: input_layernorm and q/k/v weights (not biases), every layer."""
    return QKV_FOLD.search(name) is not None


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_moe_fp32_logits_unchanged_and_only_input_norm_and_qkv_move(model_type):
    scale = 1.5
    model = tiny_moe_lm(model_type)
    # transformers 5 holds the routed experts as fused 3D parameters; the fold must not need per-expert linears
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, torch.nn.Parameter)
    before_logits, before = logits(model), params(model)
    apply_uaq(model, scale=scale)
    after = params(model)
    atol = MOE_LOGIT_ATOL * before_logits.abs().max().item()
    torch.testing.assert_close(logits(model), before_logits, rtol=0, atol=atol)

    changed = {n for n in before if not torch.equal(after[n], before[n])}
    assert changed == {n for n in before if is_folded(n)}
    assert len(changed) == 2 * 4  # per layer: input_layernorm, q_proj, k_proj, v_proj
    for name in changed:
        # float64 product / quotient of float32 values, rounded once to float32: the correctly rounded x s, / s
        exact = before[name].double() * scale if "layernorm" in name else before[name].double() / scale
        assert torch.equal(after[name], exact.float()), name
    untouched = [n for n in before if ".mlp." in n or "post_attention_layernorm" in n or n.endswith("_proj.bias")]
    assert any(n.endswith("mlp.gate.weight") for n in untouched)  # the router
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in untouched)
    assert any("shared_expert" in n for n in untouched) == (model_type == "qwen2_moe")
    assert any(n.endswith("q_proj.bias") for n in untouched) == (model_type == "qwen2_moe")
    assert all(torch.equal(after[n], before[n]) for n in untouched)
    assert uaq_record(model.config) == {"scale": scale, "targets": list(QKV)}


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_moe_power_of_two_scale_is_bit_exact(model_type):
    # Exact in binary floating point: the router sees bit-identical inputs, so even the expert choice cannot move.
    model = tiny_moe_lm(model_type)
    before = logits(model)
    apply_uaq(model, scale=2.0)
    assert torch.equal(logits(model), before)


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_moe_scaling_post_attention_norm_would_move_the_router(model_type):
    """Why gate/up is refused on MoE: the same fold that is exact on a dense MLP, done by hand with the router
    (and Qwen2-MoE's shared-expert gate) left in full precision as it must stay, changes the model."""
    scale = 1.5
    model = tiny_moe_lm(model_type)
    ref = logits(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.mul_(scale)
            layer.mlp.experts.gate_up_proj.div_(scale)
            if model_type == "qwen2_moe":
                layer.mlp.shared_expert.gate_proj.weight.div_(scale)
                layer.mlp.shared_expert.up_proj.weight.div_(scale)
    drift = ((logits(model) - ref).abs().max() / ref.abs().max()).item()
    assert drift > 1000 * MOE_LOGIT_ATOL  # measured ~7e-3, i.e. ~1e5 U32


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
@pytest.mark.parametrize("targets", [QKV + GATE_UP, GATE_UP])
def test_moe_refuses_gate_up_before_touching_weights(model_type, targets):
    model = tiny_moe_lm(model_type)
    before = params(model)
    with pytest.raises(ValueError, match=r"router.*use targets q_proj,k_proj,v_proj"):
        apply_uaq(model, targets=targets)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert uaq_record(model.config) is None
    with pytest.raises(ValueError, match="router"):
        check_uaq_model_type(model_type, targets)


def test_check_uaq_model_type_with_and_without_targets():
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        check_uaq_model_type(model_type)
        check_uaq_model_type(model_type, QKV)
    check_uaq_model_type("qwen3", QKV + GATE_UP)
    with pytest.raises(ValueError, match="must be scaled together"):
        check_uaq_model_type("qwen3_moe", ("q_proj",))
    with pytest.raises(ValueError, match="supported model_types"):
        check_uaq_model_type("phi3", QKV)


@pytest.mark.parametrize(
    "model_type,reason",
    [
        ("mixtral", r"block_sparse_moe.*w1/w2/w3"),
        ("deepseek_v2", r"MLA attention.*not linears fed by input_layernorm"),
        ("deepseek_v3", r"MLA attention.*not linears fed by input_layernorm"),
    ],
)
def test_refused_moe_architectures_say_why(model_type, reason):
    with pytest.raises(ValueError, match=rf"{model_type}.*{reason}"):
        check_uaq_model_type(model_type)
    with pytest.raises(ValueError, match=reason):
        check_uaq_model_type(model_type, QKV)


def test_refuses_a_live_mixtral():
    import transformers

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    before = params(model)
    with pytest.raises(ValueError, match="block_sparse_moe"):
        apply_uaq(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
