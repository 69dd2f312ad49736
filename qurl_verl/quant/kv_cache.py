"""FP8 KV cache: per-layer query, key and value scales from the ranges a model's attention sees, and
the quantize-dequantize an FP8 cache applies to what it stores.

vLLM keeps one scalar scale per attention layer for K and one for V (``Attention._k_scale``,
``_v_scale``) and stores ``x / scale`` as FP8 E4M3; CUDA backends that quantize the query as well
(``quantize_dequantize_query_fp8``) use ``_q_scale``. The CPU kernels read K and V scales only and keep
the query in the model's dtype.

E4M3 is a float format: the scale only places its range (±448 times the scale). Above it values
saturate; below it the relative precision (3 mantissa bits) is the same at every magnitude until the
subnormals start, 2^-6 of the way down from 1 (x scale). A generous scale therefore costs almost
nothing, a tight one clips every token the calibration did not see. ``scale_from_amax`` places the
observed maximum one binade below the top (``KV_SCALE_HEADROOM`` = 2): tokens of a rollout may reach
twice the trainer's maximum before they clip, and only values below amax / 14336 lose precision to
subnormals. NeMo-RL instead takes the 99.9th percentile times 1.05 (NVIDIA-NeMo/RL PR #1212), which
clips the largest 0.1 %; an amax costs one reduction per tensor and no histogram.
"""
from __future__ import annotations

import math
import re

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn  # vLLM's kv_cache_dtype=fp8_e4m3 (and "fp8" on CUDA and CPU)
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448
KV_SCALE_HEADROOM = 2.0
# the scale of a tensor that is all zeros (a layer whose V projection is zero): any positive value
# represents it exactly; vLLM's kernels refuse a scale <= 0
MIN_KV_SCALE = 1e-8
KV_PARTS = ("q", "k", "v")

# The names the scales travel under in a weight stream: those of compressed-tensors checkpoints
# (``model.layers.<i>.self_attn.k_scale``), which vLLM's models map onto ``...self_attn.attn``.
KV_SCALE_NAME = "model.layers.{layer}.self_attn.{part}_scale"
_KV_SCALE_NAME_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_scale$")


def kv_scale_name(layer: int, part: str) -> str:
    if part not in KV_PARTS:
        raise ValueError(f"part must be one of {KV_PARTS}, got {part!r}")
    return KV_SCALE_NAME.format(layer=layer, part=part)


def parse_kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer, part) of a KV-scale stream name, None for any other name."""
    match = _KV_SCALE_NAME_RE.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """The FP8 E4M3 scale (float32) that puts ``amax`` at 1/``KV_SCALE_HEADROOM`` of the format's range."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return (amax * KV_SCALE_HEADROOM / FP8_KV_MAX).clamp_min(MIN_KV_SCALE)


# How a kernel rounds to E4M3. CUDA's conversions (``cvt.rn.satfinite``) and torch's ``.to()`` round to
# nearest, ties to even. vLLM-CPU's (``csrc/cpu/cpu_attn_fp8.hpp``, ``float_to_fp8e4m3_scalar``: the
# float's top mantissa bits, after multiplying by the reciprocal of the scale) round toward zero: a
# relative error up to 1/8 instead of 1/16, and every stored |K| and |V| biased low by about 1/32 of itself.
ROUND_NEAREST = "nearest"
ROUND_TOWARD_ZERO = "toward_zero"


def quantize_dequantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, rounding: str = ROUND_NEAREST) -> torch.Tensor:
    """What an FP8 E4M3 cache with this scale gives back for ``x``, in ``x``'s dtype: ``x / scale``
    saturated to ±448 and rounded to E4M3 as ``rounding`` says (``ROUND_NEAREST``: ties to even;
    ``ROUND_TOWARD_ZERO``: vLLM-CPU's, which multiplies by the float32 reciprocal of the scale first),
    times ``scale``."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if rounding == ROUND_NEAREST:
        scaled = x.float() / scale
    elif rounding == ROUND_TOWARD_ZERO:
        scaled = x.float() * (1.0 / scale)
    else:
        raise ValueError(f"rounding must be {ROUND_NEAREST!r} or {ROUND_TOWARD_ZERO!r}, got {rounding!r}")
    scaled = scaled.clamp(-FP8_KV_MAX, FP8_KV_MAX)
    codes = scaled.to(FP8_KV_DTYPE)
    if rounding == ROUND_TOWARD_ZERO:
        # nearest went away from zero: the next code toward zero (E4M3 magnitudes are ordered like their bits)
        bits = codes.view(torch.uint8)
        away = codes.float().abs() > scaled.abs()
        codes = torch.where(away, bits - 1, bits).view(FP8_KV_DTYPE)
    return (codes.float() * scale).to(x.dtype)


def quantize_dequantize_query_fp8(query: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """The query a CUDA attention backend that takes FP8 queries attends with, in ``query``'s dtype.

    With an FP8 cache, vLLM 0.24's ``Attention.forward`` quantizes the query statically, per tensor, with
    the layer's ``_q_scale`` when the backend's ``supports_quant_query_input`` (Triton attention on CUDA,
    FlashAttention 3 on SM90, FlashInfer's TRT-LLM kernels), and the kernel descales its scores by the same
    scale. Both of vLLM's paths (``QuantFP8.forward_native``, compiled; the CUDA op ``static_scaled_fp8_quant``,
    eager) multiply the float32 query by the float32 reciprocal of the scale, saturate to ±448 and round to
    nearest, ties to even: a query element past 448 x scale is clipped there."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=query.device)
    scaled = (query.float() * scale.reciprocal()).clamp(-FP8_KV_MAX, FP8_KV_MAX)
    return (scaled.to(FP8_KV_DTYPE).float() * scale).to(query.dtype)


