"""What the `qurl_vllm` rollout generates with, read from verl's rollout config and checked once.

The user picks the rollout format with verl's own key, which accepts any string:

    actor_rollout_ref.rollout.name=qurl_vllm
    actor_rollout_ref.rollout.quantization=int8        # int8 | fp8 | fp8_block | bf16 (default int8)
    +actor_rollout_ref.rollout.custom.qurl.keep_bf16=[model.layers.0.mlp.down_proj]

* ``int8``: W8A8 INT8, one scale per output channel, int8 activations quantized per token at run
  time (vLLM compressed-tensors). The QuRL default, and the fast path on CPU.
* ``fp8``: the same layout with FP8 E4M3 codes. vLLM-CPU runs it through an emulated
  ``_scaled_mm`` (correct but 10-30x slower than bf16); meant for GPUs with FP8 units.
* ``fp8_block``: FP8 E4M3 with 128x128 weight blocks and 1x128 activation groups. On CPU vLLM
  only has AMX kernels for it.
* ``bf16``: no quantization, through the very same reload path: the full-precision baseline.

``code_change_row_stride`` (default 8; 0 turns it off): the engine tracks, for every Nth row of
each quantized weight, how many 8-bit codes a sync changed (QuRL's "weight update problem"), and
reports it with the sync's cost. Memory in the vLLM worker: 1/N of the targeted weights as received.

``keep_bf16`` lists linear layers that stay in full precision, in compressed-tensors ``ignore``
syntax (exact module name, name suffix, or ``re:<regex>``). ``lm_head`` and the embeddings are
never quantized. Fused vLLM modules must be kept whole: keep q_proj, k_proj and v_proj of a layer
together (gate_proj and up_proj likewise), or vLLM refuses the config at engine start.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qurl_verl.config import QurlConfigError

logger = logging.getLogger("qurl_verl")

# rollout.quantization value -> (qurl_verl.quant format, weight granularity); None = unquantized
ROLLOUT_FORMATS: dict[str, tuple[str, str] | None] = {
    "int8": ("int8", "channel"),
    "fp8": ("fp8", "channel"),
    "fp8_block": ("fp8", "block"),
    "bf16": None,
}
DEFAULT_FORMAT = "int8"

# Dense decoder models whose linear layers are exactly the seven *_proj projections the weight
# stream quantizes, and whose vLLM implementation fuses them as qkv_proj / gate_up_proj.
# Only Qwen2 is exercised by the CPU tests; the others share its layer structure in vLLM.
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")

ALWAYS_FULL_PRECISION = ("lm_head",)  # embeddings are not Linear layers, so never targeted

CUSTOM_KEYS = ("keep_bf16", "code_change_row_stride")
DEFAULT_CODE_CHANGE_ROW_STRIDE = 8


@dataclass(frozen=True)
class QurlRolloutSettings:
    format: str = DEFAULT_FORMAT
    keep_bf16: tuple[str, ...] = ()
    code_change_row_stride: int = DEFAULT_CODE_CHANGE_ROW_STRIDE

    def __post_init__(self) -> None:
        if self.format not in ROLLOUT_FORMATS:
            raise QurlConfigError(
                f"actor_rollout_ref.rollout.quantization={self.format!r} is not a qurl_vllm format; "
                f"use one of {', '.join(ROLLOUT_FORMATS)} (e.g. actor_rollout_ref.rollout.quantization=int8)"
            )
        stride = self.code_change_row_stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
            raise QurlConfigError(
                f"actor_rollout_ref.rollout.custom.qurl.code_change_row_stride must be an integer >= 0 "
                f"(0 = off), got {stride!r}"
            )
        bad = [p for p in self.keep_bf16 if not isinstance(p, str) or not p]
        if bad:
            raise QurlConfigError(
                f"actor_rollout_ref.rollout.custom.qurl.keep_bf16 must be a list of module names or 're:' "
                f"patterns, got {list(self.keep_bf16)!r}"
            )

    @property
    def quantized(self) -> bool:
        return ROLLOUT_FORMATS[self.format] is not None

    @property
    def quant_format(self) -> str | None:
        """The qurl_verl.quant format name ("int8" / "fp8"), None for bf16."""
        spec = ROLLOUT_FORMATS[self.format]
        return spec[0] if spec else None

    @property
    def granularity(self) -> str | None:
        spec = ROLLOUT_FORMATS[self.format]
        return spec[1] if spec else None

    @property
    def ignore(self) -> tuple[str, ...]:
        """Modules left in full precision: the compressed-tensors ``ignore`` list."""
        return ALWAYS_FULL_PRECISION + tuple(p for p in self.keep_bf16 if p not in ALWAYS_FULL_PRECISION)

    def quantization_config(self) -> dict | None:
        """The compressed-tensors ``quantization_config`` the engine is built with (None for bf16)."""
        if not self.quantized:
            return None
        from qurl_verl.quant.compressed_tensors_format import compressed_tensors_config

        return compressed_tensors_config(self.quant_format, self.granularity, ignore=self.ignore)

    def engine_quantization(self) -> tuple[str | None, dict]:
        """(vLLM ``quantization``, ``hf_overrides``), the pair verl's server passes to the engine."""
        config = self.quantization_config()
        if config is None:
            return None, {}
        return "compressed-tensors", {"quantization_config": config}

    @classmethod
    def from_rollout_config(cls, rollout: Any) -> "QurlRolloutSettings":
        """From verl's rollout config (``RolloutConfig`` or the ``actor_rollout_ref.rollout`` node)."""
        fmt = _field(rollout, "quantization")
        custom = _field(rollout, "custom") or {}
        qurl = _field(custom, "qurl") or {}
        if not isinstance(qurl, Mapping) and not hasattr(qurl, "items"):
            raise QurlConfigError(
                f"actor_rollout_ref.rollout.custom.qurl must be a mapping of qurl_vllm settings, got {qurl!r}"
            )
        qurl = dict(qurl.items())
        unknown = sorted(set(qurl) - set(CUSTOM_KEYS))
        if unknown:
            raise QurlConfigError(
                f"unknown key(s) actor_rollout_ref.rollout.custom.qurl.{', '.join(unknown)}; "
                f"qurl_vllm reads only: {', '.join(CUSTOM_KEYS)}"
            )
        keep = qurl.get("keep_bf16") or ()
        if isinstance(keep, str):
            keep = (keep,)
        fmt = DEFAULT_FORMAT if fmt is None else str(fmt).lower()
        stride = qurl.get("code_change_row_stride", DEFAULT_CODE_CHANGE_ROW_STRIDE)
        return cls(format=fmt, keep_bf16=tuple(keep), code_change_row_stride=stride)

    @classmethod
    def from_quantization_config(cls, config: Mapping | None) -> "QurlRolloutSettings":
        """Recover the settings from the engine's own ``quantization_config``: the vLLM worker
        quantizes exactly what the engine was built to run, whatever process built it."""
        if not config:
            return cls(format="bf16")
        group = config["config_groups"]["group_0"]["weights"]
        fmt = {("int", "channel"): "int8", ("float", "channel"): "fp8", ("float", "block"): "fp8_block"}.get(
            (group["type"], group["strategy"])
        )
        if fmt is None or config.get("quant_method") != "compressed-tensors":
            raise ValueError(f"not a qurl_vllm quantization_config: {json.dumps(config)[:300]}")
        keep = tuple(p for p in config.get("ignore", ()) if p not in ALWAYS_FULL_PRECISION)
        return cls(format=fmt, keep_bf16=keep)


