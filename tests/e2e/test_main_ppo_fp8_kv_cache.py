"""`+qurl=int8` with the FP8 KV cache (``custom.qurl.kv_cache=fp8``), through verl's own main_ppo on CPU
(harness of test_main_ppo_cpu.py), one FSDP rank and one rollout rank.

* step 1 generates after the first sync, before any actor forward: the engine holds vLLM's default
  scale 1.0 in every layer and says none came from the stream;
* the sync after step 1's update carries the scales of both layers, computed from the actor's
  training forwards: K and V scales below 1 (the tiny model's K and V stay far below 448 / 2), and
  the run shows everything the INT8 demo run shows (``assert_int8_acr_uaq_run``);
* where vLLM-CPU has no FP8 KV cache (CPUs without AVX-512 or AMX) the driver refuses the setting
  before Ray starts, naming the fix, and the run goes on without it, as the INT8 demo.

On the vLLM 0.24 stack this test stands in for the INT8 demo run (one main_ppo run either way). The
two-rank form (two FSDP ranks whose ranges are all-reduced, rollout TP 2 whose ranks must load the
same scales) runs in ``test_main_ppo_topologies.py`` on the 0.32 stack.
"""
from __future__ import annotations

import pytest
import torch
from test_main_ppo_cpu import assert_int8_acr_uaq_run, run_recipe

STEPS = 2
LAYERS = 2  # the tiny model's
FP8_KV = "+actor_rollout_ref.rollout.custom.qurl.kv_cache=fp8"


def fp8_kv_cache_on_this_cpu() -> bool:
    """vLLM-CPU's FP8 KV path: x86 with AVX-512 or AMX (``check_fp8_kv_cache``)."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def assert_kv_scales_streamed(rows: list[dict]) -> None:
    first, later = rows[0], rows[1:]
    assert first["actor/qurl/sync/kv_scale_layers_streamed"] == 0, first
    assert first["actor/qurl/sync/kv_scale_k_max"] == first["actor/qurl/sync/kv_scale_v_min"] == 1.0, first
    for r in later:
        assert r["actor/qurl/sync/kv_scale_layers_streamed"] == LAYERS, r
        for part in ("k", "v"):
            low, high = r[f"actor/qurl/sync/kv_scale_{part}_min"], r[f"actor/qurl/sync/kv_scale_{part}_max"]
            assert 0 < low <= high < 1, (part, low, high)


@pytest.mark.e2e
def test_int8_rollout_with_fp8_kv_cache(tmp_path):
    if not fp8_kv_cache_on_this_cpu():
        refused, rows = run_recipe(tmp_path / "refused", 1, FP8_KV, timeout=300)
        assert refused.returncode != 0 and rows == []
        err = refused.stdout + refused.stderr
        assert "AVX-512 or AMX only" in err and "remove actor_rollout_ref.rollout.custom.qurl.kv_cache" in err
        assert "ray init kwargs" not in err  # before Ray started
        proc, rows = run_recipe(tmp_path, STEPS)
        assert_int8_acr_uaq_run(proc, rows, steps=STEPS)
        return
    proc, rows = run_recipe(tmp_path, STEPS, FP8_KV, timeout=1200)
    assert_int8_acr_uaq_run(proc, rows, steps=STEPS)
    assert_kv_scales_streamed(rows)
