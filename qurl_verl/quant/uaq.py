"""Update-Aware Quantization (UAQ): fold a scalar s > 1 into the RMSNorm that feeds a group of linears.

``W x = (W / s)(s x)``: multiplying the norm weight by s and dividing the weights of every linear
it feeds by s leaves the full-precision function unchanged (biases stay as they are, since
``(W/s)(s x) + b = W x + b``). Per-channel absmax weight quantization and per-token activation
quantization are scale-equivariant, so the quantized function is unchanged too. What changes is
the optimiser's view: gradients of W/s grow by s and, under Adam, each step moves W/s by the
same amount as before, i.e. by about s times more relative to its (s times smaller)
quantization step, so more updates survive re-quantization (spec §3.2, §3.4).

A norm's output must reach *only* the scaled linears, so the groups are fixed by the layer
layout: ``input_layernorm`` -> q/k/v (all three), ``post_attention_layernorm`` -> gate/up (both).
Qwen3's q_norm/k_norm sit after q_proj/k_proj and see unchanged projection outputs, so they need
no change. In Qwen2-MoE / Qwen3-MoE post_attention_layernorm also feeds the router (and Qwen2-MoE's
shared-expert gate), which must see unscaled inputs, so only q/k/v may be scaled there. UAQ is
applied once; the model's config records it so that it is never applied twice.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .compressed_tensors_format import FUSED_MODULES

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Same attention block; the MLP is a routed MoE whose router reads post_attention_layernorm's output.
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
_MLA = "MLA attention: q/k/v are low-rank projections with norms between them, not linears fed by input_layernorm"
REFUSED_MODEL_TYPES = {
    "mixtral": "its MoE is block_sparse_moe with per-expert w1/w2/w3 names that the quantized rollout does not know",
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
}
CONFIG_KEY = "qurl_uaq"

# norm name -> (attribute of the decoder layer holding the linears, the linears it feeds): the
# linears one norm feeds are the ones vLLM fuses, as they share their input
NORM_GROUPS = {
    "input_layernorm": ("self_attn", FUSED_MODULES["qkv_proj"]),
    "post_attention_layernorm": ("mlp", FUSED_MODULES["gate_up_proj"]),
}
# The paper's setting, s = 1.5 on q/k/v. The one home of both defaults: the settings, the presets
# (null), the converter's command line and the study harness read them here.
DEFAULT_UAQ_SCALE = 1.5
DEFAULT_UAQ_TARGETS = NORM_GROUPS["input_layernorm"][1]


def resolve_uaq_targets(targets: Iterable[str]) -> list[str]:
    """The norms to scale for ``targets``; each norm's whole group must be requested."""
    requested = list(dict.fromkeys(targets))
    if not requested:
        raise ValueError("UAQ needs at least one target group: q_proj,k_proj,v_proj and/or gate_proj,up_proj")
    known = {proj for _, group in NORM_GROUPS.values() for proj in group}
    unknown = [t for t in requested if t not in known]
    if unknown:
        raise ValueError(
            f"UAQ cannot scale {unknown}: only linears fed directly by an RMSNorm can absorb the scale "
            f"(q_proj,k_proj,v_proj via input_layernorm; gate_proj,up_proj via post_attention_layernorm)"
        )
    norms = []
    for norm, (_, group) in NORM_GROUPS.items():
        chosen = [p for p in group if p in requested]
        if chosen and len(chosen) != len(group):
            missing = [p for p in group if p not in chosen]
            raise ValueError(
                f"UAQ targets {chosen} share {norm} with {missing}; scaling the norm changes the input of "
                f"all of {list(group)}, so they must be scaled together"
            )
        if chosen:
            norms.append(norm)
    return norms


def _check_scale(scale: float) -> float:
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"UAQ scale must be a positive finite number, got {scale}")
    return scale


def check_uaq_model_type(model_type: str | None, targets: Iterable[str] | None = None) -> None:
    """Raise ValueError for a ``model_type`` UAQ cannot fold, or (given ``targets``) targets it cannot fold there.

    Needs only config.json, so a converter calls it before reading a single tensor.
    """
    _check_model_type(model_type, None if targets is None else resolve_uaq_targets(targets))


def _check_model_type(model_type: str | None, norms: list[str] | None = None) -> None:
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"UAQ does not support model_type {model_type!r}: {REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"UAQ does not know the layer layout of model_type {model_type!r}; "
            f"supported model_types: {list(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type in MOE_MODEL_TYPES and norms and "post_attention_layernorm" in norms:
        raise ValueError(
            f"UAQ cannot scale gate_proj,up_proj of MoE model_type {model_type!r}: post_attention_layernorm "
            f"also feeds the router (mlp.gate; in Qwen2-MoE also mlp.shared_expert_gate), which must stay "
            f"unchanged, and scaling the norm would change the router's input; use targets q_proj,k_proj,v_proj"
        )


