"""bench/bench_delta_sync.py: its sampled rows stand for exactly the model's elements (each tensor type's weight
times the elements run adds up to the count of ``bench_int8_sync.model_tensors``, whose bytes the engine's
payloads are checked against), and
its byte counts are the real encoder's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))  # the script and its modules import each other as when run by path

import bench_delta_sync  # noqa: E402
from roofline_shapes import MODEL_SHAPES  # noqa: E402

from qurl_verl.checkpoint_engine import delta_codec  # noqa: E402


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B"])
@pytest.mark.parametrize("max_elements", [10**6, 10**9])
def test_sampled_tensors_stand_for_the_whole_model(model, max_elements):
    s = MODEL_SHAPES[model]
    tensors = bench_delta_sync.sampled_tensors(s, max_elements, uaq=False)
    n = bench_delta_sync.element_counts(s)
    linear = sum(t.weight * t.rows * t.cols for t in tensors if t.quantized)
    rest = sum(t.weight * t.rows * t.cols for t in tensors if not t.quantized)
    rows = sum(t.weight * t.rows for t in tensors if t.quantized)
    assert linear == pytest.approx(n["linear"], rel=1e-12)
    assert rows == pytest.approx(n["rows"], rel=1e-12)
    assert rest == pytest.approx(n["rest"], rel=1e-12)
    assert all(t.rows * t.cols <= max(max_elements, t.cols) for t in tensors)


def test_uaq_scales_q_k_v_and_the_norm_that_feeds_them_only():
    s = MODEL_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"]
    scaled = {t.name: t.uaq for t in bench_delta_sync.sampled_tensors(s, 10**6, uaq=True) if t.uaq != 1.0}
    assert scaled == {"model.layers.0.input_layernorm.weight": 1.5, "model.layers.0.self_attn.q_proj.weight": 1 / 1.5,
                      "model.layers.0.self_attn.k_proj.weight": 1 / 1.5, "model.layers.0.self_attn.v_proj.weight": 1 / 1.5}


def test_delta_sizes_are_the_encoders():
    g = torch.Generator().manual_seed(0)
    old = torch.randint(-127, 128, (64, 300), generator=g, dtype=torch.int8)
    new = old.clone()
    new.view(-1)[torch.randperm(old.numel(), generator=g)[:40]] += 1
    sizes = bench_delta_sync.delta_sizes(old, new)
    encoded = delta_codec.encode(old, new)
    changed = int((old != new).sum())
    assert sizes["changed"] == changed == encoded.changed and sizes["chosen"] == encoded.nbytes
    assert sizes["int32"] == changed * 5 and sizes["bitmap"] == 64 * 300 // 8 + changed
