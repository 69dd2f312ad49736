"""Update visibility (changed codes, update-to-quantization-error ratio) against float64 recomputation."""
from __future__ import annotations

import math

import pytest
import torch

from qurl_verl.quant import UpdateVisibilityTracker, quantize, tensor_update_stats, update_visibility


def weights(seed=0, layers=2):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(layers):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(64, 96, generator=g) * 0.02
        sd[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(96, 160, generator=g) * 0.02
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(96)
    sd["lm_head.weight"] = torch.randn(32, 96, generator=g) * 0.02
    return sd


def adam_like_step(sd, lr, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + lr * torch.sign(torch.randn(v.shape, generator=g)) for k, v in sd.items()}


def ref_int8_codes(w64):
    scale = w64.abs().amax(1, keepdim=True) / 127
    return torch.round(w64 / scale).clamp(-127, 127), scale


def test_int8_stats_match_float64_recomputation():
    prev = weights()["model.layers.0.mlp.down_proj.weight"]
    new = adam_like_step({"w": prev}, 2e-4)["w"]
    stats = tensor_update_stats(prev, new, "int8", "channel").as_dict()
    p64, n64 = prev.double(), new.double()
    (cp, sp), (cn, _) = ref_int8_codes(p64), ref_int8_codes(n64)
    changed_ref = (cp != cn).double().mean().item()
    update_ref = (n64 - p64).norm().item()
    error_ref = (cp * sp - p64).norm().item()
    assert 0.05 < changed_ref < 0.95
    assert stats["changed_fraction"] == pytest.approx(changed_ref, abs=1e-3)
    assert stats["update_norm"] == pytest.approx(update_ref, rel=2e-5)  # float32 reductions
    assert stats["quant_error_norm"] == pytest.approx(error_ref, rel=1e-4)
    assert stats["update_to_error_ratio"] == pytest.approx(update_ref / error_ref, rel=1e-4)
    assert stats["numel"] == prev.numel()


def test_no_update_means_nothing_changed():
    w = weights()["model.layers.0.self_attn.q_proj.weight"]
    for fmt in ("int8", "fp8"):
        s = tensor_update_stats(w, w.clone(), fmt, "channel").as_dict()
        assert s["changed_fraction"] == 0 and s["update_norm"] == 0 and s["update_to_error_ratio"] == 0
        assert s["quant_error_norm"] > 0


def test_fp8_signed_zeros_are_not_changes():
    prev = torch.zeros(2, 8)
    prev[:, 0] = 0.1
    new = prev.clone()
    prev[:, 1], new[:, 1] = -1e-9, 1e-9  # both round to zero, with opposite signs
    qp, qn = quantize(prev, "fp8", "channel"), quantize(new, "fp8", "channel")
    assert (qp.data.view(torch.uint8)[:, 1] != qn.data.view(torch.uint8)[:, 1]).all()
    assert tensor_update_stats(prev, new, "fp8", "channel").changed_codes == 0
    new[:, 2] = 0.05  # a real change
    assert tensor_update_stats(prev, new, "fp8", "channel").changed_codes == 2


@pytest.mark.parametrize("fmt,granularity", [("int8", "channel"), ("fp8", "channel"), ("fp8", "block")])
def test_aggregates_pool_counts_and_squared_norms(fmt, granularity):
    prev = weights()
    new = adam_like_step(prev, 1e-4)
    report = update_visibility(prev, new, fmt, granularity)
    per = report["per_tensor"]
    assert set(per) == {k for k in prev if k.endswith("proj.weight")}  # norms and lm_head skipped
    changed = sum(v["changed_fraction"] * v["numel"] for v in per.values())
    numel = sum(v["numel"] for v in per.values())
    upd = math.sqrt(sum(v["update_norm"] ** 2 for v in per.values()))
    err = math.sqrt(sum(v["quant_error_norm"] ** 2 for v in per.values()))
    overall = report["overall"]
    assert overall["numel"] == numel
    assert overall["changed_fraction"] == pytest.approx(changed / numel, rel=1e-12)
    assert overall["update_to_error_ratio"] == pytest.approx(upd / err, rel=1e-12)
    assert set(report["by_projection"]) == {"q_proj", "down_proj"}
    q = [v for k, v in per.items() if "q_proj" in k]
    assert report["by_projection"]["q_proj"]["numel"] == sum(v["numel"] for v in q)


def test_streams_and_mappings_agree_and_order_is_checked():
    prev, new = weights(), adam_like_step(weights(), 1e-4)
    from_maps = update_visibility(prev, new)
    from_streams = update_visibility(iter(prev.items()), iter(new.items()))
    assert from_streams == from_maps
    shuffled = list(new.items())[::-1]
    with pytest.raises(ValueError, match="out of order"):
        update_visibility(iter(prev.items()), iter(shuffled))


def test_tracker_reports_step_to_step_changes():
    steps = [weights()]
    steps.append(adam_like_step(steps[0], 1e-4, seed=2))
    steps.append(adam_like_step(steps[1], 3e-4, seed=3))
    tracker = UpdateVisibilityTracker("int8", "channel")
    for name, w in steps[0].items():
        assert tracker.observe(name, w) is None
    assert tracker.end_step()["overall"]["numel"] == 0
    for prev, new in zip(steps, steps[1:]):
        for name, w in new.items():
            q = quantize(w, "int8", "channel") if "q_proj" in name else None  # reuse a quantization already done
            tracker.observe(name, w, quantized=q)
        assert tracker.end_step() == update_visibility(prev, new, "int8", "channel")


@pytest.mark.parametrize("granularity,block_size", [("channel", 128), ("block", 16)])
@pytest.mark.parametrize("pass_quantized", [False, True])
def test_row_sampling_equals_statistics_of_the_sampled_rows(granularity, block_size, pass_quantized):
    prev = weights()
    new = adam_like_step(prev, 1e-4)
    stride = 3
    tracker = UpdateVisibilityTracker("fp8", granularity, block_size=block_size, row_stride=stride)
    for sd in (prev, new):
        for name, w in sd.items():
            q = quantize(w, "fp8", granularity, block_size=block_size) if pass_quantized and w.dim() == 2 else None
            tracker.observe(name, w, quantized=q)
    got = tracker.end_step()

    def rows(w):  # written out independently: whole bands of block_size rows, every stride-th band
        if w.dim() != 2:
            return w
        keep = [r for r in range(w.shape[0]) if (r if granularity == "channel" else r // block_size) % stride == 0]
        return w[keep]

    expected = update_visibility({k: rows(v) for k, v in prev.items()}, {k: rows(v) for k, v in new.items()},
                                 "fp8", granularity, block_size=block_size)
    assert got == expected
    full = update_visibility(prev, new, "fp8", granularity, block_size=block_size)["overall"]["numel"]
    assert got["overall"]["numel"] < full / 2
