"""The ``qurl_int8`` checkpoint engine over gloo between three local processes (a trainer and two rollout ranks),
two syncs on the same engine instances: the rollout side receives exactly ``quantize_state_dict`` of what the
trainer sent (the rest in bf16 by default, a tied lm_head left out), the group and its store are built once,
and the bytes on the wire are codes + scales + rest (+ alignment)."""
from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from qurl_testkit.engine_processes import manager_topology, run_engine_processes
from qurl_verl.checkpoint_engine.engine_settings import ENGINE_NAME
from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine
from qurl_verl.quant.compressed_tensors_format import quantize_state_dict
from qurl_verl.rollout.sync_stats import StreamStats, post_rollout_report, take_rollout_report
from qurl_verl.settings import RolloutSettings

BUCKET = 64 << 10  # small, so that several tensors span buckets and one spans several


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden, inter, kv, vocab = 64, 177, 16, 500  # 177 rows: fp32 scales of 708 bytes, padded

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    state = {"model.embed_tokens.weight": r(vocab, hidden)}
    for i in range(2):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": r(hidden),
            p + "self_attn.q_proj.weight": r(hidden, hidden), p + "self_attn.q_proj.bias": r(hidden),
            p + "self_attn.k_proj.weight": r(kv, hidden), p + "self_attn.k_proj.bias": r(kv),
            p + "self_attn.v_proj.weight": r(kv, hidden), p + "self_attn.v_proj.bias": r(kv),
            p + "self_attn.o_proj.weight": r(hidden, hidden),
            p + "post_attention_layernorm.weight": r(hidden),
            p + "mlp.gate_proj.weight": r(inter, hidden), p + "mlp.up_proj.weight": r(inter, hidden),
            p + "mlp.down_proj.weight": r(hidden, inter),
        })
    state["model.norm.weight"] = r(hidden)
    state["lm_head.weight"] = r(vocab, hidden)  # > BUCKET: split across buckets; never quantized
    return state


