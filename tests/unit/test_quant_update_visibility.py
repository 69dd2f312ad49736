"""Update visibility (changed codes, update-to-quantization-error ratio) against float64 recomputation."""
from __future__ import annotations

import math

import pytest
import torch

from qurl_verl.quant import (
    FP8_CHANNEL,
    INT8_CHANNEL,
    UpdateVisibilityTracker,
    parse_scheme,
    quantize,
    tensor_update_stats,
    update_visibility,
)


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
    stats = tensor_update_stats(prev, new, INT8_CHANNEL).as_dict()
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
        s = tensor_update_stats(w, w.clone(), parse_scheme(fmt, "channel")).as_dict()
        assert s["changed_fraction"] == 0 and s["update_norm"] == 0 and s["update_to_error_ratio"] == 0
        assert s["quant_error_norm"] > 0


def test_fp8_signed_zeros_are_not_changes():
    prev = torch.zeros(2, 8)
    prev[:, 0] = 0.1
    new = prev.clone()
    prev[:, 1], new[:, 1] = -1e-9, 1e-9  # both round to zero, with opposite signs
    qp, qn = quantize(prev, FP8_CHANNEL), quantize(new, FP8_CHANNEL)
    assert (qp.data.view(torch.uint8)[:, 1] != qn.data.view(torch.uint8)[:, 1]).all()
    assert tensor_update_stats(prev, new, FP8_CHANNEL).changed_codes == 0
    new[:, 2] = 0.05  # a real change
    assert tensor_update_stats(prev, new, FP8_CHANNEL).changed_codes == 2


@pytest.mark.parametrize("fmt,granularity", [("int8", "channel"), ("fp8", "channel"), ("fp8", "block")])
def test_aggregates_pool_counts_and_squared_norms(fmt, granularity):
    prev = weights()
    new = adam_like_step(prev, 1e-4)
    report = update_visibility(prev, new, parse_scheme(fmt, granularity))
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
    tracker = UpdateVisibilityTracker(INT8_CHANNEL)
    for name, w in steps[0].items():
        assert tracker.observe(name, w) is None
    assert tracker.end_step()["overall"]["numel"] == 0
    for prev, new in zip(steps, steps[1:]):
        for name, w in new.items():
            q = quantize(w, INT8_CHANNEL) if "q_proj" in name else None  # reuse a quantization already done
            tracker.observe(name, w, quantized=q)
        got = tracker.end_step()
        assert got.pop("tracker")["row_stride"] == 1
        assert got == update_visibility(prev, new, INT8_CHANNEL)