# The streamed tensors a decoder layer's attention inputs depend on, under the checkpoint names of the supported
# architectures (Qwen2/3, Llama, their MoE variants) and verl's LoRA ``base_layer`` names.
_ATTENTION_WEIGHT_RE = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:(input_layernorm)|self_attn\.([qkv])_proj|self_attn\.([qk])_norm)"
    r"(?:\.base_layer)?\.(weight|bias)$")


class AttentionInputBounds:
    """Upper bounds on |q|, |k| and |v| as attention receives them, per decoder layer, from the weights alone:
    the scales of a sync whose stream carries none (a run's first, before the actor has run a forward), which
    then cannot clip whatever the hidden state is (vLLM's default 1.0 clips every |x| past 448: Qwen2-family
    q/k biases can reach that).

    For a pre-norm layer, ``input_layernorm`` (RMSNorm) gives ``x_hat * g`` with ``||x_hat||_2 <= sqrt(d)``, so
    output j of a projection is at most ``sqrt(d) max|g| ||W_j||_2 + |b_j|`` (Cauchy-Schwarz); a per-head
    ``q_norm``/``k_norm`` makes it at most ``sqrt(head_dim) max|g_head|``; RoPE turns pairs of outputs, so
    after it an element of q or k is at most ``sqrt(2)`` times the largest bound (the head-normed one already
    bounds the pair). One reduction per projection row while the stream passes; nothing is kept but the bounds.
    The scale puts the bound at 448: E4M3's relative precision is the same at every magnitude down to 2^-6 of
    the top, so a generous scale costs little, a clipping one a lot (see the module docstring)."""

    def __init__(self) -> None:
        self._norm: dict[int, float] = {}  # layer -> max |input_layernorm weight|
        self._rows: dict[tuple[int, str], torch.Tensor] = {}  # (layer, part) -> ||W_j||_2
        self._width: dict[tuple[int, str], int] = {}
        self._bias: dict[tuple[int, str], torch.Tensor] = {}
        self._head_norm: dict[tuple[int, str], tuple[float, int]] = {}  # max |g_head|, head_dim

    @torch.no_grad()
    def see(self, name: str, tensor: torch.Tensor) -> bool:
        """Take what ``name`` says about a layer's attention inputs; whether it was such a tensor."""
        match = _ATTENTION_WEIGHT_RE.search(name)
        if match is None:
            return False
        layer, norm, proj, head_norm, kind = match.groups()
        layer = int(layer)
        t = tensor.detach().float()
        if norm:
            self._norm[layer] = float(t.abs().max())
        elif head_norm:
            self._head_norm[(layer, head_norm)] = (float(t.abs().max()), t.numel())
        elif kind == "weight":
            self._rows[(layer, proj)] = t.norm(dim=-1).cpu()
            self._width[(layer, proj)] = t.shape[-1]
        else:
            self._bias[(layer, proj)] = t.abs().cpu()
        return True

    def bound(self, layer: int, part: str) -> float | None:
        """The bound on |part| of ``layer`` (None: a tensor it needs did not pass)."""
        if part in ("q", "k") and (layer, part) in self._head_norm:
            largest, head_dim = self._head_norm[(layer, part)]
            return math.sqrt(head_dim) * largest
        if layer not in self._norm or (layer, part) not in self._rows:
            return None
        rows = math.sqrt(self._width[(layer, part)]) * self._norm[layer] * self._rows[(layer, part)].double()
        if (layer, part) in self._bias:
            rows = rows + self._bias[(layer, part)].double()
        return float(rows.max()) * (math.sqrt(2.0) if part in ("q", "k") else 1.0)

    def scales(self, layers) -> dict[tuple[int, str], float]:
        """{(layer, part): bound / 448} for every part of ``layers``, or {} when any bound is missing."""
        scales = {}
        for layer in layers:
            for part in KV_PARTS:
                bound = self.bound(layer, part)
                if bound is None or not math.isfinite(bound):
                    return {}
                scales[(layer, part)] = max(bound / FP8_KV_MAX, MIN_KV_SCALE)
        return scales


class KVRangeObserver:
    """The largest |q|, |k|, |v| each decoder layer's attention received since the last ``take``.

    Fed the tensors exactly as the attention kernel receives them (K after RoPE and after ``k_norm``
    where the model has one), once per forward; one reduction per tensor, kept on its device."""

    def __init__(self) -> None:
        self._amax: dict[int, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._amax)

    @torch.no_grad()
    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        amax = torch.stack([t.detach().abs().amax().float() for t in (query, key, value)])
        seen = self._amax.get(layer)
        self._amax[layer] = amax if seen is None else torch.maximum(seen, amax)

    def table(self) -> tuple[list[int], torch.Tensor]:
        """(layers in order, amax as a [layers, 3] tensor of q, k, v), for an all-reduce across ranks."""
        layers = sorted(self._amax)
        if not layers:
            return [], torch.zeros(0, len(KV_PARTS))
        return layers, torch.stack([self._amax[i] for i in layers])

    def set_table(self, layers: list[int], amax: torch.Tensor) -> None:
        self._amax = {layer: amax[i] for i, layer in enumerate(layers)}

    def take(self) -> dict[int, torch.Tensor]:
        """{layer: [q, k, v] amax} observed so far (on the CPU), and start afresh."""
        amax = {layer: a.cpu() for layer, a in sorted(self._amax.items())}
        self._amax = {}
        return amax


def kv_scales(amax: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stream entries for observed ranges: {``kv_scale_name(layer, part)``: float32 scalar}."""
    return {
        kv_scale_name(layer, part): scale_from_amax(a[j]).reshape(())
        for layer, a in sorted(amax.items())
        for j, part in enumerate(KV_PARTS)
    }
