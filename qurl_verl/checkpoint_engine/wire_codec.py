"""The ``qurl_int8`` codec: what the trainer side puts into verl's buckets and how the rollout side reads it
back. Transport-free (pure torch; no verl, no vLLM), so both transports share it and it is tested on its own.

Encode (``WireEncoder``): ``quantize_state_dict`` of the trainer's tensors with the rollout's
``RolloutSettings`` (8-bit codes + fp32 ``weight_scale`` for the targeted linears), the full-precision rest
cast to the rollout's dtype, the names the rollout does not load dropped (a tied ``lm_head.weight``: verl's
FSDP stream carries it, the rollout's engine computes its logits from the embedding), each tensor contiguous
on the engine's device.

Alignment: verl's ``split_weight_chunks`` packs tensors back to back in a bucket and ``merge_weight_chunks``
reads each back with ``chunk.view(dtype)``, which fails at an offset that is not a multiple of the element
size. So every tensor on the wire is a whole number of ``ALIGN_BYTES``: one whose byte count is not (or is
zero: verl's splitter sends no chunk for an empty tensor) travels as a flat, zero-padded tensor preceded by
its shape header, an int64 tensor ``[ndim, *shape]`` (padded to an even length) under the reserved name
``SHAPE_HEADER_PREFIX + name``. The decoder (``WireDecoder``) trims and reshapes; the header is plain data,
validated before use.
"""
from __future__ import annotations

import math
import time
from collections.abc import AsyncGenerator, AsyncIterable, Generator, Iterable
from dataclasses import dataclass, field

import torch

from qurl_verl.quant.compressed_tensors_format import quantize_state_dict
from qurl_verl.rollout.sync_stats import StreamStats
from qurl_verl.settings import RolloutSettings

ALIGN_BYTES = 16
# a name no checkpoint tensor has (``:`` never appears in a module path)
SHAPE_HEADER_PREFIX = "qurl_int8.shape:"
MAX_DIMS = 8
# dtypes a tensor may travel in (codes, scales, the rest, shape headers): the receiver refuses any other
WIRE_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
                 "float8_e4m3fn", "float8_e5m2", "bool")
    if hasattr(torch, name)
}
REST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what ``rest_dtype`` may cast (codes and scales never)


class WireFormatError(ValueError):
    """Received data that this codec did not produce (malformed, oversized, out of order): nothing of it is used."""


def wire_dtype(name: str) -> torch.dtype:
    dtype = WIRE_DTYPES.get(name)
    if dtype is None:
        raise WireFormatError(f"dtype {name!r} is not one the qurl_int8 wire carries ({sorted(WIRE_DTYPES)})")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class TransferStats:
    """One sync as one side saw it: what the codec encoded and what crossed the group."""

    payload_bytes: int = 0  # tensor bytes in the buckets (padding and shape headers included)
    meta_bytes: int = 0  # bucket metadata (JSON) and per-bucket size headers
    buckets: int = 0
    tensors: int = 0  # tensors of the model sent (headers not counted)
    quantized: int = 0  # weights sent as 8-bit codes (one ``weight_scale`` each)
    skipped: int = 0  # tensors dropped before encoding (a tied lm_head)
    skipped_bytes: int = 0
    seconds: float = 0.0
    quantize_s: float = 0.0
    dtype_bytes: dict[str, int] = field(default_factory=dict)  # model tensors' bytes by dtype, before padding
    # ``StreamStats.add_checksum`` of the model tensors encoded (before padding): the rollout's stream reports the
    # same number for what it handed its engine when the codes arrived bit for bit
    checksum: int = 0

    def metrics(self, prefix: str = "qurl_sync") -> dict[str, float]:
        return {
            f"{prefix}/payload_bytes": float(self.payload_bytes),
            f"{prefix}/meta_bytes": float(self.meta_bytes),
            f"{prefix}/buckets": float(self.buckets),
            f"{prefix}/quantized_tensors": float(self.quantized),
            f"{prefix}/seconds": self.seconds,
            f"{prefix}/quantize_s": self.quantize_s,
            f"{prefix}/checksum": float(self.checksum),
        }


def needs_padding(t: torch.Tensor) -> bool:
    nbytes = t.numel() * t.element_size()
    return nbytes == 0 or nbytes % ALIGN_BYTES != 0


def shape_header(shape: torch.Size, device: torch.device) -> torch.Tensor:
    values = [len(shape), *shape]
    values += [0] * (len(values) % 2)  # int64 pairs: 16 bytes
    return torch.tensor(values, dtype=torch.int64, device=device)


