"""Plain-data messages between the ``qurl_int8`` ranks: bucket metadata (the CPU transport) and the rollout's
sync reports (both transports). JSON of names, numbers and dtype names only, never pickled objects: a peer's
bytes are parsed and validated, and anything malformed or oversized is refused with ``WireFormatError``
before any of it is used.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from .wire_codec import MAX_DIMS, WireFormatError, dtype_name, wire_dtype

MAX_META_BYTES = 8 << 20  # one bucket's metadata (a few hundred bytes per tensor)
MAX_BUCKET_TENSORS = 1 << 16
MAX_NAME_CHARS = 1024
# a report: an 8-byte little-endian length, then the JSON, zero-padded to this size (every rank sends as much)
REPORT_BYTES = 16 << 10
MAX_REPORT_STATS = 512
_LENGTH = struct.Struct("<q")


def _refuse(what: str) -> WireFormatError:
    return WireFormatError(f"qurl_int8: refused {what}")


# ---- bucket metadata ---------------------------------------------------------------------------------------
def encode_bucket_meta(entries: list[tuple[str, tuple[int, ...], torch.dtype, int, int, int]], length: int,
                       is_last: bool) -> bytes:
    """``entries``: (name, shape, dtype, chunk_offset, chunk_size, offset in the bucket) per chunk."""
    tensors = [[n, list(s), dtype_name(d), c, z, o] for n, s, d, c, z, o in entries]
    return json.dumps({"tensors": tensors, "length": length, "last": is_last}, separators=(",", ":")).encode()


def _int(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _refuse(f"bucket metadata: {what}={value!r}")
    return value


def decode_bucket_meta(data: bytes, bucket_size: int):
    """(entries as ``encode_bucket_meta`` takes them, length, is_last), every field checked: known dtypes,
    chunks inside their tensor and inside the bucket, in order and not overlapping, bounded counts."""
    if len(data) > MAX_META_BYTES:
        raise _refuse(f"bucket metadata of {len(data)} bytes (at most {MAX_META_BYTES})")
    try:
        meta = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise _refuse(f"bucket metadata that is not JSON ({exc})") from None
    if not isinstance(meta, dict) or set(meta) != {"tensors", "length", "last"} or not isinstance(meta["last"], bool):
        raise _refuse("bucket metadata without exactly tensors, length and last")
    length = _int(meta["length"], "length")
    if length > bucket_size:
        raise _refuse(f"a bucket of {length} bytes (the bucket size is {bucket_size})")
    tensors = meta["tensors"]
    if not isinstance(tensors, list) or len(tensors) > MAX_BUCKET_TENSORS:
        raise _refuse("bucket metadata whose tensors are not a list of bounded length")
    entries, end = [], 0
    for item in tensors:
        if not isinstance(item, list) or len(item) != 6:
            raise _refuse(f"bucket metadata entry {item!r}")
        name, shape, dtype, chunk_offset, chunk_size, offset = item
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise _refuse(f"bucket metadata: a tensor name {str(name)[:80]!r}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise _refuse(f"bucket metadata: {name!r} has shape {shape!r}")
        shape = tuple(_int(d, f"{name} dimension") for d in shape)
        if not isinstance(dtype, str):
            raise _refuse(f"bucket metadata: {name!r} has dtype {dtype!r}")
        torch_dtype = wire_dtype(dtype)
        nbytes = math.prod(shape) * torch_dtype.itemsize
        chunk_offset, chunk_size = _int(chunk_offset, f"{name} chunk_offset"), _int(chunk_size, f"{name} chunk_size", 1)
        offset = _int(offset, f"{name} offset")
        if chunk_offset + chunk_size > nbytes or offset < end or offset + chunk_size > length:
            raise _refuse(f"bucket metadata: {name!r} bytes {offset}..{offset + chunk_size} (chunk at {chunk_offset} of "
                          f"{nbytes}) outside its tensor or the {length}-byte bucket, or overlapping the previous one")
        end = offset + chunk_size
        entries.append((name, shape, torch_dtype, chunk_offset, chunk_size, offset))
    return entries, length, meta["last"]


# ---- reports -----------------------------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def pack_report(report: tuple[int, dict] | None) -> torch.Tensor:
    """A rank's report of the previous sync (``sync_stats.take_rollout_report``; None: nothing to report) as a
    fixed-size uint8 tensor: its numbers only (names and numbers; strings and flags are not metrics)."""
    out = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
    if report is None:
        return out
    replica, stats = report
    numbers = {str(k): v for k, v in stats.items() if _number(v)}
    data = json.dumps({"replica": int(replica), "stats": numbers}, separators=(",", ":")).encode()
    if len(data) > REPORT_BYTES - _LENGTH.size or len(numbers) > MAX_REPORT_STATS:
        raise ValueError(f"qurl_int8: a sync report of {len(numbers)} numbers takes {len(data)} bytes; the report "
                         f"channel carries at most {MAX_REPORT_STATS} numbers in {REPORT_BYTES - _LENGTH.size} bytes")
    out[: _LENGTH.size] = torch.frombuffer(bytearray(_LENGTH.pack(len(data))), dtype=torch.uint8)
    out[_LENGTH.size: _LENGTH.size + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def unpack_report(packed: torch.Tensor) -> tuple[int, dict] | None:
    """``pack_report``'s inverse, validated: a replica rank and a flat dict of numbers, or None."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != REPORT_BYTES:
        raise _refuse(f"a report of {packed.dtype} {tuple(packed.shape)} (a uint8 tensor of {REPORT_BYTES} bytes)")
    raw = packed.cpu().numpy().tobytes()
    (length,) = _LENGTH.unpack_from(raw)
    if length == 0:
        return None
    if not 0 < length <= REPORT_BYTES - _LENGTH.size:
        raise _refuse(f"a report whose length field says {length} bytes")
    try:
        report = json.loads(raw[_LENGTH.size: _LENGTH.size + length].decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise _refuse(f"a report that is not JSON ({exc})") from None
    if not isinstance(report, dict) or set(report) != {"replica", "stats"}:
        raise _refuse("a report without exactly replica and stats")
    replica, stats = report["replica"], report["stats"]
    if isinstance(replica, bool) or not isinstance(replica, int) or replica < 0:
        raise _refuse(f"a report of replica {replica!r}")
    if not isinstance(stats, dict) or len(stats) > MAX_REPORT_STATS:
        raise _refuse("a report whose stats are not a bounded dict")
    for key, value in stats.items():
        if len(key) > MAX_NAME_CHARS or not _number(value):
            raise _refuse(f"a report stat {key[:80]!r}={value!r} (numbers only)")
    return replica, stats
