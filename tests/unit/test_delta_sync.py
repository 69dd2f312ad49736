"""The delta mode's two sides without a transport: every receiver ends every sync with the tensors the sender
quantized, bit for bit (the reference: ``quantize_state_dict`` of the trainer's weights, the rest cast to bf16),
and a receiver that missed a sync, restarted or got a corrupted payload is brought back by a full sync that the
sender decides from the receivers' reports."""
import pytest
import torch

from qurl_verl.checkpoint_engine import delta_sync as ds
from qurl_verl.quant.compressed_tensors_format import quantize_state_dict
from qurl_verl.rollout.sync_stats import StreamStats
from qurl_verl.settings import RolloutSettings

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


class Trainer:
    """A two-layer model's fp32 masters, moved by lr-sized steps (few codes change per step)."""

    def __init__(self, fmt="int8", seed=0):
        g = torch.Generator().manual_seed(seed)
        self.g, self.settings = g, RolloutSettings(format=fmt)
        self.weights = {"model.embed_tokens.weight": torch.randn(300, 64, generator=g) * 0.02}
        for i in range(2):
            p = f"model.layers.{i}."
            self.weights.update({
                p + "input_layernorm.weight": 1 + 0.1 * torch.randn(64, generator=g),
                p + "self_attn.q_proj.weight": torch.randn(64, 64, generator=g) * 0.02,
                p + "self_attn.q_proj.bias": torch.randn(64, generator=g) * 0.2,
                p + "mlp.down_proj.weight": torch.randn(64, 96, generator=g) * 0.02})

    def step(self, lr=1e-5):
        for w in self.weights.values():
            w.add_(torch.randn(w.shape, generator=self.g).sign() * lr)

    def sent(self):
        """What the codec hands the delta layer: codes, scales, the rest in bf16."""
        for name, t in quantize_state_dict(self.weights.items(), self.settings.quant_scheme,
                                           ignore=self.settings.ignore_patterns):
            yield name, t if t.dtype != torch.float32 or name.endswith("weight_scale") else t.to(torch.bfloat16)


def bits(t):
    return t.contiguous().view(-1).view(_INT[t.element_size()])


def assert_bit_exact(received, reference):
    assert list(received) == list(reference)
    for name, t in reference.items():
        assert received[name].dtype == t.dtype and received[name].shape == t.shape, name
        assert torch.equal(bits(received[name]), bits(t)), name


def wire_bytes(wire):
    return sum(t.numel() * t.element_size() for _, t in wire)


def sync(sender, receivers, trainer, tamper=None, skip=()):
    """One sync: plan from the reports, encode once, every receiver applies its own copy of the wire."""
    mode, reason = sender.plan([r.report() for r in receivers])
    stats = ds.DeltaSyncStats()
    wire = [(n, t.clone()) for n, t in sender.encode(trainer.sent(), mode, stats)]
    stats.reason = reason
    outputs = []
    for i, r in enumerate(receivers):
        if i in skip:
            outputs.append(None)
            continue
        mine = [(n, t.clone()) for n, t in wire]
        if tamper and i in tamper:
            tamper[i](mine)
        outputs.append(dict(r.apply(mine)))
    return stats, wire, outputs


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_every_sync_bit_exact_and_deltas_smaller(fmt):
    trainer, sender, receivers = Trainer(fmt), ds.DeltaSender(), [ds.DeltaReceiver(), ds.DeltaReceiver()]
    full_bytes = None
    for n in range(1, 6):
        reference = dict(trainer.sent())
        stats, wire, outputs = sync(sender, receivers, trainer)
        for out, r in zip(outputs, receivers):
            assert_bit_exact(out, reference)
            assert r.base == n and r.checksum == stats.checksum
        check = StreamStats()
        check.add_checksum(reference.items())
        assert stats.checksum == check.checksum
        if n == 1:
            assert stats.full_sync and stats.delta_fraction == 1.0
            full_bytes = wire_bytes(wire)
        else:
            assert not stats.full_sync and 0 < stats.delta_fraction < 0.2
            assert wire_bytes(wire) < 0.5 * full_bytes
        assert stats.full_resyncs == 0
        trainer.step()
    assert sender.host_bytes() == receivers[0].host_bytes() == sum(
        t.numel() * t.element_size() for t in reference.values())


def test_full_every_k_syncs():
    trainer, sender, receiver = Trainer(), ds.DeltaSender(full_sync_every=3), ds.DeltaReceiver()
    modes = []
    for _ in range(7):
        stats, _, (out,) = sync(sender, [receiver], trainer)
        modes.append(stats.full_sync)
        trainer.step()
    assert modes == [True, False, False, True, False, False, True]
    assert stats.full_resyncs == 0


def test_a_receiver_that_missed_a_sync_gets_a_full_one():
    trainer, sender, receivers = Trainer(), ds.DeltaSender(), [ds.DeltaReceiver(), ds.DeltaReceiver()]
    sync(sender, receivers, trainer)
    trainer.step()
    sync(sender, receivers, trainer, skip={1})  # receiver 1 misses sync 2: it still holds sync 1
    trainer.step()
    reference = dict(trainer.sent())
    stats, _, outputs = sync(sender, receivers, trainer)
    assert stats.full_sync and stats.full_resyncs == 1 and "holds sync 1" in stats.reason
    for out in outputs:
        assert_bit_exact(out, reference)


