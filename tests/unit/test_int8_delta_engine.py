"""The ``qurl_int8`` engine in its delta mode over gloo, a trainer and two rollout ranks in three processes, eight
syncs on lr-sized steps: every rollout rank ends every sync with exactly ``quantize_state_dict`` of the trainer's
weights (the rest in bf16), a delta sync sends fewer bytes than a full one, and the faults of one rank (it missed
a sync, it restarted as a fresh engine, a payload it received was corrupted) are each repaired by a full sync that
the sender decides from the ranks' reports, counted in ``qurl_sync/full_resyncs``."""
from __future__ import annotations

import asyncio
import copy
import pickle

import pytest
import torch

from qurl_testkit.engine_processes import manager_topology, run_engine_processes
from qurl_verl.checkpoint_engine.delta_sync import PAYLOAD_PREFIX
from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine
from qurl_verl.quant.compressed_tensors_format import quantize_state_dict
from qurl_verl.rollout.sync_stats import StreamStats, post_rollout_report, take_rollout_report
from qurl_verl.settings import RolloutSettings

BUCKET = 64 << 10
SIDES = ("trainer", "rollout", "rollout_1")
SYNCS = 8
# what rollout_1 does before each sync (1-based): its faults, each followed by a forced full sync
MISSED, RESTARTED, CORRUPTED = 3, 5, 6  # before sync 3 it rolls back to its copy of sync 1 (it missed sync 2)
FULL_SYNCS = [1, 3, 5, 7]  # the first, then one after each fault (the corruption is seen one sync late)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def state(step: int) -> dict[str, torch.Tensor]:
    """A two-layer model's fp32 masters after ``step - 1`` steps of size 2e-4 in random directions."""
    g = torch.Generator().manual_seed(0)
    hidden, inter, vocab = 64, 96, 300
    out = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(2):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": torch.randn(hidden, generator=g),
                    p + "self_attn.q_proj.weight": torch.randn(hidden, hidden, generator=g),
                    p + "self_attn.q_proj.bias": torch.randn(hidden, generator=g),
                    p + "mlp.gate_proj.weight": torch.randn(inter, hidden, generator=g),
                    p + "mlp.down_proj.weight": torch.randn(hidden, inter, generator=g)})
    out["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    for s in range(1, step):
        g = torch.Generator().manual_seed(1000 + s)
        for t in out.values():
            t.add_(torch.randn(t.shape, generator=g).sign(), alpha=2e-4)
    return out


def expected(step: int) -> list[tuple[str, torch.Tensor]]:
    """The direct reference: ``quantize_state_dict`` of the trainer's tensors, the rest cast to bf16."""
    settings = RolloutSettings(format="int8")
    return [(n, t.to(torch.bfloat16) if t.dtype == torch.float32 and not n.endswith("weight_scale") else t)
            for n, t in quantize_state_dict(state(step).items(), settings.quant_scheme, ignore=settings.ignore_patterns)]


def to_wire(t: torch.Tensor) -> tuple:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), bits(t).view(torch.uint8).numpy().tobytes()


def from_wire(wire: tuple) -> torch.Tensor:
    dtype, shape, data = wire
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(_INT[t.element_size()])


def corrupting(receiver):
    """``receiver.take`` that flips a byte of the values of the first delta payload with changed elements."""
    take, armed = receiver.take, [True]

    def flipped(name, tensor):
        pending = receiver._sync and receiver._sync["pending"]
        if armed[0] and name.startswith(PAYLOAD_PREFIX) and pending and pending[1][1] > 0:
            tensor = tensor.clone()
            tensor[-1] ^= 0x5A  # the last changed value's last byte
            armed[0] = False
        return take(name, tensor)

    return flipped


