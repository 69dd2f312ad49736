"""UAQ on tiny random Llama / Mistral / Qwen2 / Qwen3 models: invariance, bookkeeping, and its effect on Adam steps."""
from __future__ import annotations

import copy

import pytest
import torch

from qurl_verl.quant import apply_uaq, quantize_linear_modules_, uaq_record, update_visibility

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


@pytest.mark.parametrize("fmt,fake", [("int8", False), ("fp8", True)])
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_quantized_forward_unchanged_at_step_zero(tiny_causal_lm, model_type, fmt, fake):
    model = tiny_causal_lm(model_type)
    fp_logits = logits(model)
    quantized = lambda m: quantize_linear_modules_(copy.deepcopy(m), fmt, "channel", fake=fake)  # noqa: E731
    q_base = logits(quantized(model))
    quant_effect = (q_base - fp_logits).abs().max()
    assert quant_effect > 0

    exact = apply_uaq(copy.deepcopy(model), scale=2.0)
    assert torch.equal(logits(quantized(exact)), q_base)

    # s = 1.5 is not a power of two: W/s, absmax/s and s*x each round once in float32, so a code can
    # flip where a value sits within an ulp of a rounding tie. The change must be far below what
    # quantization itself does to the logits.
    uaq = apply_uaq(copy.deepcopy(model), scale=1.5)
    assert (logits(quantized(uaq)) - q_base).abs().max() <= 1e-3 * quant_effect


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
        stats = update_visibility(before, params(model), fmt, "channel", targets=QKV)
        fractions[label] = stats["overall"]["changed_fraction"]
    assert 0 < fractions["base"] < 0.9 and 0 < fractions["uaq"] < 0.9  # partial changes: the ratio means something
    ratio = fractions["uaq"] / fractions["base"]
    record_property("uaq_changed_code_ratio", ratio)
    print(f"\n{fmt}: changed q/k/v codes after one Adam step (lr={lr}): base {fractions['base']:.4f}, "
          f"UAQ s={scale} {fractions['uaq']:.4f}, ratio {ratio:.3f} (spec: about s)")
    assert ratio > 1.0