@pytest.mark.parametrize("granularity,block_size", [("channel", 128), ("block", 16)])
@pytest.mark.parametrize("pass_quantized", [False, True])
def test_row_sampling_equals_statistics_of_the_sampled_rows(granularity, block_size, pass_quantized):
    prev = weights()
    new = adam_like_step(prev, 1e-4)
    stride = 3
    tracker = UpdateVisibilityTracker(parse_scheme("fp8", granularity, block_size), row_stride=stride)
    for sd in (prev, new):
        for name, w in sd.items():
            q = quantize(w, parse_scheme("fp8", granularity, block_size)) if pass_quantized and w.dim() == 2 else None
            tracker.observe(name, w, quantized=q)
    got = tracker.end_step()
    assert got.pop("tracker")["row_stride"] == stride

    def rows(w):  # written out independently: whole bands of block_size rows, every stride-th band
        if w.dim() != 2:
            return w
        keep = [r for r in range(w.shape[0]) if (r if granularity == "channel" else r // block_size) % stride == 0]
        return w[keep]

    expected = update_visibility({k: rows(v) for k, v in prev.items()}, {k: rows(v) for k, v in new.items()}, parse_scheme("fp8", granularity, block_size))
    assert got == expected
    full = update_visibility(prev, new, parse_scheme("fp8", granularity, block_size))["overall"]["numel"]
    assert got["overall"]["numel"] < full / 2


# ---------------------------------------------------------------- the tracker's memory: where, how much, bounded


def held_tensors(tracker):
    """Every tensor reachable from the tracker's attributes (containers and qurl_verl objects walked)."""
    found, seen = [], set()

    def visit(o):
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif id(o) not in seen:
            seen.add(id(o))
            if isinstance(o, dict):
                for v in o.values():
                    visit(v)
            elif isinstance(o, (list, tuple, set)):
                for v in o:
                    visit(v)
            elif type(o).__module__.startswith("qurl_verl") and hasattr(o, "__dict__"):
                visit(vars(o))

    visit(vars(tracker))
    return found


def kept_rows(n, stride, granularity, block_size):
    """Rows a stride keeps, written out: every stride-th row, or every stride-th band of block_size rows."""
    return [r for r in range(n) if (r if granularity == "channel" else r // block_size) % stride == 0]


def expected_bytes(sd, stride, granularity="channel", block_size=128):
    """Sampled rows in their stored dtype (fp32/bf16/fp16 as received, float64 as fp32) + 1-byte codes."""
    stored = {torch.float64: 4, torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
    return sum(len(kept_rows(w.shape[0], stride, granularity, block_size)) * w.shape[1] * (stored[w.dtype] + 1)
               for k, w in sd.items() if k.endswith("proj.weight"))


def uneven_weights(seed=0, dtype=torch.float32):
    """Projections whose row counts are not multiples of the strides or of the block size."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (72, 40), "self_attn.k_proj": (24, 40),
              "mlp.up_proj": (100, 40), "mlp.down_proj": (40, 100)}
    return {f"model.layers.{i}.{m}.weight": (torch.randn(*s, generator=g) * 0.02).to(dtype)
            for i in range(3) for m, s in shapes.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_state_is_compact_cpu_memory_that_outlives_the_transport_buffer(dtype):
    """Weights arrive as views into one reused buffer (verl's receiver); the tracker keeps its own
    compact CPU copies, exact in the received dtype, and resident_bytes counts them exactly."""
    prev, new = weights(), adam_like_step(weights(), 1e-4)
    prev, new = ({k: v.to(dtype) for k, v in sd.items()} for sd in (prev, new))
    buffer = torch.empty(sum(v.numel() for v in prev.values()) + 7, dtype=dtype)
    tracker = UpdateVisibilityTracker(INT8_CHANNEL, row_stride=3)
    for sd in (prev, new):
        offset = 7  # views at an offset, as in a bucket
        for name, w in sd.items():
            view = buffer[offset: offset + w.numel()].view(w.shape)
            view.copy_(w)
            offset += w.numel()
            tracker.observe(name, view)
        buffer.fill_(float("nan"))  # the next bucket overwrites the buffer
        got = tracker.end_step()
    assert got.pop("tracker") == {"row_stride": 3, "requested_row_stride": 3, "resident_bytes": expected_bytes(new, 3),
                                  "tracked_tensors": 4, "untracked_tensors": 0}
    assert got == update_visibility({k: v[::3] for k, v in prev.items()}, {k: v[::3] for k, v in new.items()})
    held = held_tensors(tracker)
    assert len(held) == 2 * 4  # sampled rows and codes per projection, nothing else
    for t in held:
        assert t.device.type == "cpu" and t.is_contiguous()
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # its own storage, no view of a larger one
        assert not (buffer.data_ptr() <= t.data_ptr() < buffer.data_ptr() + buffer.numel() * buffer.element_size())
        assert t.dtype in (torch.int8, torch.float32 if dtype == torch.float64 else dtype)
    assert tracker.resident_bytes() == sum(t.untyped_storage().nbytes() for t in held) == expected_bytes(new, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_state_stays_on_cpu_when_weights_arrive_on_the_gpu():
    prev, new = weights(), adam_like_step(weights(), 1e-4)
    on_gpu, on_cpu = (UpdateVisibilityTracker(INT8_CHANNEL, row_stride=2) for _ in range(2))
    for sd in (prev, new):
        for name, w in sd.items():
            on_gpu.observe(name, w.cuda(), quantize(w.cuda(), INT8_CHANNEL) if w.dim() == 2 else None)
            on_cpu.observe(name, w)
    got, want = on_gpu.end_step(), on_cpu.end_step()
    assert {t.device.type for t in held_tensors(on_gpu)} == {"cpu"}
    # Same codes, unless the two devices round a handful of ties differently.
    assert got["overall"]["changed_fraction"] == pytest.approx(want["overall"]["changed_fraction"], abs=1e-3)
    # ||dW|| comes from the same CPU copies on both sides; ||E|| differs by float32 reduction order.
    assert got["overall"]["update_to_error_ratio"] == pytest.approx(want["overall"]["update_to_error_ratio"], rel=1e-5)


def direct_stats(prev, new, stride, fmt, granularity, block_size):
    """Quantize both whole weights, compare codes on the sampled rows; norms in float64."""
    changed = numel = 0
    update_sq = error_sq = 0.0
    for name, p in prev.items():
        if not name.endswith("proj.weight"):
            continue
        qp, qn = (quantize(w, parse_scheme(fmt, granularity, block_size)) for w in (p, new[name]))
        keep = kept_rows(p.shape[0], stride, granularity, block_size)
        cp, cn = qp.data[keep].view(torch.uint8), qn.data[keep].view(torch.uint8)
        signed_zero = ((cp | cn) & 0x7F) == 0 if fmt == "fp8" else torch.zeros_like(cp, dtype=torch.bool)
        changed += int(((cp != cn) & ~signed_zero).sum())
        numel += cp.numel()
        p64, n64 = p.double()[keep], new[name].double()[keep]
        deq64 = qp.data.double()[keep] * qp.expanded_scale(torch.float64)[keep]
        update_sq += float(((n64 - p64) ** 2).sum())
        error_sq += float(((deq64 - p64) ** 2).sum())
    return changed, numel, math.sqrt(update_sq), math.sqrt(error_sq)


@pytest.mark.parametrize("fmt,granularity,block_size", [("int8", "channel", 128), ("fp8", "block", 16)])
def test_cap_picks_the_smallest_fitting_stride_never_exceeds_it_and_keeps_stats_exact(fmt, granularity, block_size):
    prev = uneven_weights()
    new = adam_like_step(prev, 1e-4)
    requested = 2
    strides = [requested * 2**k for k in range(8)]
    # A cap between the bytes at stride 8 and at stride 4: the first tensors are taken at 2 and
    # thinned twice as the rest arrive.
    cap = (expected_bytes(prev, 8, granularity, block_size) + expected_bytes(prev, 4, granularity, block_size)) // 2
    want_stride = next(s for s in strides if expected_bytes(prev, s, granularity, block_size) <= cap)
    assert want_stride == 8
    tracker = UpdateVisibilityTracker(parse_scheme(fmt, granularity, block_size), row_stride=requested, max_resident_bytes=cap)
    seen_strides = set()
    for sd in (prev, new):
        for name, w in sd.items():
            tracker.observe(name, w)
            assert tracker.resident_bytes() <= cap
            seen_strides.add(tracker.effective_row_stride)
        got = tracker.end_step()
    assert min(seen_strides) == 2 and max(seen_strides) == 8
    info = got.pop("tracker")
    assert info["row_stride"] == tracker.effective_row_stride == want_stride and info["requested_row_stride"] == 2
    want_bytes = expected_bytes(new, want_stride, granularity, block_size)
    assert info["resident_bytes"] == tracker.resident_bytes() == want_bytes
    assert info["tracked_tensors"] == 12 and info["untracked_tensors"] == 0

    changed, numel, update, error = direct_stats(prev, new, want_stride, fmt, granularity, block_size)
    overall = got["overall"]
    assert 0 < changed < numel
    assert overall["numel"] == numel and overall["changed_fraction"] == changed / numel
    # float32 differences are exact or within 2^-24 relative, and float32 accumulation of ~1e4
    # squares is good to ~1e-6. float32 dequantization rounds each element by <= 2^-24 * 127 * scale
    # (int8) against an RMS quantization error of ~scale / sqrt(12): ||E|| within ~3e-5 relative
    # (fp8's error is far larger than its rounding).
    assert overall["update_norm"] == pytest.approx(update, rel=1e-5)
    assert overall["quant_error_norm"] == pytest.approx(error, rel=1e-4)
    assert overall["update_to_error_ratio"] == pytest.approx(update / error, rel=1e-4)


def test_the_stride_rises_for_a_wider_dtype_and_untracked_tensors_are_counted():
    bf16 = uneven_weights(dtype=torch.bfloat16)
    fp32 = {k: v.float() + 1e-4 for k, v in bf16.items()}
    cap = expected_bytes(bf16, 1)  # all of bf16 at stride 1, not of fp32
    tracker = UpdateVisibilityTracker(INT8_CHANNEL, max_resident_bytes=cap)
    for sd in (bf16, fp32):
        for name, w in sd.items():
            tracker.observe(name, w)
            assert tracker.resident_bytes() <= cap
        got = tracker.end_step()
    assert tracker.effective_row_stride == 2 and got["tracker"]["resident_bytes"] == expected_bytes(fp32, 2)
    assert len(got["per_tensor"]) == 12  # compared at stride 1 before the rise, at 2 after

    one_row = 100 * 5  # the widest row of the down projections, fp32 + codes
    small = UpdateVisibilityTracker(INT8_CHANNEL, max_resident_bytes=one_row + 40 * 5)
    for sd in (fp32, adam_like_step(fp32, 1e-4)):
        for name, w in sd.items():
            small.observe(name, w)
            assert small.resident_bytes() <= one_row + 40 * 5
        got = small.end_step()
    info = got["tracker"]
    assert info["tracked_tensors"] + info["untracked_tensors"] == 12 and info["untracked_tensors"] > 0
    assert len(got["per_tensor"]) == info["tracked_tensors"] and got["overall"]["numel"] > 0


def test_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_resident_bytes"):
        UpdateVisibilityTracker(max_resident_bytes=0)
