"""``qurl_int8`` on CUDA is verl's own ``NCCLCheckpointEngine``: its real code path (buckets, zmq metadata
channel, relays, a group kept across syncs) run in three CPU processes over ``qurl_testkit.nccl_stand_ins``
(cupy, ``ray.util.collective`` on gloo, the CUDA calls). Two actor ranks on one node and one rollout rank,
two syncs per case, with verl's ``multi_sender`` on (the second actor rank relays: it must cut the same
buckets from its own encoded stream) and off (it is left out and only drains its stream), then the delta mode
(``multi_sender`` asked for and turned off: rank 0 sends alone; the second sync a delta of lr-sized changes). The
rollout receives exactly ``quantize_state_dict`` of the trainer's tensors, the rest in bf16, a tied lm_head left
out."""
from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from qurl_testkit.engine_processes import run_engine_processes
from qurl_verl.quant.compressed_tensors_format import quantize_state_dict
from qurl_verl.rollout.sync_stats import StreamStats, post_rollout_report, take_rollout_report
from qurl_verl.settings import RolloutSettings

BUCKET = 8 << 10  # several buckets per sync, the bf16 embedding (18.8 KiB) split across three
SYNCS = 2
CASES = (True, False)  # multi_sender
DELTA = "delta"  # multi_sender=True with engine_kwargs delta=true; its second sync moves the first's weights by 1e-3
ALL_CASES = (*CASES, DELTA)
SIDES = ("actor_0", "actor_1", "rollout")  # the order verl's manager lists them in
NODES = {"actor_0": "node-a", "actor_1": "node-a", "rollout": "node-b"}


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model.embed_tokens.weight": torch.randn(301, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(32, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(93, 32, generator=g),  # 93 fp32 scales: padded
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 93, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
        "lm_head.weight": torch.randn(301, 32, generator=g),  # tied: not sent
    }


def state_of(case, step: int) -> dict[str, torch.Tensor]:
    if case != DELTA or step == 1:
        return state(step)
    g = torch.Generator().manual_seed(100 + step)
    return {n: t + 1e-3 * torch.randn(t.shape, generator=g).sign() for n, t in state_of(case, step - 1).items()}


def expected(step: int, case=True) -> list[tuple[str, torch.Tensor]]:
    settings = RolloutSettings(format="int8")
    kept = [(n, t) for n, t in state_of(case, step).items() if n != "lm_head.weight"]
    return [(n, t.to(torch.bfloat16) if t.dtype == torch.float32 and not n.endswith("weight_scale") else t)
            for n, t in quantize_state_dict(kept, settings.quant_scheme, ignore=settings.ignore_patterns)]


