"""`+qurl=int8` with the FP8 KV cache (``custom.qurl.kv_cache=fp8``), through verl's own main_ppo on CPU
(harness of test_main_ppo_cpu.py), one FSDP rank and one rollout rank.

* step 1 generates after the first sync, before any actor forward: the engine holds vLLM's default
  scale 1.0 in every layer and says none came from the stream;
* the sync after step 1's update carries the scales of both layers, computed from the actor's
  training forwards: K and V scales below 1 (the tiny model's K and V stay far below 448 / 2), and
  the mismatch metrics stay in the range of the INT8 run;
* where vLLM-CPU has no FP8 KV cache (CPUs without AVX-512 or AMX) the driver refuses the setting
  before Ray starts, naming the fix.

The two-rank form (two FSDP ranks whose ranges are all-reduced, rollout TP 2 whose ranks must load
the same scales) runs in ``test_main_ppo_topologies.py``.
"""
from __future__ import annotations

import pytest
import torch
from test_main_ppo_cpu import run_recipe

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
    proc, rows = run_recipe(tmp_path, STEPS, FP8_KV, timeout=1200)
    if not fp8_kv_cache_on_this_cpu():
        assert proc.returncode != 0 and rows == []
        err = proc.stdout + proc.stderr
        assert "AVX-512 or AMX only" in err and "remove actor_rollout_ref.rollout.custom.qurl.kv_cache" in err
        assert "ray init kwargs" not in err  # before Ray started
        return
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert len(rows) == STEPS, rows
    for r in rows:
        assert 0 <= r["actor/qurl/kl_behav_prox_k3"] < 0.05, r
        assert r["actor/qurl/sync/quantized"] > 0 and r["actor/grad_norm"] > 0, r
    assert_kv_scales_streamed(rows)
