"""The ``qurl_vllm`` rollout group: ``actor_rollout_ref.rollout.{quantization, custom.qurl.*}``.

Read from verl's config in the driver, the vLLM server and the trainer's adapter; the server hands them
to the engine's workers once, as data, in vLLM's ``additional_config`` (``ENGINE_CONFIG_KEY``), visible in
every worker (``additional_config`` / ``from_additional_config``).

A new ``custom.qurl`` setting is a field of ``RolloutSettings``, its name in ``ROLLOUT_CUSTOM_KEYS``, its
default beside the others, and its check in ``__post_init__``.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qurl_verl.quant.compressed_tensors_format import (
    DEFAULT_IGNORE,
    EXPERTS_IGNORE,
    ROUTER_MODULES,
    compressed_tensors_config,
    vllm_ignore_patterns,
)
from qurl_verl.quant.formats import MAX_INT_BITS, MIN_INT_BITS, int_format
from qurl_verl.quant.scheme import FP8_BLOCK, FP8_CHANNEL, INT8_CHANNEL, QuantScheme
from qurl_verl.quant.update_visibility import DEFAULT_TRACKER_MAX_BYTES

from .errors import QurlConfigError, is_number
from .keys import QUANTIZATION_KEY, ROLLOUT_CUSTOM_KEY, ROLLOUT_KEY, ROLLOUT_NAME, select, show


class RolloutFormat(str, enum.Enum):
    """``actor_rollout_ref.rollout.quantization`` values of ``qurl_vllm``."""

    INT8 = "int8"  # W8A8 INT8: per-output-channel weights, dynamic per-token activations
    FP8 = "fp8"  # the same layout with FP8 E4M3 codes
    FP8_BLOCK = "fp8_block"  # FP8 E4M3, 128x128 weight blocks, 1x128 activation groups
    BF16 = "bf16"  # no quantization, through the same reload path: the full-precision baseline

    @property
    def quantized(self) -> bool:
        return self is not RolloutFormat.BF16

    @property
    def engine_scheme(self) -> QuantScheme | None:
        """The ``qurl_verl.quant`` scheme the engine's kernels hold (INT8 or FP8 codes, whatever ``weight_bits``),
        None for bf16; ``RolloutSettings.quant_scheme`` is what the stream quantizes to."""
        return {RolloutFormat.INT8: INT8_CHANNEL, RolloutFormat.FP8: FP8_CHANNEL, RolloutFormat.FP8_BLOCK: FP8_BLOCK}.get(self)


class ExpertsPrecision(str, enum.Enum):
    """``custom.qurl.experts``: how ``qurl_vllm`` runs the routed experts of a Mixture-of-Experts model."""

    BF16 = "bf16"  # full precision (the engine's dtype) in vLLM's unquantized MoE kernels, on every platform
    QUANTIZED = "quantized"  # in the rollout format, where the installed vLLM runs them W8A8 (check_quantized_experts)


class KVCacheFormat(str, enum.Enum):
    """``custom.qurl.kv_cache``: what the ``qurl_vllm`` engine stores its KV cache in."""

    AUTO = "auto"  # the engine's dtype (bf16), vLLM's kv_cache_dtype=auto
    FP8 = "fp8"  # FP8 E4M3, one K and one V scale per layer, computed by the trainer and sent with every sync

    @property
    def engine_dtype(self) -> str:
        """vLLM's ``kv_cache_dtype`` (E4M3 named explicitly: the format ``qurl_verl.quant.kv_cache`` computes scales for)."""
        return {KVCacheFormat.AUTO: "auto", KVCacheFormat.FP8: "fp8_e4m3"}[self]

    @property
    def quantized(self) -> bool:
        return self is not KVCacheFormat.AUTO