def _already_applied_error(record) -> ValueError:
    return ValueError(
        f"UAQ was already applied to this model ({CONFIG_KEY}={record}); applying it again would "
        f"scale the weights a second time"
    )


def _times(t: torch.Tensor, scale: float) -> torch.Tensor:
    """``t * scale`` computed in at least float32, returned in ``t``'s dtype (bf16 rounds once)."""
    return (t.detach().to(_compute_dtype(t)) * scale).to(t.dtype)


def _divided(t: torch.Tensor, scale: float) -> torch.Tensor:
    return (t.detach().to(_compute_dtype(t)) / scale).to(t.dtype)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _uaq_record(scale: float, norms: list[str]) -> dict:
    targets = [p for norm in norms for p in NORM_GROUPS[norm][1]]
    return {"scale": scale, "targets": targets}


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    for path in ("model.layers", "layers"):
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"could not find decoder layers (model.layers) in {type(model).__name__}")


@torch.no_grad()
def apply_uaq(model: nn.Module, scale: float = DEFAULT_UAQ_SCALE, targets: Iterable[str] = DEFAULT_UAQ_TARGETS) -> nn.Module:
    """Fold ``scale`` into the norms feeding ``targets`` in place and record it in ``model.config``."""
    scale = _check_scale(scale)
    norms = resolve_uaq_targets(targets)
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("UAQ needs a HF model with a .config (to check model_type and record the fold)")
    record = getattr(config, CONFIG_KEY, None)
    if record:
        raise _already_applied_error(record)
    _check_model_type(getattr(config, "model_type", None), norms)
    layers = _decoder_layers(model)
    for layer in layers:
        for norm_name in norms:
            holder_name, group = NORM_GROUPS[norm_name]
            norm = getattr(layer, norm_name)
            holder = getattr(layer, holder_name)
            norm.weight.data.copy_(_times(norm.weight.data, scale))
            for proj in group:
                weight = getattr(holder, proj).weight
                weight.data.copy_(_divided(weight.data, scale))
    setattr(config, CONFIG_KEY, _uaq_record(scale, norms))
    return model


_LAYER_NORM_KEY = re.compile(r"^(?P<layer>.*layers\.\d+)\.input_layernorm\.weight$")


def apply_uaq_to_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    config: Mapping,
    scale: float = DEFAULT_UAQ_SCALE,
    targets: Iterable[str] = DEFAULT_UAQ_TARGETS,
) -> tuple[dict[str, torch.Tensor], dict]:
    """UAQ on a HF state dict and its config.json dict; returns new copies, inputs stay untouched.

    For converting a checkpoint on disk without instantiating the model. Tensors keep their dtype.
    """
    scale = _check_scale(scale)
    norms = resolve_uaq_targets(targets)
    if config.get(CONFIG_KEY):
        raise _already_applied_error(config[CONFIG_KEY])
    _check_model_type(config.get("model_type"), norms)
    layer_prefixes = sorted(
        {m["layer"] for key in state_dict if (m := _LAYER_NORM_KEY.match(key))},
        key=lambda p: int(p.rsplit(".", 1)[1]),
    )
    expected = config.get("num_hidden_layers")
    if not layer_prefixes or (expected is not None and len(layer_prefixes) != expected):
        raise ValueError(
            f"found {len(layer_prefixes)} decoder layers with an input_layernorm in the state dict, "
            f"config says num_hidden_layers={expected}"
        )
    out = dict(state_dict)
    for prefix in layer_prefixes:
        for norm_name in norms:
            holder_name, group = NORM_GROUPS[norm_name]
            keys = [f"{prefix}.{norm_name}.weight"] + [f"{prefix}.{holder_name}.{p}.weight" for p in group]
            missing = [k for k in keys if k not in state_dict]
            if missing:
                raise ValueError(f"state dict lacks {missing} (fused projections are not supported)")
            out[keys[0]] = _times(state_dict[keys[0]], scale)
            for key in keys[1:]:
                out[key] = _divided(state_dict[key], scale)
    new_config = dict(config)
    new_config[CONFIG_KEY] = _uaq_record(scale, norms)
    return out, new_config


def uaq_record(config) -> dict | None:
    """What UAQ recorded in a HF config object or config.json dict, or None if it was not applied."""
    if isinstance(config, Mapping):
        return config.get(CONFIG_KEY) or None
    return getattr(config, CONFIG_KEY, None) or None
