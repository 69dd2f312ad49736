"""LoRA RL with `+qurl=int8`, through verl's own main_ppo on CPU (harness of test_main_ppo_cpu.py).

* ``lora.merge=true``: verl merges the rank-8 adapters into the weights it syncs; qurl_vllm
  re-quantizes W + BA every step as in full fine-tuning, and the update metrics see the adapters move
  the 8-bit codes.
* unmerged adapters are refused by the driver, before Ray starts, with the setting that fixes it.
"""
from __future__ import annotations

import pytest
from test_main_ppo_cpu import run_recipe

STEPS = 2
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]


@pytest.mark.e2e
def test_merged_lora_is_requantized_every_step(tmp_path):
    proc, rows = run_recipe(tmp_path, STEPS, *LORA, "actor_rollout_ref.model.lora.merge=true", timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert len(rows) == STEPS
    for r in rows:
        assert 0 <= r["actor/qurl/kl_behav_prox_k3"] < 0.05, r
        assert r["actor/qurl/sync/quantized"] == 14 and r["actor/grad_norm"] > 0, r  # 7 projections x 2 layers
    assert 0 < rows[-1]["actor/qurl/update/changed_code_frac"] <= 1  # the trained adapters moved the codes


@pytest.mark.e2e
def test_unmerged_lora_is_refused_in_the_driver(tmp_path):
    proc, rows = run_recipe(tmp_path, 1, *LORA, timeout=300)
    assert proc.returncode != 0 and rows == []
    err = proc.stdout + proc.stderr
    assert "Set actor_rollout_ref.model.lora.merge=true" in err
    assert "ray init kwargs" not in err  # before Ray started
