"""The pure-torch GRPO study harness (qurl_recipes.grpo_study) against direct references."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import pytest
import torch

from qurl_recipes import grpo_study
from qurl_recipes.grpo_study import (
    CHECKPOINT,
    VARIANTS,
    StudyRun,
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
from qurl_verl.quant import QuantScheme, int_format, quantize


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


def test_behaviour_entropy_is_the_rollout_policy_s_own(tiny):
    """The per-position entropy kept from sampling equals -sum p log p in float64 over a full forward of
    the same W5A8 policy. Tolerance: float32 logits (as for the log-probs above, measured ~1e-6)."""
    folder, model, tok = tiny
    policy = build_rollout(model, VARIANTS["tis"], weight_bits=5)
    out = sample(policy, tok, _prompts(tok), group_size=3, max_new_tokens=12, seed=1)
    length = out.response_mask.shape[1]
    with torch.no_grad():
        logits = policy(input_ids=out.sequences, attention_mask=out.attention_mask,
                        position_ids=(out.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits
    log_p = torch.log_softmax(logits[:, -length - 1:-1].double(), dim=-1)
    reference = -(log_p.exp() * log_p).sum(-1)
    on = out.response_mask
    assert reference[on].min() > 0.01  # a sampled policy that is not already deterministic
    assert (out.behaviour_entropy.double() - reference)[on].abs().max() <= 1e-4


def test_quantized_rollout_holds_b_bit_codes_of_the_current_weights(tiny):
    _, model, _ = tiny
    codes = quantized_codes(build_rollout(model, VARIANTS["tis"], weight_bits=5))
    assert codes and all(int(c.abs().max()) <= 15 for c in codes.values())
    name = next(iter(codes))
    direct = quantize(model.get_submodule(name).weight.detach(), QuantScheme(int_format(5))).data
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


def _rows(folder):
    """metrics.jsonl without the wall-clock fields, the only ones allowed to differ between two runs."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
            for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _interrupt_at(monkeypatch, at_step):
    real = StudyRun.step

    def step(self, step):
        if step == at_step:
            raise KeyboardInterrupt(f"killed at step {step}")
        return real(self, step)

    monkeypatch.setattr(StudyRun, "step", step)


def test_an_interrupted_run_resumes_bit_identical(tiny, tmp_path, monkeypatch, capsys):
    """Killed during step 3 with a checkpoint after step 1: the resumed run drops the logged step 2, redoes
    it and ends where the uninterrupted run ends. A UAQ variant with per-group learning rates carries
    every piece of state: optimizer groups, quantized codes, and (6 questions, 2 per step) a queue
    that is half used at the checkpoint and refilled after it; validation runs before and after it.
    The untrained model never answers right, so a stand-in reward (parity of the text's code points)
    gives nonzero advantages, gradients and thus Adam moments that the resumed steps depend on."""
    folder, _, _ = tiny
    monkeypatch.setattr(grpo_study, "exact_rewards",
                        lambda texts, answers: torch.tensor([float(sum(map(ord, t)) % 2) for t in texts]))
    settings = StudySettings(steps=4, prompts_per_step=2, group_size=2, n_train=6, n_val=2, val_every=2,
                             max_response_tokens=8)
    variant = "acr_per_group_lr_uaq_clip"
    whole = run(folder, variant, 1, settings, tmp_path / "whole", checkpoint_every=2)

    with monkeypatch.context() as m:
        _interrupt_at(m, 3)
        with pytest.raises(KeyboardInterrupt):
            run(folder, variant, 1, settings, tmp_path / "cut", checkpoint_every=2)
    cut = tmp_path / "cut" / variant / "seed1"
    assert (cut / CHECKPOINT).exists() and not (cut / "run.json").exists()
    assert len((cut / "metrics.jsonl.partial").read_text().splitlines()) == 3  # steps 0-2; the checkpoint has 0-1
    capsys.readouterr()
    assert run(folder, variant, 1, settings, tmp_path / "cut", checkpoint_every=2) == cut
    assert "resuming from the checkpoint at step 2" in capsys.readouterr().out

    assert _rows(cut) == _rows(whole)
    assert [r["step"] for r in _rows(cut)] == [0, 1, 2, 3, 4] and "changed_code_share" in _rows(cut)[2]
    assert _rows(cut)[1]["grad_norm_max"] > 0 and _rows(cut)[2]["grad_norm_max"] > 0  # updates on both sides
    final_whole = torch.load(whole / "final_state_dict.pt")
    final_cut = torch.load(cut / "final_state_dict.pt")
    assert final_whole.keys() == final_cut.keys()
    assert all(torch.equal(final_whole[k], final_cut[k]) for k in final_whole)
    assert json.loads((cut / "run.json").read_text())["resumed_at"] == [2]
    assert json.loads((whole / "run.json").read_text())["resumed_at"] == []
    assert not (cut / CHECKPOINT).exists() and not (whole / CHECKPOINT).exists()

    stamp = (cut / "metrics.jsonl").stat().st_mtime_ns
    run(folder, variant, 1, settings, tmp_path / "cut", checkpoint_every=3)  # the interval is not a setting
    assert (cut / "metrics.jsonl").stat().st_mtime_ns == stamp


