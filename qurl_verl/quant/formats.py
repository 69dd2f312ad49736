"""The two 8-bit formats QuRL rolls out with (and narrower integer codes), and the granularities their scales
come in; ``scheme.QuantScheme`` pairs one of each.

Both formats are symmetric with no zero point, which is what vLLM's W8A8 kernels
(compressed-tensors INT8 and FP8) accept.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    name: str
    dtype: torch.dtype
    qmax: float  # largest code magnitude; scale = absmax / qmax
    compressed_tensors_type: str  # "int" | "float" in the quantization_config
    compressed_tensors_format: str  # "int-quantized" | "float-quantized"


# INT8 uses [-127, 127]: dropping -128 keeps the grid symmetric, so Q(-w) = -Q(w)
# and the codes of W/s and sX stay mirror images of each other (vLLM does the same).
INT8 = QuantFormat("int8", torch.int8, 127.0, "int", "int-quantized")
# E4M3 "fn": no infinities, largest finite value 448, 3 mantissa bits.
FP8_E4M3 = QuantFormat("fp8", torch.float8_e4m3fn, 448.0, "float", "float-quantized")

MIN_INT_BITS, MAX_INT_BITS = 4, 8


def int_format(bits: int) -> QuantFormat:
    """Symmetric b-bit integer codes, ±(2^(b-1) - 1), stored as int8 with ``scale = absmax / qmax``.

    Every b <= 8 runs through the same INT8 W8A8 kernel, so b < 8 is an exact W{b}A8 model, not
    an emulation: a research setting for larger rollout mismatch (and 4-bit rollout), and, at
    b = 7, codes whose pairwise u8 x s8 products cannot saturate oneDNN's 16-bit sums on CPUs
    without VNNI (255 * 63 * 2 = 32130 < 2^15).
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_INT_BITS <= bits <= MAX_INT_BITS:
        raise ValueError(f"integer weight codes take {MIN_INT_BITS}..{MAX_INT_BITS} bits, got {bits!r}")
    if bits == 8:
        return INT8
    return QuantFormat(f"int{bits}", torch.int8, float(2 ** (bits - 1) - 1), "int", "int-quantized")


def activation_format(weight_fmt: QuantFormat) -> QuantFormat:
    """Activations are always 8-bit in W{b}A8: INT8 beside any integer weight codes, else FP8."""
    return INT8 if weight_fmt.dtype == torch.int8 else FP8_E4M3


FORMATS = {"fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3, **{f"int{b}": int_format(b) for b in range(MIN_INT_BITS, MAX_INT_BITS + 1)}}


class Granularity(str, enum.Enum):
    """What one scale covers. Weight granularities act on a 2-D [out_features, in_features] matrix;
    activation granularities act on the last dimension of any tensor."""

    CHANNEL = "channel"  # weights: one scale per output row
    BLOCK = "block"  # weights: one per block_size x block_size tile
    TOKEN = "token"  # activations: one per row (token)
    GROUP = "group"  # activations: one per block_size consecutive elements of the last dimension

    @property
    def of_weights(self) -> bool:
        return self in WEIGHT_GRANULARITIES

    @property
    def activation(self) -> Granularity:
        """The activation granularity that pairs with this weight granularity in W8A8 (token for
        channel, 1 x block_size groups for block)."""
        if not self.of_weights:
            raise ValueError(f"{self.value!r} is an activation granularity")
        return Granularity.TOKEN if self is Granularity.CHANNEL else Granularity.GROUP

    def __str__(self) -> str:
        return self.value


WEIGHT_GRANULARITIES = (Granularity.CHANNEL, Granularity.BLOCK)
ACTIVATION_GRANULARITIES = (Granularity.TOKEN, Granularity.GROUP)
GRANULARITIES = WEIGHT_GRANULARITIES + ACTIVATION_GRANULARITIES

# verl's FP8 rollout and DeepSeek-style checkpoints use 128x128 weight blocks and
# 1x128 activation groups.
DEFAULT_BLOCK_SIZE = 128
