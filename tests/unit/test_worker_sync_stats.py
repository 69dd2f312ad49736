"""The worker's per-sync report: ``SyncStats`` nests the stream's ``StreamStats`` yet reports the flat
dict the trainer has always read (``qurl_last_sync``, ``qurl/sync/*`` metrics)."""
from __future__ import annotations

import logging

import pytest

from qurl_verl.rollout import features
from qurl_verl.rollout.sync_stats import SAME, SLOWEST, SUMMED, StreamStats, SyncStats, all_rules, combine_ranks

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

# SyncStats' keys before it held a StreamStats (asdict of the flat dataclass); the order is not kept
PREVIOUS_KEYS = [
    "sync", "format", "weight_bits", "total_s", "quantize_s", "copy_s", "load_s", "finalize_s", "buckets",
    "tensors_in", "quantized", "skipped", "bytes_in", "quantized_frac", "rss_mb", "code_change_s",
    "changed_code_frac", "update_to_error_ratio", "tracker_resident_bytes", "tracker_row_stride",
    "checksum",  # added with the replicas' agreement check
    "kv_scale_layers_streamed", "kv_scale_k_min", "kv_scale_k_max", "kv_scale_v_min", "kv_scale_v_max",  # FP8 KV cache
    "base_frozen",  # LoRA adapter syncs
    "kv_scale_layers_from_weights",  # the first sync's FP8 KV scales, bounded from the streamed weights
]


def build_stats(**fields) -> SyncStats:
    """A ``SyncStats`` as the worker reports it (every registered feature's stats), the named fields set where
    each lives: the sync's own, or a feature's."""
    stats = SyncStats(**{k: v for k, v in fields.items() if k in SyncStats.__dataclass_fields__})
    for feature in features.registered():
        if feature.stats is not None:
            own = {k: v for k, v in fields.items() if k in feature.stats.__dataclass_fields__}
            stats.features[feature.name] = feature.stats(**own)
    return stats


@pytest.fixture(scope="module")
def sync_stats():
    return build_stats


def test_the_flat_report_keeps_the_previous_keys(sync_stats):
    flat = sync_stats(sync=1, format="int8").as_dict()
    assert sorted(flat) == sorted(PREVIOUS_KEYS)
    assert flat["quantized_frac"] is None  # nothing streamed yet, as before
    unset = {"format", "quantized_frac", "changed_code_frac", "update_to_error_ratio",  # a str, and the Nones
             "kv_scale_k_min", "kv_scale_k_max", "kv_scale_v_min", "kv_scale_v_max"}
    assert sorted(sync_stats(sync=1, format="int8").as_metrics()) == sorted(
        f"qurl/sync/{k}" for k in PREVIOUS_KEYS if k not in unset
    )


def test_the_flat_report_reads_the_stream_it_holds(sync_stats):
    stream = StreamStats()
    stats = sync_stats(sync=2, format="fp8", stream=stream, load_s=0.5, changed_code_frac=0.25)
    stream.tensors_in, stream.quantized, stream.passed_through, stream.skipped = 10, 6, 3, 1
    stream.numel_in, stream.quantized_numel, stream.bytes_in = 400, 300, 1600
    stream.quantize_s, stream.copy_s, stream.code_change_s = 0.125, 0.0625, 0.03125
    flat = stats.as_dict()
    assert sorted(flat) == sorted(PREVIOUS_KEYS)  # passed_through and the element counts stay internal
    assert {k: flat[k] for k in ("tensors_in", "quantized", "skipped", "bytes_in", "quantize_s", "copy_s",
                                 "code_change_s", "quantized_frac", "load_s", "changed_code_frac")} == {
        "tensors_in": 10, "quantized": 6, "skipped": 1, "bytes_in": 1600, "quantize_s": 0.125, "copy_s": 0.0625,
        "code_change_s": 0.03125, "quantized_frac": 0.75, "load_s": 0.5, "changed_code_frac": 0.25,
    }
    metrics = stats.as_metrics()
    assert metrics["qurl/sync/quantize_s"] == 0.125 and metrics["qurl/sync/tensors_in"] == 10.0
    assert metrics["qurl/sync/quantized_frac"] == 0.75 and "qurl/sync/format" not in metrics
    assert "qurl/sync/update_to_error_ratio" not in metrics  # None: left out, as before


def test_every_reported_key_has_a_rule_for_combining_ranks():
    keys = set(build_stats(sync=1, format="int8").as_dict())
    rules = all_rules(features.stats_types())
    assert keys <= set(rules), keys - set(rules)
    timed = {k for k in keys if k.endswith("_s")}
    assert {k for k in keys if rules[k]["ranks"] == SLOWEST} == timed  # seconds, and only seconds, take the slowest
    assert {k for k in keys if rules[k]["ranks"] == SUMMED} == {"rss_mb", "tracker_resident_bytes"}
    assert all(rules[k]["ranks"] == SAME for k in keys - timed - {"rss_mb", "tracker_resident_bytes"})


