"""The ``qurl_int8`` checkpoint engine over gloo between two local processes: the rollout side receives
exactly ``quantize_state_dict`` of what the trainer sent, and the bytes on the wire are codes + scales + rest."""
from __future__ import annotations

import asyncio
import pickle

import pytest
import torch
import torch.multiprocessing as mp

from qurl_verl.checkpoint_engine.engine_settings import ENGINE_NAME
from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine
from qurl_verl.quant.compressed_tensors_format import quantize_state_dict
from qurl_verl.rollout.sync_stats import StreamStats, post_rollout_report
from qurl_verl.settings import RolloutSettings

BUCKET = 64 << 10  # small, so that several tensors span buckets and one spans several


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden, inter, kv, vocab = 64, 176, 16, 500

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


def expected_bytes(state: dict[str, torch.Tensor], quantization: str) -> int:
    """From shapes and dtypes alone: 1 byte per code and one fp32 scale per output row for the decoder
    projections (channel schemes), the rest at its own dtype."""
    assert quantization in ("int8", "fp8")
    total = 0
    for name, t in state.items():
        if name.endswith("_proj.weight") and ".layers." in name:
            total += t.shape[0] * t.shape[1] * 1 + t.shape[0] * 4
        else:
            total += t.numel() * t.element_size()
    return total


def to_wire(t: torch.Tensor) -> tuple:
    """A tensor as plain bytes (torch's pickling of FP8 storages does not round-trip)."""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), as_bits(t).numpy().tobytes()


def from_wire(wire: tuple) -> torch.Tensor:
    dtype, shape, data = wire
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)


SYNCS = 2  # the second carries the rollout's report of the first
ROLLOUTS = ("rollout", "rollout_1")  # two rollout ranks (two replicas of one rank each): the group has 3 ranks


def _run(side: str, quantization: str, queue, results) -> None:
    torch.set_num_threads(1)

    async def main():
        engine = QurlInt8CheckpointEngine(BUCKET, is_master=side == "trainer", quantization=quantization, device="cpu")
        out = []
        for step in range(1, SYNCS + 1):
            if side == "trainer":
                meta = engine.prepare()
                for _ in ROLLOUTS:
                    queue.put(meta)
                actor, _ = QurlInt8CheckpointEngine.build_topology(1, len(ROLLOUTS), [meta, None, None])
                engine.init_process_group(**{k: v[0] for k, v in actor.items()})
                metrics = await engine.send_weights(iter(tiny_state(step).items()), global_steps=step)
                out.append((metrics, engine.last_stats.payload_bytes, engine.last_stats.buckets))
            else:
                assert engine.prepare() is None
                meta = queue.get(timeout=60)
                _, rollout = QurlInt8CheckpointEngine.build_topology(1, len(ROLLOUTS), [meta, None, None])
                index = ROLLOUTS.index(side)
                engine.init_process_group(**{k: v[index] for k, v in rollout.items()})
                received = [(n, t) async for n, t in engine.receive_weights(global_steps=step)]
                # what the rollout's adapter posts once its workers loaded the sync: here the stream's checksum
                loaded = StreamStats()
                loaded.add_checksum(received)
                post_rollout_report(index, {"checksum": loaded.checksum, "quantized": 14})
                out.append(([(n, to_wire(t)) for n, t in received], engine.last_stats.payload_bytes,
                            engine.last_stats.buckets))
            engine.finalize()
        results.put(pickle.dumps((side, out)))

    asyncio.run(main())


def sync_twice(quantization: str):
    """Two syncs between a trainer and a rollout process: {side: [per sync: (what it got or returned, bytes,
    buckets)]}."""
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(side, quantization, queue, results)) for side in ("trainer", *ROLLOUTS)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        side, syncs = pickle.loads(results.get(timeout=120))  # bytes: no tensor fd sharing
        out[side] = syncs
    for side in ROLLOUTS:
        out[side] = [([(n, from_wire(t)) for n, t in received], *rest) for received, *rest in out[side]]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_rollout_receives_the_codes_bit_for_bit(quantization):
    out = sync_twice(quantization)
    settings = RolloutSettings(format=quantization)
    for step, ((received, rollout_bytes, rollout_buckets), (metrics, trainer_bytes, trainer_buckets)) in enumerate(
            zip(out["rollout"], out["trainer"]), start=1):
        state = tiny_state(step)
        expected = list(quantize_state_dict(state.items(), settings.quant_scheme, ignore=settings.ignore_patterns))
        assert [n for n, _ in received] == [n for n, _ in expected]
        for (name, got), (_, want) in zip(received, expected):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(as_bits(got), as_bits(want)), name
        codes = [n for n, t in received if t.element_size() == 1]
        assert len(codes) == 14 and all(n.endswith("_proj.weight") for n in codes)
        assert ("lm_head.weight", state["lm_head.weight"].dtype) in [(n, t.dtype) for n, t in received]

        # the wire carries codes + scales + rest, nothing else
        assert trainer_bytes == rollout_bytes == expected_bytes(state, quantization)
        assert metrics["qurl_sync/payload_bytes"] == trainer_bytes
        assert trainer_buckets == rollout_buckets > 2
        assert trainer_bytes < 0.6 * sum(t.numel() * 4 for t in state.values())  # embed + lm_head dominate here
        # the sender's checksum is the stream's checksum of the direct quantization (computed here)
        direct = StreamStats()
        direct.add_checksum(expected)
        assert metrics["qurl_sync/checksum"] == direct.checksum

    # the rollout's report of sync 1 reached the sender's return value at sync 2, under the colocated names
    first, second = out["trainer"][0][0], out["trainer"][1][0]
    assert not any(k.startswith("actor/") for k in first) and "qurl_sync/rollout_reports" not in first
    assert second["qurl_sync/rollout_reports"] == len(ROLLOUTS)
    assert second["actor/qurl/sync/checksum/replica_0"] == first["qurl_sync/checksum"]
    assert second["actor/qurl/sync/checksum/replica_1"] == first["qurl_sync/checksum"]
    # the second rollout rank received the same bits as the first at every sync
    for (got, *_), (want, *_) in zip(out["rollout_1"], out["rollout"]):
        assert len(got) == len(want)
        assert all(n == m and torch.equal(as_bits(t), as_bits(u)) for (n, t), (m, u) in zip(got, want))
    assert second["actor/qurl/sync/quantized"] == 14


def test_registered_and_refuses_bf16():
    from verl.checkpoint_engine import CheckpointEngineRegistry

    assert CheckpointEngineRegistry.get(ENGINE_NAME) is QurlInt8CheckpointEngine
    with pytest.raises(ValueError, match="bf16"):
        QurlInt8CheckpointEngine(1 << 20, quantization="bf16")
    actor, rollout = QurlInt8CheckpointEngine.build_topology(3, 2, [{"host": "h", "port": 1}, None, None, None, None])
    assert actor["rank"] == [0, -1, -1] and rollout["rank"] == [1, 2]
    assert actor["world_size"] == rollout["world_size"][:1] * 3


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
    sent = list(engine.quantized_stream(state.items()))
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
