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


def test_a_disaggregated_rollouts_reports_read_as_the_colocated_sync_logs_them():
    """Two replicas' reports, carried to the sender by the checkpoint engine: the checksum one key per replica,
    the rest the mean over the reports (verl's reduction of a metric over ranks), under ``actor/qurl/sync/``."""
    from qurl_verl.rollout.sync_stats import post_rollout_report, rollout_report_metrics, take_rollout_report

    reports = [(0, {"checksum": 11, "quantized": 14, "total_s": 1.0}), (1, {"checksum": 12, "quantized": 14, "total_s": 3.0})]
    metrics = rollout_report_metrics(reports)
    assert metrics == {"actor/qurl/sync/checksum/replica_0": 11.0, "actor/qurl/sync/checksum/replica_1": 12.0,
                       "actor/qurl/sync/quantized": 14.0, "actor/qurl/sync/total_s": 2.0}
    assert take_rollout_report() is None
    post_rollout_report(1, reports[0][1])
    post_rollout_report(1, reports[1][1])  # a later sync's report replaces an untaken one
    assert take_rollout_report() == reports[1] and take_rollout_report() is None


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
