"""One tensor's change since the last sync, as bytes: the changed positions and their new values.

Between two syncs at a small learning rate most 8-bit codes (and most bf16 values of the rest) keep their
bits, so a sender that remembers what it last sent can send only the elements whose bits changed. Elements
compare by bit pattern (``-0.0`` and ``0.0`` differ, a NaN equals itself), so applying a delta to the
receiver's copy gives the sender's tensor bit for bit.

Positions travel in whichever index encoding is smaller at the tensor's density:

- ``bitmap``: one bit per element, ``ceil(numel / 8)`` bytes whatever changed (dense changes);
- ``gaps``: the gaps between successive changed positions as LEB128 varints (7 bits a byte), about
  ``log2(numel / changed) / 7`` bytes a position (sparse changes);

and the changed values follow as their raw bytes, in position order. When neither beats the tensor itself
(``numel * element_size`` bytes), the tensor is sent in ``full``. Pure torch, on any device.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int64)
_VARINT_MAX_BYTES = 9  # 63 bits of gap, more than any tensor has elements


class Encoding(str, enum.Enum):
    FULL = "full"
    BITMAP = "bitmap"
    GAPS = "gaps"


@dataclass(frozen=True)
class EncodedTensor:
    """What travels for one tensor: ``index`` (uint8, empty for ``full``) then ``values`` (uint8: the
    changed elements' bytes, or the whole tensor's)."""

    encoding: Encoding
    changed: int  # elements whose bits changed (numel for a full tensor)
    index: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.index.numel() + self.values.numel()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, as integers of its element size: equal exactly where the bit patterns are."""
    return t.detach().contiguous().view(-1).view(_SAME_SIZE_INT[t.element_size()])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, ascending) where ``new``'s bits differ from ``old``'s."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"a delta needs the same shape and dtype: {tuple(old.shape)} {old.dtype} vs "
                         f"{tuple(new.shape)} {new.dtype}")
    return torch.nonzero(_bits(old) != _bits(new)).view(-1)


def bitmap_bytes(numel: int) -> int:
    return (numel + 7) // 8


def gap_varint_lengths(positions: torch.Tensor) -> torch.Tensor:
    """Bytes of each position's gap varint (the first gap counts from -1): 1 for gaps below 128, ..."""
    gaps = torch.diff(positions, prepend=positions.new_full((1,), -1)) - 1
    lengths = torch.ones_like(gaps)
    for k in range(1, _VARINT_MAX_BYTES):
        lengths += gaps >= (1 << (7 * k))
    return lengths


def gaps_bytes(positions: torch.Tensor) -> int:
    return int(gap_varint_lengths(positions).sum()) if positions.numel() else 0


def encode_bitmap(positions: torch.Tensor, numel: int) -> torch.Tensor:
    """One bit per element (bit ``p % 8`` of byte ``p // 8``, least significant first)."""
    mask = torch.zeros(bitmap_bytes(numel) * 8, dtype=torch.int64, device=positions.device)
    mask[positions] = 1
    return (mask.view(-1, 8) * _BIT_WEIGHTS.to(positions.device)).sum(1).to(torch.uint8)


