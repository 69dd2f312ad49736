"""One quantization as one value: ``QuantScheme(codes, granularity, block_size)``.

Every entry point of ``qurl_verl.quant`` (``quantize``, ``quantize_state_dict``, the tracker, the
W8A8 reference layers) takes a scheme, the way torchao's ``quantize_`` takes one config object with
a typed granularity. Strings become a scheme in one place, ``parse_scheme``, for command lines and
Hydra values; the rollout's settings hand the scheme they mean (``RolloutSettings.quant_scheme``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .formats import DEFAULT_BLOCK_SIZE, FORMATS, FP8_E4M3, INT8, Granularity, QuantFormat, activation_format


@dataclass(frozen=True)
class QuantScheme:
    """Symmetric absmax quantization to ``codes`` with one scale per ``granularity`` unit;
    ``block_size`` is the tile (``block``) or group (``group``) width, unused by ``channel`` / ``token``."""

    codes: QuantFormat = INT8
    granularity: Granularity = Granularity.CHANNEL
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        if not isinstance(self.codes, QuantFormat):
            raise TypeError(f"QuantScheme.codes is a QuantFormat (INT8, FP8_E4M3, int_format(b)), got {self.codes!r}; "
                            "parse_scheme reads a name")
        if not isinstance(self.granularity, Granularity):
            raise TypeError(f"QuantScheme.granularity is a Granularity, got {self.granularity!r}; parse_scheme reads a name")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def activations(self) -> QuantScheme:
        """The dynamic activation scheme W8A8 pairs with this weight scheme: 8-bit codes (INT8 beside
        any integer weight codes, else FP8), per token for channel weights, 1 x block groups for block."""
        return QuantScheme(activation_format(self.codes), self.granularity.activation, self.block_size)

    def at(self, granularity: Granularity) -> QuantScheme:
        """The same codes and block size at another granularity."""
        return replace(self, granularity=granularity)

    def __str__(self) -> str:
        block = f", block_size={self.block_size}" if self.granularity in (Granularity.BLOCK, Granularity.GROUP) else ""
        return f"{self.codes.name} per {self.granularity.value}{block}"


INT8_CHANNEL = QuantScheme(INT8, Granularity.CHANNEL)  # vLLM's W8A8 INT8 weights
FP8_CHANNEL = QuantScheme(FP8_E4M3, Granularity.CHANNEL)  # vLLM's W8A8 FP8 weights
FP8_BLOCK = QuantScheme(FP8_E4M3, Granularity.BLOCK)  # 128 x 128 FP8 weight blocks (DeepSeek-style)
INT8_TOKEN = INT8_CHANNEL.activations  # dynamic per-token INT8 activations
FP8_TOKEN = FP8_CHANNEL.activations
FP8_GROUP = FP8_BLOCK.activations  # dynamic 1 x 128 FP8 activation groups


def parse_scheme(codes: str | QuantFormat, granularity: str | Granularity = Granularity.CHANNEL,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> QuantScheme:
    """A scheme from names, the one place strings are read (``"int8"``, ``"int4"``..``"int8"``, ``"fp8"``,
    ``"fp8_e4m3"``; ``"channel"``, ``"block"``, ``"token"``, ``"group"``): ``parse_scheme("fp8", "block")``."""
    if not isinstance(codes, QuantFormat):
        try:
            codes = FORMATS[str(codes).lower()]
        except KeyError:
            raise ValueError(f"unknown quantization format {codes!r}; choose one of {sorted(FORMATS)}") from None
    try:
        granularity = Granularity(granularity)
    except ValueError:
        raise ValueError(f"unknown granularity {granularity!r}; choose one of {[g.value for g in Granularity]}") from None
    return QuantScheme(codes, granularity, block_size)