def rank(load_s: float, rss_mb: float, quantized: int = 14, **kw) -> dict:
    return {**build_stats(sync=3, format="int8", load_s=load_s, total_s=load_s + 1, rss_mb=rss_mb,
                          tracker_resident_bytes=100, **kw).as_dict(), "quantized": quantized}


def test_an_engine_reports_its_slowest_rank_and_the_memory_of_all(caplog):
    with caplog.at_level(logging.WARNING, logger="qurl_verl"):
        both = combine_ranks([rank(0.5, 300.0, changed_code_frac=0.25), None, rank(2.0, 200.0, changed_code_frac=0.25)],
                             features.stats_types())
    assert both["load_s"] == 2.0 and both["total_s"] == 3.0  # the sync ends with its slowest rank
    assert both["rss_mb"] == 500.0 and both["tracker_resident_bytes"] == 200  # host memory of every rank
    assert both["changed_code_frac"] == 0.25 and both["quantized"] == 14 and both["ranks"] == 2
    assert not caplog.records
    assert combine_ranks([None, None]) is None


def test_ranks_that_disagree_on_the_stream_are_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="qurl_verl"):
        combine_ranks([rank(0.5, 1.0, quantized=14), rank(0.5, 1.0, quantized=13)], features.stats_types())
    assert "ranks disagree on quantized" in caplog.text


def test_a_step_that_synced_the_lora_base_then_the_adapters_reports_both():
    """Step 1 of a LoRA adapter run syncs twice: the row adds costs and counts, keeps the base's 8-bit share,
    says the base changed, and its checksum equals one stream's over both syncs' tensors."""
    import torch

    from qurl_verl.rollout.sync_stats import combine_syncs
    from qurl_verl.rollout.weight_stream import WeightStreamQuantizer
    from qurl_verl.settings import RolloutSettings

    base_tensors = [("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8)), ("model.norm.weight", torch.ones(8))]
    adapter_tensors = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.randn(2, 8))]
    base_stream = WeightStreamQuantizer(RolloutSettings(format="int8"))
    base_stream.transform(base_tensors)
    adapters = StreamStats()
    adapters.count_loaded_as_is(adapter_tensors)
    base = build_stats(sync=1, format="int8", stream=base_stream.stats, total_s=2.0, load_s=1.0).as_dict()
    then = build_stats(sync=2, format="int8", stream=adapters, total_s=0.5, load_s=0.5, base_frozen=1).as_dict()
    step = combine_syncs(base, then, features.stats_types())
    assert step["total_s"] == 2.5 and step["load_s"] == 1.5 and step["tensors_in"] == 3 and step["quantized"] == 1
    assert step["bytes_in"] == base["bytes_in"] + then["bytes_in"] and step["base_frozen"] == 0
    assert step["quantized_frac"] == base["quantized_frac"] and step["sync"] == 2
    both = WeightStreamQuantizer(RolloutSettings(format="int8"))
    both.transform(base_tensors)
    both.stats.add_checksum(adapter_tensors)
    assert step["checksum"] == both.stats.checksum


def test_a_disaggregated_rollouts_reports_read_under_the_engines_prefix():
    """Two replicas' reports, carried to the sender by the checkpoint engine: the checksum one key per replica,
    the rest the mean over the reports (verl's reduction of a metric over ranks), under the prefix given
    (``qurl_sync/rollout/``: apart from the names a hybrid engine's colocated sync logs) or, without one, under the
    colocated sync's ``actor/qurl/sync/``; strings and flags are not metrics."""
    from qurl_verl.rollout.sync_stats import post_rollout_report, rollout_report_metrics, take_rollout_report

    reports = [(0, {"checksum": 11, "quantized": 14, "total_s": 1.0, "format": "int8"}),
               (1, {"checksum": 12, "quantized": 14, "total_s": 3.0, "format": "int8"})]
    assert rollout_report_metrics(reports, prefix="qurl_sync/rollout/") == {
        "qurl_sync/rollout/checksum/replica_0": 11.0, "qurl_sync/rollout/checksum/replica_1": 12.0,
        "qurl_sync/rollout/quantized": 14.0, "qurl_sync/rollout/total_s": 2.0}
    assert rollout_report_metrics(reports) == {
        "actor/qurl/sync/checksum/replica_0": 11.0, "actor/qurl/sync/checksum/replica_1": 12.0,
        "actor/qurl/sync/quantized": 14.0, "actor/qurl/sync/total_s": 2.0}
    assert take_rollout_report() is None
    post_rollout_report(1, reports[0][1])
    post_rollout_report(1, reports[1][1])  # a later sync's report replaces an untaken one
    assert take_rollout_report() == reports[1] and take_rollout_report() is None


