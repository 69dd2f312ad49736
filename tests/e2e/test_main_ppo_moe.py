"""A Mixture-of-Experts model through verl's own main_ppo on CPU, with `+qurl=int8`.

The tiny Qwen3-MoE (8 experts, 2 per token, every layer sparse) replaces the tiny recipe's dense model:
verl's FSDP2 actor trains it, streams its experts per expert (``unfuse_moe_params``), and the
``qurl_vllm`` engine runs INT8 attention with full-precision routers and experts, re-built every
step. The harness (deadline, session, leftover processes) is the one of test_main_ppo_cpu.py.
"""
from __future__ import annotations

import pytest
from test_main_ppo_cpu import run_recipe

STEPS = 2
ATTENTION_PROJECTIONS = 2 * 4  # 2 layers x q/k/v/o: all the model runs in 8 bits


@pytest.mark.e2e
def test_int8_rollout_of_a_moe_model(tmp_path):
    from qurl_recipes.tiny_model import build_tiny_moe_model

    build_tiny_moe_model(tmp_path / "model")  # the recipe builds its dense model only where none is
    proc, rows = run_recipe(tmp_path, STEPS, preset="int8", timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert len(rows) == STEPS and f"[summary] steps: {STEPS}" in proc.stdout
    log = proc.stdout + proc.stderr
    assert "[qurl] UAQ (s=1.5, q_proj/k_proj/v_proj) applied" in log  # UAQ on MoE: q/k/v only
    assert "[qurl] MoE rollout in int8:" in log and "routed experts in full precision" in log
    for r in rows:
        assert r["actor/grad_norm"] > 0
        assert r["actor/qurl/sync/quantized"] == ATTENTION_PROJECTIONS
        assert 0 < r["actor/qurl/sync/quantized_frac"] < 0.5  # the experts stay in full precision
        # the engine runs the trainer's model up to the INT8 attention: verl's own comparison of the
        # two policies' token probabilities, and qurl's KL, stay at quantization scale
        assert r["training/rollout_probs_diff_max"] < 0.05, r["training/rollout_probs_diff_max"]
        assert 0 <= r["actor/qurl/kl_behav_prox_k3"] < 0.01
    assert rows[-1]["actor/qurl/update/changed_code_frac"] > 0  # step 2's sync re-quantized new weights