def test_a_restarted_receiver_gets_a_full_sync():
    trainer, sender, receivers = Trainer(), ds.DeltaSender(), [ds.DeltaReceiver(), ds.DeltaReceiver()]
    for _ in range(2):
        sync(sender, receivers, trainer)
        trainer.step()
    receivers[1] = ds.DeltaReceiver()  # a fresh process: no copy
    reference = dict(trainer.sent())
    stats, _, outputs = sync(sender, receivers, trainer)
    assert stats.full_sync and stats.full_resyncs == 1
    for out in outputs:
        assert_bit_exact(out, reference)


def flip_payload_value_bits(wire):
    """Flip bits in the values of the first delta payload with changed elements (the index left as it is)."""
    for i, (name, t) in enumerate(wire):
        if name.startswith(ds.TENSOR_HEADER_PREFIX) and int(t[0]) != 0 and int(t[1]) > 0:
            payload_name, payload = wire[i + 1]
            payload[-1] ^= 0x5A
            return
    raise AssertionError("no delta payload with a changed element to corrupt")


def flip_payload_index_bits(wire):
    for i, (name, t) in enumerate(wire):
        if name.startswith(ds.TENSOR_HEADER_PREFIX) and int(t[0]) == 2 and int(t[4]) > 0:
            wire[i + 1][1][0] ^= 0x80  # the first gap's continuation bit: one position fewer or a longer gap
            return
    raise AssertionError("no gap-encoded payload to corrupt")


@pytest.mark.parametrize("corrupt", [flip_payload_value_bits, flip_payload_index_bits], ids=["values", "index"])
def test_a_corrupted_delta_is_caught_and_repaired_by_the_next_sync(corrupt):
    trainer, sender, receivers = Trainer(), ds.DeltaSender(), [ds.DeltaReceiver(), ds.DeltaReceiver()]
    sync(sender, receivers, trainer)
    trainer.step()
    reference = dict(trainer.sent())
    stats, _, outputs = sync(sender, receivers, trainer, tamper={1: corrupt})
    assert not stats.full_sync
    assert_bit_exact(outputs[0], reference)
    # the corrupted receiver diverged (a wrong value, or the sync not applied at all) and says so in its report
    same = set(outputs[1]) == set(reference) and all(torch.equal(bits(outputs[1][n]), bits(t))
                                                     for n, t in reference.items())
    assert not same
    assert receivers[1].report() != receivers[0].report()
    trainer.step()
    reference = dict(trainer.sent())
    stats, _, outputs = sync(sender, receivers, trainer)
    assert stats.full_sync and stats.full_resyncs == 1
    for out, r in zip(outputs, receivers):
        assert_bit_exact(out, reference)
        assert r.report() == ds.ReplicaReport(stats.sync_id, stats.checksum)


def test_a_delta_against_another_base_is_read_to_the_end_and_never_applied():
    trainer, sender, receiver = Trainer(), ds.DeltaSender(), ds.DeltaReceiver()
    sync(sender, [receiver], trainer)
    trainer.step()
    wire = list(sender.encode(trainer.sent(), ds.SyncMode.DELTA))
    stale = ds.DeltaReceiver()  # holds nothing
    consumed = []
    out = list(stale.apply(x for x in wire if not consumed.append(x)))
    assert out == [] and len(consumed) == len(wire)  # nothing handed on, everything read (no peer left waiting)
    assert stale.report() == ds.ReplicaReport(ds.NO_BASE, 0) and stale.apply_errors == 1


def test_scales_always_full_and_a_new_tensor_full():
    trainer, sender, receiver = Trainer(), ds.DeltaSender(), ds.DeltaReceiver()
    sync(sender, [receiver], trainer)
    trainer.step()
    trainer.weights["model.norm.weight"] = torch.ones(64)
    reference = dict(trainer.sent())
    stats, wire, (out,) = sync(sender, [receiver], trainer)
    assert_bit_exact(out, reference)
    headers = {n[len(ds.TENSOR_HEADER_PREFIX):]: int(t[0]) for n, t in wire if n.startswith(ds.TENSOR_HEADER_PREFIX)}
    assert all(code == 0 for n, code in headers.items() if n.endswith("weight_scale"))
    assert headers["model.norm.weight"] == 0
    assert headers["model.layers.0.self_attn.q_proj.weight"] == 2  # a few codes changed: gap varints


def test_a_sync_stopped_half_way_makes_the_next_full():
    """A transport error mid-sync: the sender's copy mixes two syncs, so it never sends a delta against it."""
    trainer, sender, receiver = Trainer(), ds.DeltaSender(), ds.DeltaReceiver()
    sync(sender, [receiver], trainer)
    trainer.step()
    wire = sender.encode(trainer.sent(), ds.SyncMode.DELTA)
    list(receiver.take(*next(wire)) for _ in range(5))  # the group broke: neither side finished
    wire.close()
    trainer.step()
    reference = dict(trainer.sent())
    stats, _, (out,) = sync(sender, [ds.DeltaReceiver()], trainer)
    assert stats.full_sync and stats.full_resyncs == 1 and "did not finish" in stats.reason
    assert_bit_exact(out, reference)
