"""The delta codec: a tensor's changed elements, encoded and applied to the receiver's copy, give the sender's
tensor bit for bit, at every density and dtype; the encoding chosen is the smallest and never larger than the
tensor; a payload that disagrees with the tensor is refused."""
import pytest
import torch

from qurl_verl.checkpoint_engine import delta_codec as dc

DTYPES = (torch.int8, torch.float8_e4m3fn, torch.bfloat16, torch.float32)
DENSITIES = (0.0, 1e-4, 1e-2, 0.5, 1.0)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def random_bits(shape, dtype, g):
    """Any bit pattern of the dtype (NaNs, infinities and -0.0 included), as a tensor of that dtype."""
    size = torch.empty(0, dtype=dtype).element_size()
    info = torch.iinfo(_INT[size])
    return torch.randint(info.min, info.max + 1, shape, generator=g, dtype=_INT[size]).view(dtype)


def changed_copy(t, density, g):
    """``t`` with exactly ``round(density * numel)`` elements given other bits (a positive xor)."""
    size = t.element_size()
    n = round(density * t.numel())
    where = torch.randperm(t.numel(), generator=g)[:n]
    bits = t.clone().view(-1).view(_INT[size])
    flip = torch.randint(1, 2 ** (8 * size - 1), (n,), generator=g, dtype=torch.int64).to(_INT[size])
    bits[where] ^= flip
    return bits.view(t.dtype).view(t.shape), n


def equal_bits(a, b):
    return torch.equal(a.contiguous().view(-1).view(_INT[a.element_size()]),
                       b.contiguous().view(-1).view(_INT[b.element_size()]))


def through_bytes(encoded):
    """What a receiver rebuilds from the wire: copies of the uint8 buffers, nothing shared with the sender."""
    return dc.EncodedTensor(encoded.encoding, encoded.changed, encoded.index.clone(), encoded.values.clone())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", DENSITIES)
def test_round_trip_is_bit_exact_at_every_density(dtype, density):
    g = torch.Generator().manual_seed(DTYPES.index(dtype) * 10 + DENSITIES.index(density))
    old = random_bits((301, 67), dtype, g)  # an odd size: the bitmap's last byte is partial
    new, n = changed_copy(old, density, g)
    encoded = dc.encode(old, new)
    full_bytes = new.numel() * new.element_size()
    assert encoded.nbytes <= full_bytes
    if encoded.encoding is not dc.Encoding.FULL:
        assert encoded.nbytes < full_bytes and encoded.changed == n
    receiver = old.clone()
    out = dc.decode_into(receiver, through_bytes(encoded), new.shape, dtype)
    assert out.data_ptr() == receiver.data_ptr()  # applied in place, on the receiver's copy
    assert equal_bits(receiver, new)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_chosen_encoding_is_the_smallest(dtype):
    """Against sizes computed here: a bitmap of numel/8 bytes, a varint of each gap, the tensor itself."""
    g = torch.Generator().manual_seed(7)
    old = random_bits((4096,), dtype, g)
    size = old.element_size()
    for density in DENSITIES:
        new, n = changed_copy(old, density, g)
        positions = [i for i, (a, b) in enumerate(zip(old.view(_INT[size]).tolist(), new.view(_INT[size]).tolist()))
                     if a != b]
        prev, gaps = -1, 0
        for p in positions:
            gap = p - prev - 1
            gaps += max(1, (gap.bit_length() + 6) // 7)
            prev = p
        sizes = {dc.Encoding.FULL: 4096 * size, dc.Encoding.BITMAP: 512 + n * size, dc.Encoding.GAPS: gaps + n * size}
        encoded = dc.encode(old, new)
        assert encoded.nbytes == min(sizes.values()), density
        assert sizes[encoded.encoding] == encoded.nbytes


def test_sparse_changes_go_as_gaps_dense_as_bitmap_all_as_full():
    g = torch.Generator().manual_seed(3)
    old = random_bits((100_000,), torch.int8, g)
    assert dc.encode(old, changed_copy(old, 1e-3, g)[0]).encoding is dc.Encoding.GAPS
    assert dc.encode(old, changed_copy(old, 0.2, g)[0]).encoding is dc.Encoding.BITMAP
    assert dc.encode(old, changed_copy(old, 0.95, g)[0]).encoding is dc.Encoding.FULL
    assert dc.encode(None, old).encoding is dc.Encoding.FULL
    unchanged = dc.encode(old, old.clone())
    assert (unchanged.encoding, unchanged.nbytes) == (dc.Encoding.GAPS, 0)


def test_gaps_of_every_varint_length():
    """Gaps of 0, 127, 128, 2**14 - 1, 2**14, 2**21, 2**28 + 5: one to five bytes each, decoded exactly."""
    positions = torch.tensor([0, 128, 257, 257 + 2**14, 258 + 2 * 2**14, 259 + 2 * 2**14 + 2**21,
                              260 + 2 * 2**14 + 2**21 + 2**28 + 5])
    blob = dc.encode_gaps(positions)
    assert blob.numel() == 1 + 1 + 2 + 2 + 3 + 4 + 5 == dc.gaps_bytes(positions)
    assert torch.equal(dc.decode_gaps(blob, positions.numel(), int(positions[-1]) + 1), positions)


def test_bitmap_round_trip_and_bit_order():
    positions = torch.tensor([0, 3, 8, 9, 20])
    bitmap = dc.encode_bitmap(positions, 21)
    assert bitmap.tolist() == [0b1001, 0b11, 0b10000]
    assert torch.equal(dc.decode_bitmap(bitmap, 21), positions)


def test_full_without_a_base_and_the_base_taken_in_place():
    g = torch.Generator().manual_seed(5)
    new = random_bits((33, 9), torch.bfloat16, g)
    out = dc.decode_into(None, through_bytes(dc.encode(None, new)), new.shape, torch.bfloat16)
    assert equal_bits(out, new)


def test_payloads_that_disagree_with_the_tensor_are_refused():
    g = torch.Generator().manual_seed(11)
    old = random_bits((1000,), torch.int8, g)
    new, _ = changed_copy(old, 1e-2, g)
    gaps = dc.encode(old, new)
    assert gaps.encoding is dc.Encoding.GAPS
    with pytest.raises(ValueError, match="positions"):  # one position more than the varints hold
        dc.decode_into(old.clone(), dc.EncodedTensor(gaps.encoding, gaps.changed + 1, gaps.index,
                                                     torch.cat([gaps.values, gaps.values[:1]])), old.shape, old.dtype)
    with pytest.raises(ValueError, match="value bytes"):
        dc.decode_into(old.clone(), dc.EncodedTensor(gaps.encoding, gaps.changed, gaps.index, gaps.values[1:]),
                       old.shape, old.dtype)
    truncated = gaps.index.clone()
    truncated[-1] |= 0x80  # the last varint never ends
    with pytest.raises(ValueError, match="expected"):
        dc.decode_into(old.clone(), dc.EncodedTensor(gaps.encoding, gaps.changed, truncated, gaps.values),
                       old.shape, old.dtype)
    with pytest.raises(ValueError, match="past the tensor"):
        dc.decode_gaps(dc.encode_gaps(torch.tensor([5, 1000])), 2, 1000)
    with pytest.raises(ValueError, match="past the tensor"):
        dc.decode_bitmap(torch.tensor([0, 0b100], dtype=torch.uint8), 10)
    with pytest.raises(ValueError, match="receiver's copy"):
        dc.decode_into(None, gaps, old.shape, old.dtype)
    with pytest.raises(ValueError, match="same shape"):
        dc.encode(old, new[:-1])