def padded_numel(numel: int, element_size: int) -> int:
    """Elements of the padded flat form: a non-zero multiple of ``ALIGN_BYTES`` bytes."""
    per = ALIGN_BYTES // math.gcd(ALIGN_BYTES, element_size)  # elements per aligned unit
    return max(per, -(-numel // per) * per)


def padded_flat(t: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(padded_numel(t.numel(), t.element_size()), dtype=t.dtype, device=t.device)
    out[: t.numel()] = t.reshape(-1)
    return out


def aligned(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """What goes on the wire for one tensor: itself, or its shape header and its padded flat form."""
    if not needs_padding(t):
        return [(name, t)]
    return [(SHAPE_HEADER_PREFIX + name, shape_header(t.shape, t.device)), (name, padded_flat(t))]


def read_shape_header(header: torch.Tensor) -> tuple[int, ...]:
    if header.dtype != torch.int64 or header.dim() != 1 or header.numel() < 2 or header.numel() % 2:
        raise WireFormatError(f"a shape header must be an even-length 1-D int64 tensor, got {header.dtype} "
                              f"{tuple(header.shape)}")
    values = [int(v) for v in header.cpu().tolist()]
    ndim = values[0]
    if not 0 <= ndim <= MAX_DIMS or len(values) != ndim + 1 + (ndim + 1) % 2:
        raise WireFormatError(f"a shape header of {len(values)} values says {ndim} dimensions")
    shape = tuple(values[1: 1 + ndim])
    if any(d < 0 for d in shape) or any(values[1 + ndim:]):
        raise WireFormatError(f"a shape header holds an invalid shape {values}")
    return shape


@dataclass
class WireEncoder:
    """The trainer side of the codec.

    ``rest_dtype``: the dtype of the full-precision rest (None: as the trainer holds it). ``skip``: names not sent
    (the rollout does not load them). ``device``: where the encoded tensors are yielded."""

    settings: RolloutSettings
    rest_dtype: torch.dtype | None = torch.bfloat16
    skip: frozenset[str] = frozenset()
    device: torch.device = torch.device("cpu")

    def model_tensors(self, weights: Iterable[tuple[str, torch.Tensor]],
                      stats: TransferStats | None = None) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The rollout's tensors as it loads them (codes, scales, the rest in ``rest_dtype``), unpadded."""
        stats = stats if stats is not None else TransferStats()
        checksum = StreamStats()

        def kept():
            for name, tensor in weights:
                if name in self.skip:  # still pulled from the stream: producing it is collective over the actor
                    stats.skipped += 1
                    stats.skipped_bytes += tensor.numel() * tensor.element_size()
                    continue
                yield name, tensor

        s, clock = self.settings, time.perf_counter
        it = iter(quantize_state_dict(kept(), s.quant_scheme, ignore=s.ignore_patterns))
        while True:
            start = clock()
            try:
                name, tensor = next(it)
            except StopIteration:
                stats.checksum = checksum.checksum
                return
            stats.quantize_s += clock() - start
            stats.tensors += 1
            stats.quantized += name.endswith("weight_scale")
            if self.rest_dtype is not None and tensor.dtype in REST_DTYPES and not name.endswith("weight_scale"):
                tensor = tensor.to(self.rest_dtype)
            tensor = tensor.detach().to(self.device).contiguous()
            checksum.add_checksum(((name, tensor),))
            key = dtype_name(tensor.dtype)
            stats.dtype_bytes[key] = stats.dtype_bytes.get(key, 0) + tensor.numel() * tensor.element_size()
            yield name, tensor

    def encode(self, weights: Iterable[tuple[str, torch.Tensor]],
               stats: TransferStats | None = None) -> Generator[tuple[str, torch.Tensor], None, None]:
        """What goes into verl's buckets: ``model_tensors``, each aligned (``aligned``)."""
        for name, tensor in self.model_tensors(weights, stats):
            yield from aligned(name, tensor)


async def decode(received: AsyncIterable[tuple[str, torch.Tensor]],
                 stats: TransferStats | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
    """The rollout side of the codec: the model tensors back from the merged wire tensors (views, no copy)."""
    pending: tuple[str, tuple[int, ...]] | None = None
    async for name, tensor in received:
        if name.startswith(SHAPE_HEADER_PREFIX):
            if pending is not None:
                raise WireFormatError(f"shape header for {name[len(SHAPE_HEADER_PREFIX):]!r} while {pending[0]!r} "
                                      "is still awaited")
            pending = (name[len(SHAPE_HEADER_PREFIX):], read_shape_header(tensor))
            continue
        if pending is not None:
            target, shape = pending
            pending = None
            if name != target:
                raise WireFormatError(f"{name!r} arrived where the shape header announced {target!r}")
            numel = math.prod(shape)
            if tensor.dim() != 1 or tensor.numel() != padded_numel(numel, tensor.element_size()):
                raise WireFormatError(f"{name!r}: {tuple(tensor.shape)} is not the padded form of {shape}")
            tensor = tensor[:numel].view(shape)
        elif needs_padding(tensor):
            raise WireFormatError(f"{name!r} arrived unaligned ({tensor.numel() * tensor.element_size()} bytes) "
                                  "without a shape header")
        if stats is not None:
            stats.tensors += 1
        yield name, tensor
    if pending is not None:
        raise WireFormatError(f"the stream ended after the shape header of {pending[0]!r}")