def _run(side: str, store_dir: str, inbox, outbox) -> None:
    torch.set_num_threads(1)
    from qurl_testkit.nccl_stand_ins import install

    collective = install(NODES[side], store_dir)
    from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine

    async def main():
        out = []
        for case in ALL_CASES:
            multi_sender = case if case != DELTA else True
            engine = QurlInt8CheckpointEngine(BUCKET, is_master=side == "actor_0", tie_word_embeddings=True,
                                              device="cuda", multi_sender=multi_sender, delta=case == DELTA)
            assert engine.on_cuda
            for step in range(1, SYNCS + 1):
                outbox.put((side, pickle.dumps(engine.prepare())))
                metadata = [pickle.loads(m) for m in inbox.get(timeout=60)]
                actor, rollout = QurlInt8CheckpointEngine.build_topology(2, 1, metadata)
                mine = rollout if side == "rollout" else actor
                index = 0 if side == "rollout" else SIDES.index(side)
                engine.init_process_group(**{k: v[index] for k, v in mine.items()})
                if side == "rollout":
                    received = [(n, t.clone()) async for n, t in engine.receive_weights(global_steps=step)]
                    loaded = StreamStats()
                    loaded.add_checksum(received)
                    post_rollout_report(0, {"checksum": loaded.checksum, "sync": step})
                    result = [(n, str(t.dtype), tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
                              for n, t in received]
                else:
                    result = await engine.send_weights(iter(state_of(case, step).items()), global_steps=step)
                out.append((case, step, engine.transport.rank, result,
                            id(collective.groups.get("qurl_int8"))))
                engine.finalize()
            collective.next_case()
            take_rollout_report()  # the last sync's report: the next case starts as a fresh rollout would
        outbox.put((side, pickle.dumps(out)))

    asyncio.run(main())


@pytest.fixture(scope="module")
def syncs(tmp_path_factory):
    store_dir = str(tmp_path_factory.mktemp("collective"))
    # verl's manager: every prepare, then every init_process_group (the stand-in engine builds its own topology)
    return run_engine_processes(_run, SIDES, len(ALL_CASES) * SYNCS,
                               lambda prepared: {side: [prepared[s] for s in SIDES] for side in SIDES}, (store_dir,))


def as_bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("multi_sender", CASES)
def test_rollout_receives_the_codes_bit_for_bit_through_verls_nccl_engine(syncs, multi_sender):
    rollout = [r for r in syncs["rollout"] if r[0] == multi_sender]
    sender = [r for r in syncs["actor_0"] if r[0] == multi_sender]
    relay = [r for r in syncs["actor_1"] if r[0] == multi_sender]
    for (_, step, rank, received, _), (_, _, _, metrics, _), (_, _, relay_rank, relayed, _) in zip(rollout, sender,
                                                                                                 relay):
        want = expected(step)
        assert [n for n, *_ in received] == [n for n, _ in want]
        for (name, dtype, shape, data), (_, t) in zip(received, want):
            assert (dtype, shape) == (str(t.dtype), tuple(t.shape)) and data == as_bits(t), name
        # verl's topology: the relay joins as rank 1 with multi_sender, is left out (-1) without
        assert (relay_rank, rank) == ((1, 2) if multi_sender else (-1, 1))
        assert relayed == {}  # only actor rank 0 reports
        direct = StreamStats()
        direct.add_checksum(want)
        assert metrics["qurl_sync/checksum"] == direct.checksum
        assert metrics["qurl_sync/buckets"] > 2 and metrics["qurl_sync/quantized_tensors"] == 3
        # payload: every tensor padded to 16 bytes, plus one shape header ([2, 93, 1] and a zero: 32 bytes) for
        # gate_proj's 93 fp32 scales (372 bytes); the rest is aligned (bf16 bias and norm of 64 bytes)
        sizes = [t.numel() * t.element_size() for _, t in want]
        assert metrics["qurl_sync/payload_bytes"] == sum(-(-s // 16) * 16 for s in sizes) + 32
        if step == 2:  # the rollout's report of sync 1, gathered in verl's group (the relay taking part)
            assert metrics["qurl_sync/rollout_reports"] == 1 and metrics["qurl_sync/rollout/sync"] == 1
            assert metrics["qurl_sync/rollout/checksum/replica_0"] == sender[0][3]["qurl_sync/checksum"]
        else:
            assert "qurl_sync/rollout_reports" not in metrics
    # verl keeps the group across syncs (rebuild_group=False): one group object per rank and case
    assert rollout[0][4] == rollout[1][4] != id(None) and sender[0][4] == sender[1][4]


def test_the_delta_mode_through_verls_nccl_engine(syncs):
    """Rank 0 sends alone (the relay asked for is left out); the first sync full, the second a delta of fewer bytes;
    the rollout bit for bit at both."""
    rollout = [r for r in syncs["rollout"] if r[0] == DELTA]
    sender = [r for r in syncs["actor_0"] if r[0] == DELTA]
    relay = [r for r in syncs["actor_1"] if r[0] == DELTA]
    for (_, step, rank, received, _), (_, _, _, metrics, _), (_, _, relay_rank, _, _) in zip(rollout, sender, relay):
        want = expected(step, DELTA)
        assert [n for n, *_ in received] == [n for n, _ in want]
        for (name, dtype, shape, data), (_, t) in zip(received, want):
            assert (dtype, shape) == (str(t.dtype), tuple(t.shape)) and data == as_bits(t), name
        assert (relay_rank, rank) == (-1, 1)
        direct = StreamStats()
        direct.add_checksum(want)
        assert metrics["qurl_sync/checksum"] == direct.checksum
        assert metrics["qurl_sync/full_sync"] == (step == 1) and metrics["qurl_sync/full_resyncs"] == 0
    first, second = sender[0][3], sender[1][3]
    assert 0 < second["qurl_sync/delta_fraction"] < 0.5 and second["qurl_sync/delta_tensors"] > 0
    assert second["qurl_sync/payload_bytes"] < 0.6 * first["qurl_sync/payload_bytes"]