def decode_bitmap(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    if bitmap.dtype != torch.uint8 or bitmap.numel() != bitmap_bytes(numel):
        raise ValueError(f"a bitmap of {numel} elements is {bitmap_bytes(numel)} uint8 bytes, got "
                         f"{bitmap.numel()} {bitmap.dtype}")
    shifts = torch.arange(8, device=bitmap.device)
    mask = ((bitmap.to(torch.int64).view(-1, 1) >> shifts) & 1).view(-1)
    if mask[numel:].any():
        raise ValueError("the bitmap marks positions past the tensor's end")
    return torch.nonzero(mask[:numel]).view(-1)


def encode_gaps(positions: torch.Tensor) -> torch.Tensor:
    """LEB128 varints of the gaps between ascending positions (the first counted from -1)."""
    if positions.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=positions.device)
    gaps = torch.diff(positions, prepend=positions.new_full((1,), -1)) - 1
    lengths = gap_varint_lengths(positions)
    owner = torch.repeat_interleave(torch.arange(gaps.numel(), device=gaps.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(owner.numel(), device=gaps.device) - first[owner]
    byte = (gaps[owner] >> (7 * within)) & 0x7F
    byte |= (within < lengths[owner] - 1).to(torch.int64) << 7  # the continuation bit
    return byte.to(torch.uint8)


def decode_gaps(blob: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """The ``count`` ascending positions of ``encode_gaps``; refuses a blob that does not hold exactly that."""
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise ValueError(f"gap varints are a flat uint8 tensor, got {blob.dtype} {tuple(blob.shape)}")
    if count == 0:
        if blob.numel():
            raise ValueError(f"{blob.numel()} bytes of gaps for no changed position")
        return torch.empty(0, dtype=torch.int64, device=blob.device)
    b = blob.to(torch.int64)
    last = (b & 0x80) == 0
    ends = torch.nonzero(last).view(-1)
    if ends.numel() != count or not bool(last[-1]):
        raise ValueError(f"the gap varints hold {ends.numel()} positions (last byte complete: {bool(last[-1])}), "
                         f"{count} expected")
    lengths = torch.diff(ends, prepend=ends.new_full((1,), -1))
    if int(lengths.max()) > _VARINT_MAX_BYTES:
        raise ValueError(f"a gap varint of {int(lengths.max())} bytes (at most {_VARINT_MAX_BYTES})")
    owner = torch.repeat_interleave(torch.arange(count, device=blob.device), lengths)
    within = torch.arange(b.numel(), device=blob.device) - (ends - lengths + 1)[owner]
    gaps = torch.zeros(count, dtype=torch.int64, device=blob.device)
    gaps.index_add_(0, owner, (b & 0x7F) << (7 * within))
    positions = torch.cumsum(gaps + 1, 0) - 1
    if int(positions[-1]) >= numel:
        raise ValueError(f"a changed position {int(positions[-1])} past the tensor's {numel} elements")
    return positions


def encoded_sizes(positions: torch.Tensor, numel: int, element_size: int) -> dict[Encoding, int]:
    """Bytes each encoding would send for these changed positions."""
    values = positions.numel() * element_size
    return {Encoding.FULL: numel * element_size,
            Encoding.BITMAP: bitmap_bytes(numel) + values,
            Encoding.GAPS: gaps_bytes(positions) + values}


def choose_encoding(positions: torch.Tensor, numel: int, element_size: int) -> Encoding:
    """The smallest; ``full`` unless a delta is strictly smaller than the tensor."""
    sizes = encoded_sizes(positions, numel, element_size)
    best = min((Encoding.GAPS, Encoding.BITMAP), key=sizes.__getitem__)
    return best if sizes[best] < sizes[Encoding.FULL] else Encoding.FULL


def encode_full(new: torch.Tensor) -> EncodedTensor:
    return EncodedTensor(Encoding.FULL, new.numel(), torch.empty(0, dtype=torch.uint8, device=new.device),
                         _as_bytes(new))


def encode(old: torch.Tensor | None, new: torch.Tensor) -> EncodedTensor:
    """``new`` as a delta against ``old`` in the smaller index encoding, or in full when there is no ``old``
    or no delta is smaller."""
    if old is None:
        return encode_full(new)
    positions = changed_positions(old, new)
    encoding = choose_encoding(positions, new.numel(), new.element_size())
    if encoding is Encoding.FULL:
        return encode_full(new)
    index = encode_bitmap(positions, new.numel()) if encoding is Encoding.BITMAP else encode_gaps(positions)
    values = _as_bytes(_bits(new)[positions])
    return EncodedTensor(encoding, positions.numel(), index, values)


def decode_into(base: torch.Tensor | None, encoded: EncodedTensor, shape: torch.Size | tuple, dtype: torch.dtype
                ) -> torch.Tensor:
    """Apply ``encoded`` to ``base`` in place (a ``full`` one may come without a base: a new tensor is made)
    and return it. Refuses a payload whose sizes disagree with the tensor's."""
    numel = 1
    for size in shape:
        numel *= int(size)
    element_size = torch.empty(0, dtype=dtype).element_size()
    if encoded.values.dtype != torch.uint8 or encoded.values.numel() != encoded.changed * element_size:
        raise ValueError(f"{encoded.changed} changed {dtype} elements need {encoded.changed * element_size} value "
                         f"bytes, got {encoded.values.numel()} {encoded.values.dtype}")
    values = encoded.values.contiguous()
    if values.storage_offset() % element_size:  # a slice of a larger byte buffer: viewed wider only when aligned
        values = values.clone()
    if encoded.encoding is Encoding.FULL:
        if encoded.changed != numel or encoded.index.numel():
            raise ValueError(f"a full tensor of {numel} elements came as {encoded.changed} with an index")
        full = values.view(dtype).view(shape)
        if base is None:
            return full.clone()
        base.copy_(full)
        return base
    if base is None or tuple(base.shape) != tuple(shape) or base.dtype != dtype:
        raise ValueError(f"a delta needs the receiver's copy of the {tuple(shape)} {dtype} tensor, it has "
                         f"{None if base is None else (tuple(base.shape), base.dtype)}")
    if encoded.encoding is Encoding.BITMAP:
        positions = decode_bitmap(encoded.index, numel)
        if positions.numel() != encoded.changed:
            raise ValueError(f"the bitmap marks {positions.numel()} positions, {encoded.changed} expected")
    else:
        positions = decode_gaps(encoded.index, encoded.changed, numel)
    if not base.is_contiguous():
        raise ValueError("the receiver's copy must be contiguous to take a delta in place")
    _bits(base)[positions] = values.view(_SAME_SIZE_INT[element_size])
    return base
