"""A sync that fails mid-reload poisons its engine: the next step refuses even when the step would replay a
captured graph, which never calls the model's forward (and so never runs a forward pre-hook). The stand-in runner
below steps the way a graph replay does: the model's weights through ``torch.nn.functional``, no module call.
The real engine's refusal (vLLM ending the engine core) is ``test_qurl_vllm_reload.test_failed_sync_is_fatal_and_loud``."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.both_stacks  # the worker extension subclasses verl's, which imports vLLM

worker_extension = pytest.importorskip("qurl_verl.rollout.worker_extension", reason="needs verl and vLLM")


class ReplayingRunner:
    """A model runner whose step reads the weights without calling the model (as a CUDA graph replay does)."""

    def __init__(self, model: torch.nn.Linear):
        self.model = model

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return torch.nn.functional.linear(scheduler_output, self.model.weight, self.model.bias)


def poisoned_worker():
    model = torch.nn.Linear(4, 3)
    worker = object.__new__(worker_extension.QurlWorkerExtension)
    worker._qurl_broken = None
    worker.model_runner = ReplayingRunner(model)
    return worker, model


def test_a_poisoned_engine_refuses_the_next_step_even_when_it_replays_a_graph():
    worker, model = poisoned_worker()
    x = torch.randn(2, 4)
    assert worker.model_runner.execute_model(x).shape == (2, 3)  # steps before the failure
    worker._poison(model, "NaN in model.layers.1.self_attn.q_proj.weight")
    # the replay path alone would still decode: the forward pre-hook is not on it
    assert torch.nn.functional.linear(x, model.weight, model.bias).shape == (2, 3)
    with pytest.raises(worker_extension.WeightReloadError, match="half-reloaded by a failed weight sync .*NaN"):
        worker.model_runner.execute_model(x)
    with pytest.raises(worker_extension.WeightReloadError, match="half-reloaded"):
        model(x)  # an eager forward refuses as before
    with pytest.raises(worker_extension.WeightReloadError, match="earlier weight sync failed"):
        worker._raise_if_broken()
