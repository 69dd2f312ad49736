"""A sync feature is one file: ``qurl_testkit/toy_sync_feature.py`` adds a tensor to the stream on the trainer's
side, takes it out in the worker and reports a stat with its own merge rule, and a real engine sync runs it
with nothing else in the package told about it.

The toy's tensor has a name no model has, so the sync would fail in vLLM's loader had the feature not
taken it out; its stat is the tensor's sum, which the test computes itself in float64 from what it sent.
"""
from __future__ import annotations

import pytest

from qurl_testkit.reload_harness import TrainerWeights, require_vllm, start_engine, stop_engine, sync_weights
from qurl_verl import versions
from qurl_verl.rollout import features
from qurl_verl.rollout.sync_stats import combine_ranks
from qurl_verl.settings import RolloutSettings

# The feature mechanism is the project's Python, the same on both stacks: one engine start, on the default stack.
ON_DEFAULT_STACK = versions.vllm_release(versions.installed_vllm_version()) != (0, 24)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment"),
              pytest.mark.skipif(not ON_DEFAULT_STACK, reason="the feature mechanism does not depend on vLLM's version")]

EXTENSION = "qurl_testkit.toy_sync_feature.ToyFeatureWorkerExtension"


@pytest.fixture
def toy():
    """The toy feature registered in this process for the test only (its module registers it on import)."""
    from qurl_testkit import toy_sync_feature

    features.register(toy_sync_feature.ToyMarker)
    yield toy_sync_feature
    features.unregister(toy_sync_feature.ToyMarker)


def test_a_feature_from_one_file_runs_through_a_real_engine_sync(toy, tiny_model_dir):
    require_vllm()
    settings = RolloutSettings(format="int8")
    trainer_side = toy.ToyMarker(settings)
    llm = start_engine(tiny_model_dir, settings, dtype="bfloat16", extension=EXTENSION)
    try:
        trainer = TrainerWeights(tiny_model_dir)
        for step in (1, 2):
            added = list(trainer_side.trainer_tensors())
            (stats,) = sync_weights(llm, [*trainer.named_tensors(), *added])
            assert [name for name, _ in added] == [toy.MARKER]
            assert stats["toy_marker_sum"] == float(added[0][1].double().sum())  # what the trainer sent, taken out
            assert stats["toy_syncs_seen"] == step  # the worker's feature kept its state across syncs
            assert stats["quantized"] == 14 and stats["tensors_in"] == sum(1 for _ in trainer.named_tensors())
            trainer.step()
    finally:
        stop_engine(llm)
    # its merge rule reaches the engine's row: summed over ranks, the marker's sum the same on each
    two_ranks = combine_ranks([stats, stats], features.stats_types())
    assert two_ranks["toy_syncs_seen"] == 4 and two_ranks["toy_marker_sum"] == stats["toy_marker_sum"]