def test_a_checkpoint_of_other_settings_is_ignored(tiny, tmp_path, monkeypatch, capsys):
    folder, _, _ = tiny
    settings = StudySettings(steps=3, prompts_per_step=2, group_size=2, n_train=4, n_val=2, val_every=5,
                             max_response_tokens=8)
    with monkeypatch.context() as m:
        _interrupt_at(m, 1)
        with pytest.raises(KeyboardInterrupt):
            run(folder, "tis", 1, settings, tmp_path, checkpoint_every=1)
    out = tmp_path / "tis" / "seed1"
    assert torch.load(out / CHECKPOINT, weights_only=True)["next_step"] == 1
    capsys.readouterr()
    run(folder, "tis", 1, replace(settings, steps=2), tmp_path, checkpoint_every=1)
    assert "other settings; starting over" in capsys.readouterr().out
    assert [r["step"] for r in _rows(out)] == [0, 1, 2]
    assert json.loads((out / "run.json").read_text())["resumed_at"] == []
    assert not (out / CHECKPOINT).exists()


def test_checkpoint_interval_is_a_flag_not_a_setting(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(grpo_study, "run", lambda *a, **kw: calls.append((a, kw)))
    threads = torch.get_num_threads()
    try:
        grpo_study.main(["--model", "m", "--out", str(tmp_path), "--variants", "bf16", "--seeds", "1",
                         "--threads", str(threads), "--checkpoint-every", "7", "--steps", "9"])
    finally:
        torch.set_num_threads(threads)
    [(args, kw)] = calls
    assert args[3] == StudySettings(steps=9) and kw == {"checkpoint_every": 7}
    with pytest.raises(ValueError, match="checkpoint_every"):
        run("m", "bf16", 1, StudySettings(), tmp_path, checkpoint_every=-1)


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


def _reference_forward(model, sequences, attention_mask, kv_scales=None):
    """A Qwen2 forward written out, with eager attention over an explicit causal and padding mask; K (after
    RoPE) and V quantize-dequantized with ``kv_scales`` where given. Returns the logits and each layer's K, V."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from qurl_verl.quant.kv_cache import quantize_dequantize_fp8

    inner, cfg = model.model, model.config
    n, length = sequences.shape
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool)  # a left-pad query attends to itself instead of nothing
    hidden = inner.embed_tokens(sequences)
    cos, sin = inner.rotary_emb(hidden, (attention_mask.cumsum(-1) - 1).clamp(min=0))
    kv = []
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q, k, v = (proj(x).view(n, length, -1, head_dim).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if kv_scales is not None:
            k, v = quantize_dequantize_fp8(k, kv_scales.k[i]), quantize_dequantize_fp8(v, kv_scales.v[i])
        kv.append((k, v))
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=head_dim ** -0.5)
        out = out.transpose(1, 2).reshape(n, length, -1)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden)), kv


def _response_log_probs_of(logits, out):
    length = out.response_mask.shape[1]
    log_p = torch.log_softmax(logits[:, -length - 1:-1].float(), dim=-1)
    return log_p.gather(-1, out.sequences[:, -length:, None]).squeeze(-1)


def test_fp8_kv_rollout_quantizes_k_and_v_with_each_layer_s_scales(tiny):
    """The behaviour log-probs of a rollout through the FP8 KV cache (cached decoding, sdpa) equal a written-out
    forward of the same W5A8 policy that quantize-dequantizes K after RoPE and V with each layer's scales,
    and differ from the same policy without the FP8 cache by far more (measured 5e-7 against 1.7e-2). Scales:
    the layers' K/V amax times 2 / 448, then spread apart per layer, so that a scale applied to the wrong
    layer or part shows. The written-out forward attends with torch's sdpa, as the model does: another
    summation order can flip the W5A8 activation rounding of a token (measured 1e-3 with a hand-written
    softmax). Tolerance: float32 summation order, with room for a K or V value that lands on an E4M3
    rounding midpoint in one pass and not in the other."""
    from qurl_recipes.grpo_study import FP8KVCache, KVScales

    folder, model, tok = tiny
    policy = build_rollout(model, VARIANTS["tis_fp8kv"], weight_bits=5)
    plain = sample(policy, tok, _prompts(tok), group_size=3, max_new_tokens=12, seed=0)
    with torch.no_grad():
        _, kv = _reference_forward(policy, plain.sequences, plain.attention_mask)
    amax = torch.tensor([[float(k.abs().max()), float(v.abs().max())] for k, v in kv])
    spread = torch.tensor([[1.0, 0.5], [0.25, 2.0]])[: len(kv)]
    scales = KVScales(k=(amax[:, 0] * spread[:, 0] * 2 / 448), v=(amax[:, 1] * spread[:, 1] * 2 / 448))

    cache = FP8KVCache(scales)
    out = sample(policy, tok, _prompts(tok), group_size=3, max_new_tokens=12, seed=0, kv_cache=cache)
    on = out.response_mask
    with torch.no_grad():
        reference = _response_log_probs_of(_reference_forward(policy, out.sequences, out.attention_mask, scales)[0], out)
        unquantized = response_log_probs(policy, out)
        plain_reference = _response_log_probs_of(_reference_forward(policy, out.sequences, out.attention_mask)[0], out)
    assert (plain_reference - unquantized)[on].abs().max() <= 1e-4  # the written-out forward is the model's
    assert (out.behaviour_log_probs - reference)[on].abs().max() <= 1e-4
    assert (out.behaviour_log_probs - unquantized)[on].abs().max() > 1e-2
    # the largest |K| or |V| against 448 x scale: about 2 where the scale is a quarter of amax x 2 / 448
    assert 1.5 < cache.fill < 2.5


def test_kv_scales_start_at_one_then_follow_the_update_forwards_k_v_ranges(tiny, monkeypatch):
    """Step 0 rolls out with scale 1.0 in every layer (vLLM's default before any scale arrives). After
    it, each layer's K and V scale is amax x 2 / 448 (float64) of that layer's K after RoPE and V over
    the attended tokens of the update forward, computed here by the written-out forward of the fp32
    model before the update (one mini-batch, so the update forward sees exactly those weights).
    The scales travel with the checkpoint."""
    from qurl_recipes.grpo_study import KVScales

    folder, _, _ = tiny
    settings = StudySettings(steps=2, prompts_per_step=2, group_size=2, n_train=4, n_val=2, val_every=5,
                             max_response_tokens=8, mini_batches=1)
    study = StudyRun(folder, "acr_uaq_fp8kv", 1, settings)
    layers = study.model.config.num_hidden_layers
    assert torch.equal(study.kv_scales.k, torch.ones(layers)) and torch.equal(study.kv_scales.v, torch.ones(layers))
    rollouts = []
    real_sample = grpo_study.sample
    monkeypatch.setattr(grpo_study, "sample", lambda *a, **kw: rollouts.append(real_sample(*a, **kw)) or rollouts[-1])
    before = copy.deepcopy(study.model)

    first = study.step(0)
    assert {first[k] for k in ("kv_k_scale_min", "kv_k_scale_max", "kv_v_scale_min", "kv_v_scale_max")} == {1.0}
    assert first["kl_fp8kv_k3"] >= 0 and first["kv_fill_max"] > 0
    out = rollouts[-1]
    with torch.no_grad():
        _, kv = _reference_forward(before, out.sequences, out.attention_mask)
    on = out.attention_mask.bool()[:, None, :, None]
    expected = {part: [float(x[j].double().abs().masked_fill(~on, 0).max()) * 2 / 448 for x in kv]
                for j, part in enumerate("kv")}
    for part, got in (("k", study.kv_scales.k), ("v", study.kv_scales.v)):
        assert all(math.isclose(float(g), e, rel_tol=1e-6) for g, e in zip(got, expected[part], strict=True))
    second = study.step(1)  # rolls out with them, and logs their range
    for part in "kv":
        assert math.isclose(second[f"kv_{part}_scale_min"], min(expected[part]), rel_tol=1e-6)
        assert math.isclose(second[f"kv_{part}_scale_max"], max(expected[part]), rel_tol=1e-6)

    resumed = StudyRun(folder, "acr_uaq_fp8kv", 1, settings)
    resumed.load_state_dict(study.state_dict())
    assert isinstance(resumed.kv_scales, KVScales)
    assert torch.equal(resumed.kv_scales.k, study.kv_scales.k) and torch.equal(resumed.kv_scales.v, study.kv_scales.v)


# --- staleness: the behaviour policy is the rollout copy of older weights ---------------------------------------------


def test_exact_kl_is_the_float64_sum_over_the_vocabulary():
    """Tolerance: float32 log-softmax and summation over a 7-token vocabulary against float64 (1e-6 relative)."""
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(3, 5, 7, generator=g), torch.randn(3, 5, 7, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    got = grpo_study.exact_kl(torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1), mask)
    total = n = 0.0
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                p, q = torch.softmax(p_logits[i, t].double(), -1), torch.softmax(q_logits[i, t].double(), -1)
                total += float((p * (p.log() - q.log())).sum())
                n += 1
    assert got == pytest.approx(total / n, rel=1e-6)
    assert grpo_study.exact_kl(torch.log_softmax(p_logits, -1), torch.log_softmax(p_logits, -1), mask) == 0.0


def test_settings_refuse_negative_staleness():
    with pytest.raises(ValueError, match="staleness"):
        StudySettings(staleness=-1)


def _small(**kw):
    return StudySettings(**{**dict(steps=4, prompts_per_step=2, group_size=2, n_train=4, n_val=2, val_every=5,
                                   max_response_tokens=8), **kw})


@pytest.mark.parametrize("staleness", [0, 2])
def test_the_rollout_holds_the_weights_from_staleness_steps_ago(tiny, staleness):
    """At step t the rollout's weights are the trainer's from step max(0, t - k), recorded here before each
    stand-in update; k = 0 hands out the trainer's own model."""
    folder, _, _ = tiny
    study = StudyRun(folder, "tis", 1, _small(staleness=staleness))
    seen = []
    for step in range(5):
        seen.append({n: t.clone() for n, t in study.model.state_dict().items()})
        weights, age = study.behaviour_weights(step)
        assert age == min(step, staleness)
        expected = seen[max(0, step - staleness)]
        assert (weights is study.model) == (staleness == 0)
        assert all(torch.equal(weights.state_dict()[n], expected[n]) for n in expected)
        with torch.no_grad():  # a stand-in update that changes every weight
            for p in study.model.parameters():
                p.add_(0.01 * (step + 1))


def _direct_kl(p_model, q_model, rollout, mask) -> float:
    """KL(p || q) per response position in float64 from each model's own logits, averaged over the mask."""
    length = mask.shape[1]

    def dist(model):
        am = rollout.attention_mask
        with torch.no_grad():
            logits = model(input_ids=rollout.sequences, attention_mask=am,
                           position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
        return torch.log_softmax(logits[:, -length - 1:-1].double(), -1)

    p, q = dist(p_model), dist(q_model)
    per = (p.exp() * (p - q)).sum(-1)
    return float((per * mask).sum() / mask.sum())


@pytest.mark.parametrize("variant", ["tis", "bf16_tis"])
def test_mismatch_parts_are_the_defined_pairs(tiny, variant):
    """staleness = KL(BF16 copy of the stale weights || BF16 copy of the current ones), quantization =
    KL(rollout policy || BF16 copy of its own weights), total = KL(rollout policy || fp32 current), each
    against a float64 KL of the named pair. Tolerance 1e-3 relative: float32 against float64 log-softmax."""
    folder, _, tok = tiny
    study = StudyRun(folder, variant, 1, _small(staleness=1))
    study.behaviour_weights(0)
    with torch.no_grad():
        for p in study.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    weights, age = study.behaviour_weights(1)
    assert age == 1
    policy = build_rollout(weights, VARIANTS[variant], 5)
    rollout = sample(policy, tok, _prompts(tok), group_size=2, max_new_tokens=10, seed=0)
    mask = rollout.response_mask.float()
    with torch.no_grad():
        prox = grpo_study.response_log_dists(study.model, rollout)
    parts = study.mismatch_parts(weights, policy, rollout, prox, mask, age)
    bf16 = VARIANTS["bf16"]
    stale_bf16, current_bf16 = build_rollout(weights, bf16, 5), build_rollout(study.model, bf16, 5)
    assert parts["kl_staleness"] == pytest.approx(_direct_kl(stale_bf16, current_bf16, rollout, mask), rel=1e-3)
    assert parts["kl_total"] == pytest.approx(_direct_kl(policy, study.model, rollout, mask), rel=1e-3)
    if variant == "bf16_tis":
        assert parts["kl_quantization"] == 0.0
    else:
        assert parts["kl_quantization"] == pytest.approx(_direct_kl(policy, stale_bf16, rollout, mask), rel=1e-3)
        assert parts["kl_quantization"] > 0
    assert parts["kl_staleness"] > 0


def test_a_stale_run_logs_its_staleness_and_resumes_bit_identical(tiny, tmp_path, monkeypatch):
    """Staleness 2 over 4 steps: ages 0, 1, 2, 2; the staleness part 0 at step 0 and above 0 once the rollout's
    weights lag an update that moved them (step 0's update is empty: all its rewards are equal); killed during step 3
    after a checkpoint at step 2, the resumed run (whose rollout needs the weights of step 1, kept in the
    checkpoint) ends where the uninterrupted one ends. lr 1e-3: updates that a BF16 copy still sees."""
    folder, _, _ = tiny
    monkeypatch.setattr(grpo_study, "exact_rewards",
                        lambda texts, answers: torch.tensor([float(sum(map(ord, t)) % 2) for t in texts]))
    settings = _small(staleness=2, lr=1e-3)
    whole = run(folder, "acr_no_uaq", 1, settings, tmp_path / "whole", checkpoint_every=2)
    rows = _rows(whole)[:-1]
    assert [r["staleness"] for r in rows] == [0, 1, 2, 2]
    assert rows[0]["kl_staleness"] == 0 and rows[0]["grad_norm_max"] == 0 < rows[1]["grad_norm_max"]
    assert all(r["kl_staleness"] > 0 for r in rows[2:])
    with monkeypatch.context() as m:
        _interrupt_at(m, 3)
        with pytest.raises(KeyboardInterrupt):
            run(folder, "acr_no_uaq", 1, settings, tmp_path / "cut", checkpoint_every=2)
    cut = run(folder, "acr_no_uaq", 1, settings, tmp_path / "cut", checkpoint_every=2)
    assert _rows(cut) == _rows(whole)


def test_a_run_recorded_before_the_staleness_setting_is_kept(tiny, tmp_path, capsys):
    """A finished run whose run.json predates the setting ran without staleness: the same settings."""
    folder, _, _ = tiny
    settings = _small(steps=1)
    out = run(folder, "bf16", 1, settings, tmp_path)
    summary = json.loads((out / "run.json").read_text())
    del summary["settings"]["staleness"]
    (out / "run.json").write_text(json.dumps(summary))
    capsys.readouterr()
    run(folder, "bf16", 1, settings, tmp_path)
    assert "finished earlier, kept" in capsys.readouterr().out
    run(folder, "bf16", 1, replace(settings, staleness=1), tmp_path)
    assert json.loads((out / "run.json").read_text())["settings"]["staleness"] == 1
