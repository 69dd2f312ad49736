"""verl's own ``CheckpointEngineManager`` drives a sync through ``qurl_int8``: a trainer-side Ray worker (a
``Worker`` with verl's ``execute_checkpoint_engine`` / ``update_weights`` endpoints) and a rollout-side
``CheckpointEngineWorker`` (verl's class, its engine built from the rollout config by the plugin import of
``custom_backend_module``), over the engine's own gloo group. The rollout's adapter receives exactly
``quantize_state_dict`` of the trainer's tensors (the rest in bf16, the tied lm_head left out) at each of two
syncs on the same engines, whose group and store are built once; the rollout's report of the first sync
reaches the second sync's metrics."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")

from verl.single_controller.base import Worker  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402

from qurl_verl.checkpoint_engine.engine_settings import ENGINE_MODULE, ENGINE_NAME  # noqa: E402

BUCKET_MB = 1


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model.embed_tokens.weight": torch.randn(20000, 64, generator=g),  # 2.4 MiB in bf16: chunked across buckets
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(64, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(2048, 64, generator=g),  # 512 KiB fp32
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 8192, generator=g),  # 2 MiB fp32 codes: 512 KiB
        "model.norm.weight": torch.randn(64, generator=g),
        "lm_head.weight": torch.randn(5000, 64, generator=g),  # tied: not sent
    }


def checkpoint_engine_config() -> SimpleNamespace:
    return SimpleNamespace(backend=ENGINE_NAME, update_weights_bucket_megabytes=BUCKET_MB,
                           custom_backend_module=ENGINE_MODULE,
                           engine_kwargs={ENGINE_NAME: {"quantization": "int8", "device": "cpu",
                                                        "tie_word_embeddings": True}})


class Trainer(Worker):
    """The actor side of verl's engine workers, reduced to what the manager calls."""

    def __init__(self, config):
        super().__init__()
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        import_external_libs(config.custom_backend_module)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend, is_master=self.rank == 0, bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs[config.backend])

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        return await self.checkpoint_engine.send_weights(iter(state(global_steps).items()), global_steps=global_steps)


class Adapter:
    """The rollout's server adapter: keeps what ``CheckpointEngineWorker.update_weights`` hands it."""

    replica_rank, is_leader_rank = 0, True

    def __init__(self):
        self.received = {}

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors"):
        from qurl_verl.rollout.sync_stats import StreamStats, post_rollout_report

        self.received[global_steps] = [(n, t.clone()) async for n, t in weights]
        loaded = StreamStats()  # what the qurl_vllm adapter posts once its workers loaded the sync
        loaded.add_checksum(self.received[global_steps])
        post_rollout_report(self.replica_rank, {"checksum": loaded.checksum, "sync": global_steps})


class Replica:
    def __init__(self, workers):
        self.workers = workers

    async def abort_all_requests(self, reject_request=False):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def resume_generation(self):
        pass


@pytest.fixture
def ray_cluster():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ":".join(p for p in sys.path if p)}})
    yield
    ray.shutdown()


def test_manager_syncs_through_qurl_int8(ray_cluster):
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from qurl_verl.quant.compressed_tensors_format import quantize_state_dict
    from qurl_verl.rollout.sync_stats import StreamStats
    from qurl_verl.settings import RolloutSettings

    config = checkpoint_engine_config()
    actor_wg = RayWorkerGroup(RayResourcePool([1], use_gpu=False, max_colocate_count=1),
                              RayClassWithInitArgs(ray.remote(Trainer), config=config))
    rollout_config = SimpleNamespace(name="qurl_vllm", mode="async", checkpoint_engine=config)
    rollout_wg = RayWorkerGroup(RayResourcePool([1], use_gpu=False, max_colocate_count=1),
                                RayClassWithInitArgs(ray.remote(CheckpointEngineWorker), rollout_config=rollout_config,
                                                     model_config=None, server_adapter=Adapter()))
    manager = CheckpointEngineManager(config, actor_wg, [Replica(rollout_wg.workers)])
    assert manager.backend_cls.__name__ == "QurlInt8CheckpointEngine"

    settings = RolloutSettings()
    sent = {}
    groups = []
    for step in (1, 2):
        metrics = manager.update_weights(global_steps=step)
        kept = [(n, t) for n, t in state(step).items() if n != "lm_head.weight"]
        expected = [(n, t.to(torch.bfloat16) if t.dtype == torch.float32 and not n.endswith("weight_scale") else t)
                    for n, t in quantize_state_dict(kept, settings.quant_scheme, ignore=settings.ignore_patterns)]
        received = ray.get(rollout_wg.workers[0].__ray_call__.remote(
            lambda self: [(n, (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy())
                          for n, t in self.server_adapter.received[step]]))
        assert [n for n, _ in received] == [n for n, _ in expected]
        for (name, got), (_, want) in zip(received, expected):
            want = want.view(torch.int16) if want.dtype == torch.bfloat16 else want
            assert torch.equal(torch.from_numpy(got.copy()), want), name
        # no tensor here needs padding: the payload is the tensors' own bytes
        assert metrics["qurl_sync/payload_bytes"] == sum(t.numel() * t.element_size() for _, t in expected)
        assert metrics["qurl_sync/buckets"] > 2
        direct = StreamStats()
        direct.add_checksum(expected)
        assert metrics["qurl_sync/checksum"] == direct.checksum
        sent[step] = metrics
        groups.append(ray.get([w.__ray_call__.remote(
            lambda self: (self.checkpoint_engine.transport.endpoint, id(self.checkpoint_engine.transport.store),
                          id(self.checkpoint_engine.transport.group))) for w in (*actor_wg.workers, *rollout_wg.workers)]))
    assert groups[0] == groups[1]  # one store, one group on each side across the syncs
    assert sent[1]["qurl_sync/checksum"] != sent[2]["qurl_sync/checksum"]
    assert sent[2]["qurl_sync/rollout/checksum/replica_0"] == sent[1]["qurl_sync/checksum"]
    assert sent[2]["qurl_sync/rollout/sync"] == 1 and sent[2]["qurl_sync/rollout_reports"] == 1
