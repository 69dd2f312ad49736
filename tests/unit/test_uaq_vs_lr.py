"""UAQ versus per-group AdamW learning rates on a tiny Qwen2 (qurl_recipes.uaq_vs_lr)."""
from __future__ import annotations

import torch

from qurl_recipes.uaq_vs_lr import (
    SCALED_LINEAR_GROUP,
    SCALED_NORM_GROUP,
    UNSCALED_GROUP,
    compare_uaq_with_per_group_lr,
    per_group_lr_param_groups,
)

# With eps -> 0, no weight decay and no clipping, Adam's step m / sqrt(v) is invariant to a
# per-tensor gradient scale; UAQ scales the q/k/v gradients by s and the norm gradients by 1/s,
# so mapped back it equals lr x s on q/k/v and lr / s on the norm. For s = 2 every quantity of
# the UAQ arm (forward, gradients, moments, sqrt, step) is a power-of-two multiple of the other
# arm's, and rounding commutes with that, so the arms agree bit for bit on this CPU. The
# tolerance is about one float32 ulp of an O(1..10) logit, to allow other summation orders.
LOGIT_TOL = 1e-6
SCALE, LR, STEPS = 2.0, 1e-3, 3


def _prompts():
    return torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(1))


def _reward(prompt_ids, response_ids):
    """Fraction of response tokens in the lower half of the vocabulary: varies within a group."""
    return (response_ids < 128).float().mean(1)


def test_param_groups_scale_exactly_qkv_weights_and_input_norms(tiny_causal_lm):
    model = tiny_causal_lm("qwen2")
    groups = per_group_lr_param_groups(model, LR, SCALE)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {SCALED_LINEAR_GROUP, SCALED_NORM_GROUP, UNSCALED_GROUP}
    assert by_name[SCALED_LINEAR_GROUP]["lr"] == LR * SCALE
    assert by_name[SCALED_NORM_GROUP]["lr"] == LR / SCALE
    assert by_name[UNSCALED_GROUP]["lr"] == LR

    name_of = {id(p): n for n, p in model.named_parameters()}
    grouped_ids = [id(p) for g in groups for p in g["params"]]
    assert len(grouped_ids) == len(set(grouped_ids)) == len(name_of)  # none missing, none twice
    names = {key: {name_of[id(p)] for p in g["params"]} for key, g in by_name.items()}
    layers = model.config.num_hidden_layers
    assert names[SCALED_LINEAR_GROUP] == {
        f"model.layers.{i}.self_attn.{p}.weight" for i in range(layers) for p in ("q_proj", "k_proj", "v_proj")
    }
    assert names[SCALED_NORM_GROUP] == {f"model.layers.{i}.input_layernorm.weight" for i in range(layers)}
    # UAQ leaves the q/k/v biases untouched, so they keep the base lr
    assert "model.layers.0.self_attn.q_proj.bias" in names[UNSCALED_GROUP]
    # the optimiser accepts the groups as they are
    torch.optim.AdamW(groups, lr=LR)


def test_uaq_equals_per_group_lr_without_eps_decay_or_clipping(tiny_causal_lm):
    model = tiny_causal_lm("qwen2")
    results = compare_uaq_with_per_group_lr(model, _prompts(), _reward, scale=SCALE, lr=LR, steps=STEPS,
                                            eps=1e-30, weight_decay=0.0, max_grad_norm=None)
    assert len(results) == STEPS
    for r in results:
        assert r.same_tokens
        assert r.max_abs_logit_diff <= LOGIT_TOL, r
        assert r.changed_code_fraction_uaq == r.changed_code_fraction_per_group_lr
    assert results[-1].changed_code_fraction_uaq > 0  # the steps did move the quantized weights


def test_adam_eps_breaks_the_equivalence_for_tiny_gradients(tiny_causal_lm):
    model = tiny_causal_lm("qwen2")
    results = compare_uaq_with_per_group_lr(model, _prompts(), _reward, scale=SCALE, lr=LR, steps=STEPS,
                                            eps=1e-8, weight_decay=0.0, loss_scale=1e-6)
    assert results[0].same_tokens  # same start, same rollout: the difference comes from the update
    assert max(r.max_abs_logit_diff for r in results) > 100 * LOGIT_TOL


def test_matched_weight_decay_keeps_the_arms_equal(tiny_causal_lm):
    """AdamW decays each parameter by lr x decay relative to itself, which UAQ's rescaling keeps;
    the per-group arm therefore matches UAQ when each group's lr x decay equals the base one."""
    model = tiny_causal_lm("qwen2")
    kwargs = dict(scale=SCALE, lr=LR, steps=STEPS, eps=1e-30, weight_decay=0.5, max_grad_norm=None)
    matched = compare_uaq_with_per_group_lr(model, _prompts(), _reward, match_decay=True, **kwargs)
    assert all(r.max_abs_logit_diff <= LOGIT_TOL for r in matched), matched
    unmatched = compare_uaq_with_per_group_lr(model, _prompts(), _reward, match_decay=False, **kwargs)
    assert max(r.max_abs_logit_diff for r in unmatched) > 100 * LOGIT_TOL


def test_param_groups_carry_the_matched_decay(tiny_causal_lm):
    groups = {g["name"]: g for g in per_group_lr_param_groups(tiny_causal_lm("qwen2"), LR, SCALE, weight_decay=0.01)}
    for g in groups.values():  # lr x decay is the same in every group (float64 reference)
        assert abs(g["lr"] * g["weight_decay"] - LR * 0.01) <= 1e-18
    assert groups[SCALED_LINEAR_GROUP]["weight_decay"] < 0.01 < groups[SCALED_NORM_GROUP]["weight_decay"]


def test_clipping_as_uaq_keeps_the_arms_equal_where_plain_clipping_does_not(tiny_causal_lm):
    """Global-norm clipping sees UAQ's s-scaled gradients; clipping the per-group arm by the norm UAQ
    would see restores the equivalence (same tolerance as without clipping: s = 2 is exact)."""
    model = tiny_causal_lm("qwen2")
    kwargs = dict(scale=SCALE, lr=LR, steps=STEPS, eps=1e-30, weight_decay=0.0, max_grad_norm=1e-3)
    as_uaq = compare_uaq_with_per_group_lr(model, _prompts(), _reward, clip_as_uaq=True, **kwargs)
    assert all(r.max_abs_logit_diff <= LOGIT_TOL for r in as_uaq), as_uaq
    plain = compare_uaq_with_per_group_lr(model, _prompts(), _reward, clip_as_uaq=False, **kwargs)
    assert max(r.max_abs_logit_diff for r in plain) > 100 * LOGIT_TOL


def test_uaq_norm_is_the_norm_of_the_scaled_gradients(tiny_causal_lm):
    """The norm clip_grad_norm_as_uaq_ returns equals a float64 norm of the gradients scaled as UAQ scales them."""
    from qurl_recipes.uaq_vs_lr import clip_grad_norm_as_uaq_

    model = tiny_causal_lm("qwen2")
    model(input_ids=_prompts()).logits.square().mean().backward()
    expected = 0.0
    for name, p in model.named_parameters():
        f = SCALE if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) else \
            1 / SCALE if name.endswith("input_layernorm.weight") else 1.0
        expected += float((p.grad.double() * f).square().sum())
    assert abs(clip_grad_norm_as_uaq_(model, 1e9, SCALE) - expected ** 0.5) <= 1e-9 * expected ** 0.5