def _field(node: Any, key: str) -> Any:
    if node is None:
        return None
    if isinstance(node, Mapping):
        return node.get(key)
    if hasattr(node, "get") and not hasattr(node, "__dataclass_fields__"):
        return node.get(key)  # DictConfig
    return getattr(node, key, None)


def check_architecture(architectures: Iterable[str] | None, model: str = "the model") -> None:
    archs = list(architectures or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise QurlConfigError(
            f"qurl_vllm does not know how to quantize {model} (architectures={archs or 'unknown'}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}. Use actor_rollout_ref.rollout.name=vllm "
            "for other models."
        )


def _model_architectures(model_path: str | None) -> list[str] | None:
    """`architectures` from a local model folder; None when it cannot be read here (hub id)."""
    if not model_path:
        return None
    cfg = Path(os.path.expanduser(str(model_path))) / "config.json"
    if not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("architectures") or []


def _cpu_run(cfg: Any) -> bool:
    device = _select(cfg, "trainer.device")
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu" or device == "cpu"


def check_cpu_support(settings: QurlRolloutSettings, amx: bool | None = None) -> None:
    """FP8 on a CPU: per-channel runs (emulated, slow: warn), block FP8 needs AMX (error)."""
    if settings.format == "fp8_block":
        if amx is None:
            import torch

            amx = bool(torch.cpu._is_amx_tile_supported())
        if not amx:
            raise QurlConfigError(
                "actor_rollout_ref.rollout.quantization=fp8_block needs a CPU with AMX (Sapphire Rapids or newer): "
                "vLLM-CPU has no other block-FP8 kernel. Use quantization=fp8 (per-channel, slow on CPU) "
                "or quantization=int8 (fast on CPU)."
            )
    elif settings.format == "fp8":
        logger.warning(
            "qurl_vllm: quantization=fp8 on CPU runs vLLM's emulated FP8 matmul, 10-30x slower than bf16. "
            "It is correct but only meant for testing; quantization=int8 is the fast CPU format."
        )


def _select(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = _field(node, part)
        if node is None:
            return None
    return node


def validate_rollout_settings(cfg: Any) -> QurlRolloutSettings:
    """Driver-side check of a composed config with ``rollout.name=qurl_vllm``; raises QurlConfigError."""
    settings = QurlRolloutSettings.from_rollout_config(_select(cfg, "actor_rollout_ref.rollout"))
    model_path = _select(cfg, "actor_rollout_ref.model.path")
    archs = _model_architectures(model_path)
    if archs is not None:
        check_architecture(archs, model=str(model_path))
    if _cpu_run(cfg):
        check_cpu_support(settings)
    return settings