def _run(side: str, inbox, outbox) -> None:
    torch.set_num_threads(1)

    def engine_for():
        return QurlInt8CheckpointEngine(BUCKET, is_master=side == "trainer", delta=True, device="cpu")

    async def main():
        engine, syncs, saved = engine_for(), [], None
        for step in range(1, SYNCS + 1):
            if side == "rollout_1":
                if step == MISSED:
                    engine.delta_receiver = saved  # its copy of sync 1: as if sync 2 never reached it
                elif step == RESTARTED:
                    take_rollout_report()
                    engine = engine_for()  # a fresh process: no copy, a new group member
                elif step == CORRUPTED:
                    engine.delta_receiver.take = corrupting(engine.delta_receiver)
            outbox.put((side, engine.prepare()))
            engine.init_process_group(**inbox.get(timeout=60))
            if side == "trainer":
                metrics = await engine.send_weights(iter(state(step).items()), global_steps=step)
                syncs.append((metrics, engine.last_stats.payload_bytes))
            else:
                received = [(n, t.clone()) async for n, t in engine.receive_weights(global_steps=step)]
                if step == CORRUPTED:
                    engine.delta_receiver.__dict__.pop("take", None)
                loaded = StreamStats()
                loaded.add_checksum(received)
                post_rollout_report(SIDES.index(side) - 1, {"checksum": loaded.checksum, "sync": step})
                syncs.append(([(n, to_wire(t)) for n, t in received], engine.last_stats.payload_bytes))
                if step == 1:
                    saved = copy.deepcopy(engine.delta_receiver)
            engine.finalize()
        outbox.put((side, pickle.dumps(syncs)))

    asyncio.run(main())


@pytest.fixture(scope="module")
def syncs():
    return run_engine_processes(_run, SIDES, SYNCS, manager_topology(QurlInt8CheckpointEngine, SIDES[0], SIDES[1:]))


def same_bits(received, reference) -> bool:
    return [n for n, _ in received] == [n for n, _ in reference] and all(
        from_wire(got).dtype == want.dtype and torch.equal(bits(from_wire(got)), bits(want))
        for (_, got), (_, want) in zip(received, reference))


def test_every_rank_bit_exact_after_every_sync_and_each_fault_repaired_by_a_full_sync(syncs):
    metrics = [m for m, _ in syncs["trainer"]]
    assert [s for s, m in enumerate(metrics, start=1) if m["qurl_sync/full_sync"]] == FULL_SYNCS
    assert [m["qurl_sync/full_resyncs"] for m in metrics] == [0, 0, 1, 1, 2, 2, 3, 3]
    for step in range(1, SYNCS + 1):
        reference = expected(step)
        direct = StreamStats()
        direct.add_checksum(reference)
        assert metrics[step - 1]["qurl_sync/checksum"] == direct.checksum
        assert same_bits(syncs["rollout"][step - 1][0], reference), step
        # the corrupted payload made rollout_1 diverge at that sync, and only there
        assert same_bits(syncs["rollout_1"][step - 1][0], reference) is (step != CORRUPTED), step


def test_delta_syncs_send_a_fraction_of_a_full_one(syncs):
    full = syncs["trainer"][0][1]
    for step, (m, payload) in enumerate(syncs["trainer"], start=1):
        assert m["qurl_sync/payload_bytes"] == payload
        assert payload == syncs["rollout"][step - 1][1] == syncs["rollout_1"][step - 1][1]
        if step in FULL_SYNCS:
            assert m["qurl_sync/delta_fraction"] == 1.0 and payload >= full
        else:
            assert 0 < m["qurl_sync/delta_fraction"] < 0.2 and payload < 0.5 * full, (step, m)


def test_the_rollouts_reports_reach_the_metrics_without_the_delta_state(syncs):
    later = syncs["trainer"][1][0]
    direct = StreamStats()
    direct.add_checksum(expected(1))
    assert later["qurl_sync/rollout_reports"] == 2.0
    assert later["qurl_sync/rollout/checksum/replica_0"] == later["qurl_sync/rollout/checksum/replica_1"] == direct.checksum
    assert not any("delta_base" in k or "delta_checksum" in k for m, _ in syncs["trainer"] for k in m)