def expected_stream(state: dict[str, torch.Tensor], quantization: str, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """The direct reference: ``quantize_state_dict`` of the trainer's tensors, the rest cast to bf16 (the
    default ``rest_dtype``), a tied lm_head dropped."""
    settings = RolloutSettings(format=quantization)
    kept = [(n, t) for n, t in state.items() if not (tied and n == "lm_head.weight")]
    out = []
    for name, t in quantize_state_dict(kept, settings.quant_scheme, ignore=settings.ignore_patterns):
        if t.dtype == torch.float32 and not name.endswith("weight_scale"):
            t = t.to(torch.bfloat16)
        out.append((name, t))
    return out


def wire_bytes(stream: list[tuple[str, torch.Tensor]]) -> int:
    """From shapes and dtypes alone: each tensor padded to a multiple of 16 bytes, and a padded one preceded by
    its int64 shape header ([ndim, *shape], an even number of values)."""
    total = 0
    for _, t in stream:
        nbytes = t.numel() * t.element_size()
        if nbytes % 16 or nbytes == 0:
            total += max(16, -(-nbytes // 16) * 16) + 8 * (t.dim() + 1 + (t.dim() + 1) % 2)
        else:
            total += nbytes
    return total


def to_wire(t: torch.Tensor) -> tuple:
    """A tensor as plain bytes (torch's pickling of FP8 storages does not round-trip)."""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), as_bits(t).numpy().tobytes()


def from_wire(wire: tuple) -> torch.Tensor:
    dtype, shape, data = wire
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)


SYNCS = 2  # the second carries the rollout's report of the first
ROLLOUTS = ("rollout", "rollout_1")  # two rollout ranks (two replicas of one rank each): the group has 3 ranks


SIDES = ("trainer", *ROLLOUTS)
CASES = (("int8", True), ("fp8", False))  # (quantization, tied lm_head): one engine per case on every rank


def _run(side: str, inbox, outbox) -> None:
    """One rank: per case a fresh engine, then per sync verl's calls in verl's order (``prepare``, then
    ``init_process_group`` with what the parent's ``build_topology`` gave this rank, the sync, ``finalize``)."""
    torch.set_num_threads(1)

    async def main():
        out = {}
        for quantization, tied in CASES:
            engine = QurlInt8CheckpointEngine(BUCKET, is_master=side == "trainer", quantization=quantization,
                                              tie_word_embeddings=tied, device="cpu")
            syncs = out[quantization, tied] = []
            for step in range(1, SYNCS + 1):
                outbox.put((side, engine.prepare()))
                engine.init_process_group(**inbox.get(timeout=60))
                ids = (engine.transport.endpoint, id(engine.transport.store), id(engine.transport.group))
                if side == "trainer":
                    metrics = await engine.send_weights(iter(tiny_state(step).items()), global_steps=step)
                    stats = engine.last_stats
                    syncs.append((metrics, stats.payload_bytes, stats.buckets, stats.skipped_bytes, ids))
                else:
                    received = [(n, t.clone()) async for n, t in engine.receive_weights(global_steps=step)]
                    # what the rollout's adapter posts once its workers loaded the sync: here the stream's checksum
                    loaded = StreamStats()
                    loaded.add_checksum(received)
                    post_rollout_report(ROLLOUTS.index(side), {"checksum": loaded.checksum, "quantized": 0,
                                                               "sync": step, "format": "int8"})
                    syncs.append(([(n, to_wire(t)) for n, t in received], engine.last_stats.payload_bytes,
                                  engine.last_stats.buckets, loaded.checksum, ids))
                engine.finalize()
            take_rollout_report()  # the last sync's report: the next case starts as a fresh rollout would
        outbox.put((side, pickle.dumps(out)))  # bytes: no tensor fd sharing

    asyncio.run(main())


@pytest.fixture(scope="module")
def syncs():
    """Every case's two syncs between a trainer and two rollout processes, this process in verl's manager's
    place: {case: {side: [per sync: (what it got or returned, ...)]}}."""
    out = run_engine_processes(_run, SIDES, len(CASES) * SYNCS,
                               manager_topology(QurlInt8CheckpointEngine, "trainer", ROLLOUTS))
    return {case: {side: [([(n, from_wire(t)) for n, t in received], *rest) for received, *rest in out[side][case]]
                   if side in ROLLOUTS else out[side][case] for side in SIDES} for case in CASES}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("quantization,tied", CASES)
def test_rollout_receives_the_codes_bit_for_bit_at_every_sync(syncs, quantization, tied):
    out = syncs[quantization, tied]
    checksums = []
    for step, ((received, rollout_bytes, rollout_buckets, rollout_checksum, _),
               (metrics, trainer_bytes, trainer_buckets, skipped_bytes, _)) in enumerate(
            zip(out["rollout"], out["trainer"]), start=1):
        state = tiny_state(step)
        expected = expected_stream(state, quantization, tied)
        assert [n for n, _ in received] == [n for n, _ in expected]
        for (name, got), (_, want) in zip(received, expected):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(as_bits(got), as_bits(want)), name
        codes = [n for n, t in received if t.element_size() == 1]
        assert len(codes) == 14 and all(n.endswith("_proj.weight") for n in codes)
        # the rest in the rollout's dtype (bf16) by default; the scales stay fp32
        assert {t.dtype for n, t in received if t.element_size() > 1 and not n.endswith("weight_scale")} == {torch.bfloat16}
        assert ("lm_head.weight" in dict(received)) is not tied
        assert skipped_bytes == (state["lm_head.weight"].numel() * 4 if tied else 0)

        # the wire carries codes + scales + rest (+ alignment), nothing else: a tied lm_head is not on it
        assert trainer_bytes == rollout_bytes == wire_bytes(expected)
        assert metrics["qurl_sync/payload_bytes"] == trainer_bytes
        assert trainer_buckets == rollout_buckets == metrics["qurl_sync/buckets"] > 2
        # the sender's checksum is the stream's checksum of the direct quantization and of what the rollout got
        direct = StreamStats()
        direct.add_checksum(expected)
        assert metrics["qurl_sync/checksum"] == direct.checksum == rollout_checksum
        checksums.append(direct.checksum)
    assert checksums[0] != checksums[1]  # new codes at the second sync

    # one store (same port) and one group on every rank across the syncs
    assert out["trainer"][0][-1] == out["trainer"][1][-1]
    for side in ROLLOUTS:
        assert out[side][0][-1] == out[side][1][-1]

    # the rollout's report of sync 1 reached the sender's return value at sync 2, under qurl_sync/rollout/
    first, second = out["trainer"][0][0], out["trainer"][1][0]
    assert not any(k.startswith("qurl_sync/rollout") for k in first)
    assert not any(k.startswith("actor/") for k in second)
    assert second["qurl_sync/rollout_reports"] == len(ROLLOUTS)
    assert second["qurl_sync/rollout/checksum/replica_0"] == first["qurl_sync/checksum"]
    assert second["qurl_sync/rollout/checksum/replica_1"] == first["qurl_sync/checksum"]
    assert second["qurl_sync/rollout/sync"] == 1 and second["qurl_sync/rollout/quantized"] == 0
    assert "qurl_sync/rollout/format" not in second  # numbers only
    # the second rollout rank received the same bits as the first at every sync
    for (got, *_), (want, *_) in zip(out["rollout_1"], out["rollout"]):
        assert len(got) == len(want)
        assert all(n == m and torch.equal(as_bits(t), as_bits(u)) for (n, t), (m, u) in zip(got, want))


def test_registered_and_refuses_bf16():
    from verl.checkpoint_engine import CheckpointEngineRegistry

    assert CheckpointEngineRegistry.get(ENGINE_NAME) is QurlInt8CheckpointEngine
    with pytest.raises(ValueError, match="bf16"):
        QurlInt8CheckpointEngine(1 << 20, quantization="bf16")
    with pytest.raises(ValueError, match="multiple of 16"):
        QurlInt8CheckpointEngine(1000, device="cpu")
    with pytest.raises(ValueError, match="rest_dtype='int8'"):
        QurlInt8CheckpointEngine(1 << 20, rest_dtype="int8", device="cpu")
    members = [{"transport": "gloo", "member": str(i)} for i in range(5)]
    master = {**members[0], "host": "h", "port": 1}
    actor, rollout = QurlInt8CheckpointEngine.build_topology(3, 2, [master, *members[1:]])
    assert actor["rank"] == [0, -1, -1] and rollout["rank"] == [1, 2]
    assert actor["world_size"] == rollout["world_size"][:1] * 3
    # one group identity on every rank, which other rollout members change
    assert len({m["members"] for m in actor["master_metadata"] + rollout["master_metadata"]}) == 1
    other, _ = QurlInt8CheckpointEngine.build_topology(3, 2, [master, *members[1:4], {**members[4], "member": "x"}])
    assert other["master_metadata"][0]["members"] != actor["master_metadata"][0]["members"]
    # a rollout worker that prepared another transport (verl's NCCL metadata, or nothing) than the trainer's gloo
    for odd in (None, object()):
        with pytest.raises(ValueError, match=r"different transports .*workers \[4\]"):
            QurlInt8CheckpointEngine.build_topology(3, 2, [master, *members[1:4], odd])


@pytest.mark.parametrize("quantization,rest_dtype", [("int8", None), ("fp8", None), ("fp8_block", None),
                                                     ("int8", "bfloat16")])
def test_the_rollout_stream_loads_what_the_engine_sends_as_it_would_have_quantized_it(quantization, rest_dtype):
    """The qurl_vllm worker's stream, given the engine's trainer-side output, loads the same tensors it loads
    from the fp32 masters in the colocated sync: the codes and scales pass unchanged, nothing is quantized twice."""
    from qurl_verl.rollout.weight_stream import WeightStreamQuantizer

    settings = RolloutSettings(format=quantization)
    state = tiny_state()
    if quantization == "fp8_block":  # whole 128 x 128 blocks
        state = {n: torch.randn(256, 128) if n.endswith("_proj.weight") else t for n, t in state.items()}
    engine = QurlInt8CheckpointEngine(BUCKET, is_master=True, quantization=quantization, device="cpu",
                                      rest_dtype=rest_dtype)
    sent = list(engine.encoder.model_tensors(state.items()))
    # the engine's parameters: bf16 where the rest is sent in bf16 (the worker casts to them)
    dtypes = {n: torch.bfloat16 for n in state} if rest_dtype else None
    if rest_dtype:
        assert {t.dtype for n, t in sent if t.element_size() > 1 and not n.endswith("weight_scale")} == {torch.bfloat16}
    colocated = WeightStreamQuantizer(settings, param_dtypes=dtypes)
    disaggregated = WeightStreamQuantizer(settings, param_dtypes=dtypes)
    want = dict(colocated.transform(state.items()))
    got = dict(disaggregated.transform(sent))
    assert disaggregated.stats.quantized == 0 and colocated.stats.quantized == 14
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(as_bits(got[name]), as_bits(want[name])), name
