"""The pure-torch GRPO study harness (qurl_recipes.grpo_study) against direct references."""
from __future__ import annotations

import json
import math

import pytest
import torch

from qurl_recipes.grpo_study import (
    VARIANTS,
    StudySettings,
    build_rollout,
    changed_code_shares,
    mismatch_stats,
    quantized_codes,
    response_log_probs,
    run,
    sample,
)
from qurl_recipes.tiny_model import build_tiny_model
from qurl_verl.quant import int_format, quantize


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny_model(tmp_path_factory.mktemp("study") / "model")
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)


def _prompts(tok):
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in ("Start with 3. Apply in order: + 4.", "Start with 12. Apply in order: * 2, - 5, + 1.")]


@pytest.mark.parametrize("variant", ["bf16", "tis"])
def test_behaviour_log_probs_are_the_rollout_policy_s_own(tiny, variant):
    """The log-probs kept from sampling (KV cache, left padding) equal a full forward of the same policy
    on the sampled sequences. Tolerance: float32 summation order for the W{b}A8 copy (measured 5e-7);
    for bf16 the cached and uncached passes round differently: this model's logits stay below 4, where
    a bf16 ulp is 2^-6, and 5e-2 allows about three of them (measured 2e-3)."""
    folder, model, tok = tiny
    policy = build_rollout(model, VARIANTS[variant], weight_bits=5)
    out = sample(policy, tok, _prompts(tok), group_size=3, max_new_tokens=12, seed=0)
    with torch.no_grad():
        direct = response_log_probs(policy, out)
    on = out.response_mask
    tol = 5e-2 if variant == "bf16" else 1e-4
    assert (direct - out.behaviour_log_probs)[on].abs().max() <= tol
    # the mask ends at the first EOS, inclusive, and nothing after it is attended
    eos = out.sequences[:, -on.shape[1]:] == tok.eos_token_id
    for row in range(on.shape[0]):
        hits = eos[row].nonzero()
        length = int(hits[0]) + 1 if len(hits) else on.shape[1]
        assert on[row].tolist() == [True] * length + [False] * (on.shape[1] - length)


def test_quantized_rollout_holds_b_bit_codes_of_the_current_weights(tiny):
    _, model, _ = tiny
    codes = quantized_codes(build_rollout(model, VARIANTS["tis"], weight_bits=5))
    assert codes and all(int(c.abs().max()) <= 15 for c in codes.values())
    name = next(iter(codes))
    direct = quantize(model.get_submodule(name).weight.detach(), int_format(5), "channel").data
    assert torch.equal(codes[name], direct)
    assert not quantized_codes(build_rollout(model, VARIANTS["bf16"], weight_bits=5))


def test_changed_code_shares_count_codes():
    before = {"l.0.q_proj": torch.zeros(4, 4, dtype=torch.int8), "l.0.up_proj": torch.zeros(2, 8, dtype=torch.int8)}
    after = {k: v.clone() for k, v in before.items()}
    after["l.0.q_proj"][0, :3] = 1
    after["l.0.up_proj"][1, :5] = -1
    total, qkv = changed_code_shares(before, after)
    assert total == 8 / 32 and qkv == 3 / 16


def test_mismatch_stats_match_float64_formulas():
    g = torch.Generator().manual_seed(0)
    log_w = 0.7 * torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    got = mismatch_stats(log_w, mask, is_cap=2.0)
    lw = log_w.double()[mask.bool()]
    w = lw.exp()
    # float32 sums of about 40 terms of size O(1): absolute error well below 1e-5
    assert math.isclose(got["kl_k1"], float((-lw).mean()), abs_tol=1e-5)
    assert math.isclose(got["kl_k3"], float((w - 1 - lw).mean()), abs_tol=1e-5)
    assert math.isclose(got["w_max"], float(w.max()), rel_tol=1e-6)
    assert math.isclose(got["w_frac_above_c"], float((w > 2.0).double().mean()), rel_tol=1e-6)  # a float32 count ratio


def test_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="weight"):
        StudySettings(weight_bits=3)
    with pytest.raises(ValueError, match="mini-batches"):
        StudySettings(prompts_per_step=3, group_size=3, mini_batches=2)


def test_run_logs_every_step_and_keeps_a_finished_run(tiny, tmp_path):
    folder, _, _ = tiny
    settings = StudySettings(steps=2, prompts_per_step=2, group_size=2, n_train=4, n_val=2, val_every=1,
                             max_response_tokens=8)
    out = run(folder, "acr_per_group_lr", 1, settings, tmp_path)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # two steps, then the final validation
    assert "changed_code_share" in rows[1] and "val_acc" in rows[2]
    stamp = (out / "metrics.jsonl").stat().st_mtime_ns
    run(folder, "acr_per_group_lr", 1, settings, tmp_path)
    assert (out / "metrics.jsonl").stat().st_mtime_ns == stamp  # same settings: not rerun


@pytest.mark.parametrize("flags, isa", [
    ({"avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}, "amx"),
    ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, "avx512_vnni"),
    ({"avx2", "avx512f"}, "avx512"),
    ({"avx2", "avx_vnni"}, "avx2_vnni"),
    ({"avx2", "fma"}, "avx2"),
])
def test_every_cpu_class_is_named_from_its_flags(flags, isa):
    """Each branch forced, whatever this machine is; the names match the benchmarks' result files."""
    from qurl_verl.platform.cpu_features import cpu_class

    assert cpu_class(flags) == isa


def test_cpu_description_reads_this_machine():
    from qurl_recipes.grpo_study import cpu_description
    from qurl_verl.platform import cpu_features

    d = cpu_description()
    assert d["isa"] in cpu_features.CPU_CLASSES and d["torch_threads"] >= 1
