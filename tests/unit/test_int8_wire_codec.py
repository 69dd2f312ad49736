"""The ``qurl_int8`` codec and its plain-data messages, without a transport: every tensor verl's splitter packs is
a whole number of 16 bytes (so ``merge_weight_chunks``' ``view(dtype)`` works at any offset), the decoder gives
back the encoder's tensors bit for bit through verl's own split and merge; bucket metadata and reports are
JSON, and anything malformed or oversized is refused before use."""
from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch
from verl.checkpoint_engine.base import merge_weight_chunks, split_weight_chunks

from qurl_verl.checkpoint_engine import wire_messages as wm
from qurl_verl.checkpoint_engine.wire_codec import (
    SHAPE_HEADER_PREFIX,
    WIRE_DTYPES,
    WireEncoder,
    WireFormatError,
    aligned,
    decode,
)
from qurl_verl.settings import RolloutSettings

ODD_SHAPES = [(), (0,), (1,), (3,), (5, 3), (7, 1), (2, 3, 5), (17,), (4, 4)]


def odd_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:  # a bool byte is 0 or 1
        bits &= 1
    return bits[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


async def through_verl(stream, bucket_size: int, decoded: bool = True):
    """verl's sender and receiver with nothing between them: chunks placed back to back in one byte bucket, as
    ``NCCLCheckpointEngine`` does, then merged as its receiver does."""
    metas, bucket = [], torch.zeros(0, dtype=torch.uint8)
    async for meta, chunk in split_weight_chunks(stream, bucket_size):
        meta.offset = bucket.numel()
        bucket = torch.cat([bucket, chunk])
        metas.append(meta)

    async def chunks():
        for meta in metas:
            yield meta, bucket[meta.offset: meta.offset + meta.chunk_size]

    merged = merge_weight_chunks(chunks(), bucket_size)
    return [(n, t.clone()) async for n, t in (decode(merged) if decoded else merged)]


def test_odd_sized_tensors_of_every_dtype_cross_verls_buckets_bit_for_bit():
    tensors = [(f"t.{str(d)[6:]}.{i}", odd_tensor(d, s, i)) for d in WIRE_DTYPES.values() for i, s in enumerate(ODD_SHAPES)]
    wire = [item for name, t in tensors for item in aligned(name, t)]
    # every tensor on the wire is a non-zero multiple of 16 bytes: each offset in a bucket is aligned
    assert all(t.numel() * t.element_size() % 16 == 0 and t.numel() > 0 for _, t in wire)
    assert any(n.startswith(SHAPE_HEADER_PREFIX) for n, _ in wire)
    # a bucket size that splits some tensors across chunks, and one that holds them whole
    for bucket_size in (64, 1 << 20):
        got = asyncio.run(through_verl(iter(wire), bucket_size))
        assert [n for n, _ in got] == [n for n, _ in tensors]
        for (name, g), (_, want) in zip(got, tensors):
            assert g.dtype == want.dtype and g.shape == want.shape and torch.equal(as_bits(g), as_bits(want)), name


def test_without_alignment_verls_merge_fails_on_a_misaligned_offset():
    """Why the codec pads: 3 int8 codes before an fp32 tensor leave it at offset 3 of the bucket, which verl's
    ``view(float32)`` refuses; aligned, the same stream crosses."""
    stream = [("codes", torch.ones(3, dtype=torch.int8)), ("scale", torch.ones(4))]
    with pytest.raises(RuntimeError):
        asyncio.run(through_verl(iter(stream), 1 << 20, decoded=False))
    aligned_stream = [item for n, t in stream for item in aligned(n, t)]
    got = asyncio.run(through_verl(iter(aligned_stream), 1 << 20))
    assert [(n, t.tolist()) for n, t in got] == [(n, t.tolist()) for n, t in stream]


def test_the_encoder_leaves_out_a_tied_lm_head_and_sends_the_rest_in_the_rollouts_dtype():
    state = {"model.embed_tokens.weight": torch.randn(11, 16), "model.layers.0.mlp.up_proj.weight": torch.randn(24, 16),
             "model.norm.weight": torch.randn(16), "lm_head.weight": torch.randn(11, 16)}
    encoder = WireEncoder(RolloutSettings(format="int8"), skip=frozenset({"lm_head.weight"}))
    from qurl_verl.checkpoint_engine.wire_codec import TransferStats

    stats = TransferStats()
    sent = dict(encoder.model_tensors(state.items(), stats))
    assert "lm_head.weight" not in sent and stats.skipped == 1 and stats.skipped_bytes == 11 * 16 * 4
    assert sent["model.embed_tokens.weight"].dtype == sent["model.norm.weight"].dtype == torch.bfloat16
    assert sent["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    assert sent["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.float32
    assert torch.equal(sent["model.norm.weight"], state["model.norm.weight"].to(torch.bfloat16))
    assert stats.quantized == 1 and stats.tensors == 4


@pytest.mark.parametrize("stream,match", [
    ([(SHAPE_HEADER_PREFIX + "a", torch.tensor([1, 3])), ("b", torch.zeros(4))], "announced 'a'"),
    ([(SHAPE_HEADER_PREFIX + "a", torch.tensor([1, 3]))], "ended after the shape header"),
    ([(SHAPE_HEADER_PREFIX + "a", torch.tensor([1, 3])), ("a", torch.zeros(8))], "not the padded form"),
    ([(SHAPE_HEADER_PREFIX + "a", torch.tensor([9, 3]))], "says 9 dimensions"),
    ([(SHAPE_HEADER_PREFIX + "a", torch.tensor([1, -3])), ("a", torch.zeros(4))], "invalid shape"),
    ([(SHAPE_HEADER_PREFIX + "a", torch.tensor([1.0, 3.0]))], "int64"),
    ([("a", torch.zeros(3))], "unaligned"),
])
def test_the_decoder_refuses_a_stream_the_encoder_did_not_produce(stream, match):
    async def received():
        for item in stream:
            yield item

    async def drain():
        return [item async for item in decode(received())]

    with pytest.raises(WireFormatError, match=match):
        asyncio.run(drain())


# ---- bucket metadata ------------------------------------------------------------------------------------------
def meta(tensors, length=64, last=True) -> bytes:
    return json.dumps({"tensors": tensors, "length": length, "last": last}).encode()


def test_bucket_metadata_round_trips_as_json():
    entries = [("a.weight", (4, 4), torch.int8, 0, 16, 0), ("a.weight_scale", (4, 1), torch.float32, 0, 16, 16),
               ("b", (40,), torch.float8_e4m3fn, 8, 32, 32)]
    data = wm.encode_bucket_meta(entries, 64, False)
    assert json.loads(data)["tensors"][0] == ["a.weight", [4, 4], "int8", 0, 16, 0]
    assert wm.decode_bucket_meta(data, 64) == (entries, 64, False)


@pytest.mark.parametrize("data,match", [
    (b"\x80\x04K\x01.", "not JSON"),  # a pickle
    (meta([["a", [4], "object", 0, 16, 0]]), "dtype 'object'"),
    (meta([["a", [4], "float32", 0, 16, 60]]), "outside"),  # past the bucket's length
    (meta([["a", [4], "float32", 8, 16, 0]]), "outside"),  # past the tensor's bytes
    (meta([["a", [4], "float32", 0, 16, 0], ["b", [4], "float32", 0, 16, 8]]), "overlapping"),
    (meta([["a", [4], "float32", 0, 16, 0]], length=1 << 30), "bucket size"),
    (meta([["a", [-4], "float32", 0, 16, 0]]), "dimension"),
    (meta([["a", [1] * 9, "float32", 0, 4, 0]]), "shape"),
    (meta([["", [4], "float32", 0, 16, 0]]), "name"),
    (meta([["a", [4], "float32", 0, True, 0]]), "chunk_size"),
    (json.dumps({"tensors": [], "length": 0}).encode(), "exactly"),
    (b" " * (wm.MAX_META_BYTES + 1), "at most"),
])
def test_malformed_or_oversized_bucket_metadata_is_refused(data, match):
    with pytest.raises(WireFormatError, match=match):
        wm.decode_bucket_meta(data, 1 << 10)


# ---- reports --------------------------------------------------------------------------------------------------
def test_a_report_crosses_as_numbers_in_a_fixed_size_tensor():
    packed = wm.pack_report((3, {"checksum": 2**40 - 100, "total_s": 1.5, "format": "int8", "quantized_frac": None,
                                 "flag": True}))
    assert packed.dtype == torch.uint8 and packed.numel() == wm.REPORT_BYTES
    assert wm.unpack_report(packed) == (3, {"checksum": 2**40 - 100, "total_s": 1.5})
    assert wm.pack_report(None).numel() == wm.REPORT_BYTES and wm.unpack_report(wm.pack_report(None)) is None
    with pytest.raises(ValueError, match="at most"):
        wm.pack_report((0, {f"stat_{i}": i for i in range(wm.MAX_REPORT_STATS + 1)}))


def raw_report(body: bytes, length: int | None = None) -> torch.Tensor:
    out = torch.zeros(wm.REPORT_BYTES, dtype=torch.uint8)
    data = struct.pack("<q", len(body) if length is None else length) + body
    out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


@pytest.mark.parametrize("packed,match", [
    (raw_report(b"{}", length=wm.REPORT_BYTES), "length field"),
    (raw_report(b"{}", length=-5), "length field"),
    (raw_report(b"\x80\x04N."), "not JSON"),
    (raw_report(b'{"replica": 0}'), "exactly"),
    (raw_report(b'{"replica": -1, "stats": {}}'), "replica"),
    (raw_report(b'{"replica": 0, "stats": {"a": "x"}}'), "numbers only"),
    (raw_report(b'{"replica": 0, "stats": {"a": NaN}}'), "numbers only"),
    (torch.zeros(7, dtype=torch.uint8), "uint8 tensor of"),
])
def test_malformed_or_oversized_reports_are_refused(packed, match):
    with pytest.raises(WireFormatError, match=match):
        wm.unpack_report(packed)


def test_the_sender_refuses_a_malformed_report_among_the_gathered_ones():
    """The engine reads the gathered reports with ``unpack_report``: one malformed report fails the sender's call
    (after its sync), naming what was refused; empty slots (the actor side's) are skipped."""
    from qurl_verl.checkpoint_engine.int8_engine import QurlInt8CheckpointEngine

    good = wm.pack_report((0, {"checksum": 5}))
    assert QurlInt8CheckpointEngine.unpack_reports([wm.pack_report(None), good]) == [(0, {"checksum": 5})]
    with pytest.raises(WireFormatError, match="numbers only"):
        QurlInt8CheckpointEngine.unpack_reports([good, raw_report(b'{"replica": 1, "stats": {"a": [1]}}')])
