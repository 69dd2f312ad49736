"""LoRA RL with `+qurl=int8`, through verl's own main_ppo on CPU (harness of test_main_ppo_cpu.py).

* adapters (verl's default, ``lora.merge=false``): the base goes to the engine once, quantized by the
  qurl stream at step 1 (that step's row reports both syncs); every later step syncs only the rank-8 adapters, which vLLM's LoRA layers add
  to the INT8 linears' output in full precision. The mismatch metrics work as with full fine-tuning
  (an INT8 base plus the adapters against the trainer's full-precision base plus the same adapters);
  the sync stats say the base is frozen; UAQ, which the preset enables, is skipped with the reason.
* ``lora.merge=true``: verl merges the adapters into the weights it syncs; qurl_vllm re-quantizes
  W + BA every step as in full fine-tuning, and the update metrics see the adapters move the 8-bit codes.
* what adapters cannot carry (the FP8 KV cache's scales) is refused by the driver, before Ray starts,
  with the setting that fixes it.
"""
from __future__ import annotations

import pytest
from test_main_ppo_cpu import run_recipe

STEPS = 2
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
LINEARS = 14  # 7 projections x 2 layers, verl's default target_modules=all-linear


@pytest.mark.e2e
def test_lora_adapters_over_an_int8_base(tmp_path):
    proc, rows = run_recipe(tmp_path, STEPS, *LORA, timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert len(rows) == STEPS
    log = proc.stdout + proc.stderr
    assert "[qurl] UAQ skipped: with LoRA adapters" in log and "UAQ (s=1.5" not in log
    assert "LoRA adapters: the base is quantized once" in log and "INT8 linears run" in log
    for r in rows:
        assert r["actor/grad_norm"] > 0, r
        # INT8 base + adapters against the trainer's base + the same adapters: a small, measured mismatch
        assert 0 < r["actor/qurl/kl_behav_prox_k3"] < 0.05, r
        assert "actor/qurl/update/changed_code_frac" not in r  # the tracker is off: no code ever changes
    # step 1 synced the base (quantized once) and then the adapters, reported as one row
    first = rows[0]
    assert first["actor/qurl/sync/quantized"] == LINEARS and first["actor/qurl/sync/base_frozen"] == 0, first
    assert first["actor/qurl/sync/tensors_in"] > 2 * LINEARS, first
    # every later step synced the adapters only (A and B of every linear), the 8-bit base untouched
    for r in rows[1:]:
        assert r["actor/qurl/sync/base_frozen"] == 1 and r["actor/qurl/sync/quantized"] == 0, r
        assert r["actor/qurl/sync/tensors_in"] == 2 * LINEARS, r


@pytest.mark.e2e
def test_merged_lora_is_requantized_every_step(tmp_path):
    proc, rows = run_recipe(tmp_path, STEPS, *LORA, "actor_rollout_ref.model.lora.merge=true", timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert len(rows) == STEPS
    for r in rows:
        assert 0 <= r["actor/qurl/kl_behav_prox_k3"] < 0.05, r
        assert r["actor/qurl/sync/quantized"] == LINEARS and r["actor/grad_norm"] > 0, r
        assert r["actor/qurl/sync/base_frozen"] == 0, r
    assert 0 < rows[-1]["actor/qurl/update/changed_code_frac"] <= 1  # the trained adapters moved the codes


@pytest.mark.e2e
def test_fp8_kv_cache_with_lora_adapters_is_refused_in_the_driver(tmp_path):
    proc, rows = run_recipe(tmp_path, 1, *LORA, "+actor_rollout_ref.rollout.custom.qurl.kv_cache=fp8", timeout=300)
    assert proc.returncode != 0 and rows == []
    err = proc.stdout + proc.stderr
    assert "kv_cache=fp8 with LoRA adapters" in err and "Set actor_rollout_ref.model.lora.merge=true" in err
    assert "ray init kwargs" not in err  # before Ray started
