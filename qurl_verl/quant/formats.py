"""The two 8-bit formats QuRL rolls out with, and the granularities their scales come in.

Both formats are symmetric with no zero point, which is what vLLM's W8A8 kernels
(compressed-tensors INT8 and FP8) accept.
"""
from __future__ import annotations

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

FORMATS = {"int8": INT8, "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3}

# Weight granularities act on a 2-D [out_features, in_features] matrix;
# activation granularities act on the last dimension of any tensor.
WEIGHT_GRANULARITIES = ("channel", "block")
ACTIVATION_GRANULARITIES = ("token", "group")
GRANULARITIES = WEIGHT_GRANULARITIES + ACTIVATION_GRANULARITIES

# verl's FP8 rollout and DeepSeek-style checkpoints use 128x128 weight blocks and
# 1x128 activation groups.
DEFAULT_BLOCK_SIZE = 128

# Activation granularity that pairs with each weight granularity in W8A8.
ACTIVATION_FOR_WEIGHT = {"channel": "token", "block": "group"}


def resolve_format(fmt: str | QuantFormat) -> QuantFormat:
    if isinstance(fmt, QuantFormat):
        return fmt
    try:
        return FORMATS[str(fmt).lower()]
    except KeyError:
        raise ValueError(f"unknown quantization format {fmt!r}; choose one of {sorted(FORMATS)}") from None


def check_granularity(granularity: str) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose one of {list(GRANULARITIES)}")
    return granularity