def reference_checksum(t) -> int:
    """``tensor_checksum`` element by element in Python integers: each bit pattern (a signed integer of the
    element's width; 8-byte elements as two 4-byte words) times hash(i % BLOCK) + hash(BLOCK + i // BLOCK),
    summed without any bound, then reduced once, then the shape."""
    import struct

    import torch

    from qurl_verl.rollout.sync_stats import CHECKSUM_BLOCK, CHECKSUM_MODULUS, CHECKSUM_MULTIPLIER, index_hash

    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    size = t.element_size() if t.element_size() in (1, 2, 4) else 4
    words = struct.unpack(f"<{len(raw) // size}{ {1: 'b', 2: 'h', 4: 'i'}[size] }", raw)
    hashes = index_hash(torch.arange(CHECKSUM_BLOCK + len(words) // CHECKSUM_BLOCK + 1)).tolist()

    def weight(i: int) -> int:
        return hashes[i % CHECKSUM_BLOCK] + hashes[CHECKSUM_BLOCK + i // CHECKSUM_BLOCK]

    checksum = sum(v * weight(i) for i, v in enumerate(words)) % CHECKSUM_MODULUS
    for d in t.shape:
        checksum = (checksum * CHECKSUM_MULTIPLIER + d) % CHECKSUM_MODULUS
    return checksum


def index_hash_reference(i: int) -> int:
    """The index hash in Python integers, from its definition (no int64 to overflow)."""
    from qurl_verl.rollout import sync_stats as s

    mixed = (i * s._INDEX_MIX + s._INDEX_OFFSET) % s._INDEX_PRIME
    mixed = (mixed * mixed + i) % s._INDEX_PRIME
    return mixed % (1 << s._INDEX_HASH_BITS) + 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float64", "int64"])
def test_tensor_checksum_equals_an_element_by_element_python_reference(dtype):
    import torch

    from qurl_verl.rollout.sync_stats import CHECKSUM_BLOCK, CHECKSUM_MODULUS, index_hash, tensor_checksum

    g = torch.Generator().manual_seed(3)
    # one full block and a partial one; the bits span the dtype's whole range (largest magnitudes included)
    bits = torch.randint(-(2**31), 2**31 - 1, (CHECKSUM_BLOCK + 37,), generator=g, dtype=torch.int64)
    t = torch.randn(CHECKSUM_BLOCK + 37, generator=g).to(getattr(torch, dtype)) if "float" in dtype else \
        bits.to(getattr(torch, dtype))
    if dtype == "int64":
        t = bits * (2**32) + bits  # both 4-byte words used
    for shaped in (t, t[: 6 * 7].reshape(6, 7)):
        assert tensor_checksum(shaped) == reference_checksum(shaped) < CHECKSUM_MODULUS
    # the int64 hash agrees with its definition in Python integers, up to the largest index it supports
    for i in (0, 1, CHECKSUM_BLOCK, 12345, 2**40 - 1):
        assert int(index_hash(torch.tensor([i]))[0]) == index_hash_reference(i)


def test_tensor_checksum_sees_where_each_element_sits():
    """A transposed square matrix, permuted or rolled rows, two swapped elements: the sum of bit patterns plus the
    shape (the checksum before) is the same for each; the position-weighted one changes."""
    import torch

    from qurl_verl.rollout.sync_stats import bit_patterns, tensor_checksum

    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    swapped = w.clone().view(-1)
    swapped[[5, 4000]] = swapped[[4000, 5]]
    changed = [w.t().contiguous(), w[torch.randperm(64, generator=torch.Generator().manual_seed(1))],
               w.roll(1, 0), swapped.view(64, 64)]
    for other in changed:
        assert other.shape == w.shape and int(bit_patterns(other).sum()) == int(bit_patterns(w).sum())
        assert tensor_checksum(other) != tensor_checksum(w)
    assert tensor_checksum(w.clone()) == tensor_checksum(w)
    # bucket-independent: a tensor's checksum is its own, whatever arrives beside it
    big = torch.randn(3, 5000, generator=torch.Generator().manual_seed(2))
    assert tensor_checksum(big) == reference_checksum(big)


def test_the_adapter_appends_the_features_tensors_to_either_kind_of_weight_iterator():
    """Colocated syncs hand the adapter a generator, a checkpoint engine's ``receive_weights`` an async one
    (verl's sender then iterates it asynchronously): the features' tensors follow the weights in both."""
    import asyncio

    pytest.importorskip("verl")
    from qurl_verl.rollout.adapter import with_trainer_tensors

    weights = [("a", 1), ("b", 2)]
    extra = [[("k_scale", 3)], []]
    assert list(with_trainer_tensors(iter(weights), extra)) == weights + extra[0]

    async def received():
        for item in weights:
            yield item

    async def drain(it):
        assert hasattr(it, "__aiter__") and not hasattr(it, "__iter__")
        return [item async for item in it]

    assert asyncio.run(drain(with_trainer_tensors(received(), extra))) == weights + extra[0]