DEFAULT_ROLLOUT_FORMAT = RolloutFormat.INT8
DEFAULT_EXPERTS = ExpertsPrecision.BF16
DEFAULT_KV_CACHE = KVCacheFormat.AUTO
DEFAULT_CODE_CHANGE_ROW_STRIDE = 8
DEFAULT_WEIGHT_BITS = MAX_INT_BITS
# host memory of the tracker per vLLM worker (the pure layer's cap); the stride rises to fit
DEFAULT_CODE_CHANGE_MAX_MB = DEFAULT_TRACKER_MAX_BYTES // 2**20
ENGINE_CONFIG_KEY = "qurl"  # where the settings travel in vLLM's additional_config
ROLLOUT_CUSTOM_KEYS = ("ignore", "code_change_row_stride", "code_change_max_mb", "weight_bits", "experts", "kv_cache")


@dataclass(frozen=True)
class RolloutSettings:
    """What the ``qurl_vllm`` engine generates with.

    format: ``actor_rollout_ref.rollout.quantization`` (default int8).
    ignore: ``custom.qurl.ignore``, linear layers kept in full precision: full module names, ``re:``
        patterns, or a name suffix such as ``down_proj`` (emitted as the anchored ``re:`` pattern
        vLLM matches); ``lm_head`` always is. Fused layers (q/k/v, gate/up) are kept together or not at all.
    code_change_row_stride: ``custom.qurl.code_change_row_stride``, track the share of 8-bit codes
        each sync changes on every Nth row of each quantized weight (0 = off).
    code_change_max_mb: ``custom.qurl.code_change_max_mb``, host memory (MiB) the tracker may hold in
        each vLLM worker (never accelerator memory); the row stride is raised, in powers of two, to fit.
    weight_bits: ``custom.qurl.weight_bits`` (int8 only), weight codes within ±(2^(b-1)-1), b = 4..8:
        an exact W{b}A8 model in the same INT8 kernel. A research setting (more rollout mismatch,
        the step toward 4-bit rollout), and b = 7 keeps oneDNN's INT8 GEMM exact in one pass on
        CPUs without VNNI. Not a speed-up on GPUs.
    experts: ``custom.qurl.experts`` (MoE models), ``bf16`` (default): routed experts in full
        precision, attention and dense layers in 8 bits; ``quantized``: experts in the rollout
        format too, where the installed vLLM runs them W8A8 (``check_quantized_experts``). The
        routers (``ROUTER_MODULES``) always stay in full precision.
    kv_cache: ``custom.qurl.kv_cache``, ``auto`` (default): the KV cache in the engine's dtype;
        ``fp8``: FP8 E4M3 with per-layer K and V scales that the actor computes from its training
        forwards and sends with every weight sync (at the first sync, before any, the engine bounds them
        from the streamed weights, so that nothing clips).
    """

    format: RolloutFormat = DEFAULT_ROLLOUT_FORMAT
    ignore: tuple[str, ...] = ()
    code_change_row_stride: int = DEFAULT_CODE_CHANGE_ROW_STRIDE
    code_change_max_mb: float = DEFAULT_CODE_CHANGE_MAX_MB
    weight_bits: int = DEFAULT_WEIGHT_BITS
    experts: ExpertsPrecision = DEFAULT_EXPERTS
    kv_cache: KVCacheFormat = DEFAULT_KV_CACHE

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cache, KVCacheFormat):
            try:
                object.__setattr__(self, "kv_cache", KVCacheFormat(str(self.kv_cache).lower()))
            except ValueError:
                raise QurlConfigError(
                    f"{ROLLOUT_CUSTOM_KEY}.kv_cache={show(self.kv_cache)}: must be one of "
                    f"{', '.join(k.value for k in KVCacheFormat)} (default {DEFAULT_KV_CACHE.value})"
                ) from None
        if not isinstance(self.experts, ExpertsPrecision):
            try:
                object.__setattr__(self, "experts", ExpertsPrecision(str(self.experts).lower()))
            except ValueError:
                raise QurlConfigError(
                    f"{ROLLOUT_CUSTOM_KEY}.experts={show(self.experts)}: must be one of "
                    f"{', '.join(e.value for e in ExpertsPrecision)} (default {DEFAULT_EXPERTS.value})"
                ) from None
        if not isinstance(self.format, RolloutFormat):
            try:
                object.__setattr__(self, "format", RolloutFormat(str(self.format).lower()))
            except ValueError:
                raise QurlConfigError(
                    f"{QUANTIZATION_KEY}={show(self.format)} is not a {ROLLOUT_NAME} format; use one of "
                    f"{', '.join(f.value for f in RolloutFormat)} (e.g. {QUANTIZATION_KEY}=int8)"
                ) from None
        self._check_tracker()
        self._check_weight_codes()
        if any(not isinstance(p, str) or not p for p in self.ignore):
            raise QurlConfigError(
                f"{ROLLOUT_CUSTOM_KEY}.ignore={show(list(self.ignore))}: must be a list of module names or 're:' patterns"
            )

    def _check_tracker(self) -> None:
        stride = self.code_change_row_stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
            raise QurlConfigError(
                f"{ROLLOUT_CUSTOM_KEY}.code_change_row_stride={show(stride)}: must be an integer >= 0 (0 = off)"
            )
        if not is_number(self.code_change_max_mb) or self.code_change_max_mb <= 0:
            raise QurlConfigError(
                f"{ROLLOUT_CUSTOM_KEY}.code_change_max_mb={show(self.code_change_max_mb)}: must be a number > 0 "
                f"(MiB of host memory per rollout worker; default {DEFAULT_CODE_CHANGE_MAX_MB})"
            )

    def _check_weight_codes(self) -> None:
        bits = self.weight_bits
        if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_INT_BITS <= bits <= MAX_INT_BITS:
            raise QurlConfigError(
                f"{ROLLOUT_CUSTOM_KEY}.weight_bits={show(bits)}: must be an integer from {MIN_INT_BITS} to "
                f"{MAX_INT_BITS} (default {DEFAULT_WEIGHT_BITS})"
            )
        if bits != DEFAULT_WEIGHT_BITS and self.format is not RolloutFormat.INT8:
            raise QurlConfigError(
                f"{ROLLOUT_CUSTOM_KEY}.weight_bits={bits} with {QUANTIZATION_KEY}={self.format.value}: narrower codes "
                f"exist for integer weights only; set {QUANTIZATION_KEY}=int8 or remove weight_bits"
            )
        if self.experts is ExpertsPrecision.QUANTIZED and not self.format.quantized:
            raise QurlConfigError(
                f"{ROLLOUT_CUSTOM_KEY}.experts=quantized with {QUANTIZATION_KEY}={self.format.value}: a bf16 rollout "
                f"quantizes nothing; set {QUANTIZATION_KEY}=fp8 or int8, or remove experts"
            )

    @property
    def quantized(self) -> bool:
        return self.format.quantized

    @property
    def code_change_max_bytes(self) -> int:
        return int(self.code_change_max_mb * 2**20)

    @property
    def quant_scheme(self) -> QuantScheme | None:
        """The ``qurl_verl.quant`` scheme the weight stream, the export and the tracker quantize with (``int<b>``
        codes per channel for int8, FP8 per channel or in 128 x 128 blocks), None for bf16."""
        scheme = self.format.engine_scheme
        if self.format is RolloutFormat.INT8:
            return QuantScheme(int_format(self.weight_bits), scheme.granularity, scheme.block_size)
        return scheme

    @property
    def ignore_patterns(self) -> tuple[str, ...]:
        """The full ``ignore`` list as vLLM matches it: what is always full precision (lm_head, MoE routers),
        the routed experts unless they are quantized, then the user's. Patterns that match no module of
        a dense model cost nothing there, so one list serves every supported architecture."""
        fixed = (*DEFAULT_IGNORE, *ROUTER_MODULES, *((EXPERTS_IGNORE,) if self.experts is ExpertsPrecision.BF16 else ()))
        return vllm_ignore_patterns((*fixed, *self.ignore))

    def quantization_config(self) -> dict | None:
        """The compressed-tensors ``quantization_config`` the engine is built with (None for bf16)."""
        if not self.quantized:
            return None
        return compressed_tensors_config(self.format.engine_scheme, ignore=self.ignore_patterns)

    def engine_quantization(self) -> tuple[str | None, dict]:
        """(vLLM ``quantization``, ``hf_overrides``): what verl's server passes to the engine."""
        config = self.quantization_config()
        return (None, {}) if config is None else ("compressed-tensors", {"quantization_config": config})

    def merged_hf_overrides(self, user: Mapping[str, Any] | None) -> dict:
        """The user's ``engine_kwargs.vllm.hf_overrides`` with the engine's ``quantization_config`` added.

        verl passes ``engine_kwargs`` after its own ``hf_overrides`` (``**engine_kwargs`` last), so a user's
        ``hf_overrides`` (e.g. ``max_position_embeddings`` for a longer context) would replace the quantization
        config; the server merges both here. The quantization config belongs to the preset."""
        merged = dict((user or {}).items())
        extra = self.engine_quantization()[1]
        if "quantization_config" in merged and extra:
            raise QurlConfigError(
                f"{ROLLOUT_KEY}.engine_kwargs.vllm.hf_overrides.quantization_config: {ROLLOUT_NAME} builds the engine's "
                "quantization config from rollout.quantization; remove that key"
            )
        merged.update(extra)
        return merged

    @classmethod
    def from_rollout_config(cls, rollout: Any) -> RolloutSettings:
        """From verl's rollout config (``RolloutConfig`` or the ``actor_rollout_ref.rollout`` node)."""
        custom = select(rollout, "custom.qurl", {})
        if not (isinstance(custom, Mapping) or hasattr(custom, "items")):
            raise QurlConfigError(f"{ROLLOUT_CUSTOM_KEY}={show(custom)}: must be a mapping of {ROLLOUT_NAME} settings")
        custom = dict(custom.items())
        unknown = sorted(set(custom) - set(ROLLOUT_CUSTOM_KEYS))
        if unknown:
            raise QurlConfigError(
                f"unknown key(s) {', '.join(f'{ROLLOUT_CUSTOM_KEY}.{k}' for k in unknown)}; "
                f"{ROLLOUT_NAME} reads only: {', '.join(ROLLOUT_CUSTOM_KEYS)}"
            )
        ignore = custom.get("ignore") or ()
        fmt = select(rollout, "quantization")
        return cls(
            format=DEFAULT_ROLLOUT_FORMAT if fmt is None else fmt,
            ignore=(ignore,) if isinstance(ignore, str) else tuple(ignore),
            code_change_row_stride=custom.get("code_change_row_stride", DEFAULT_CODE_CHANGE_ROW_STRIDE),
            code_change_max_mb=custom.get("code_change_max_mb", DEFAULT_CODE_CHANGE_MAX_MB),
            weight_bits=custom.get("weight_bits", DEFAULT_WEIGHT_BITS),
            experts=custom.get("experts") or DEFAULT_EXPERTS,
            kv_cache=custom.get("kv_cache") or DEFAULT_KV_CACHE,
        )

    def additional_config(self, existing: Mapping | None = None) -> dict:
        """vLLM's ``additional_config`` with these settings under ``ENGINE_CONFIG_KEY``: JSON values only (vLLM
        hashes the dict into its compile-cache key), all fixed for the run."""
        return {**dict(existing or {}), ENGINE_CONFIG_KEY: {
            "format": self.format.value, "ignore": list(self.ignore), "code_change_row_stride": self.code_change_row_stride,
            "code_change_max_mb": self.code_change_max_mb, "weight_bits": self.weight_bits,
            "experts": self.experts.value, "kv_cache": self.kv_cache.value,
        }}

    @classmethod
    def from_additional_config(cls, additional_config: Mapping | None) -> RolloutSettings:
        """The settings the server gave the engine (``additional_config``), in a vLLM worker."""
        values = (additional_config or {}).get(ENGINE_CONFIG_KEY) if isinstance(additional_config, Mapping) else None
        if values is None:
            raise QurlConfigError(
                f"this vLLM engine carries no {ROLLOUT_NAME} settings (additional_config[{ENGINE_CONFIG_KEY!r}]): "
                f"it was not started by the {ROLLOUT_NAME} server, which puts them there"
            )
        return cls(**{**values, "ignore": tuple(values.get("ignore", ()))})
