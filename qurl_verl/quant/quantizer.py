"""Symmetric absmax quantization to INT8 / FP8 E4M3 at the granularities vLLM's W8A8 kernels use.

Conventions (fixed here so that every caller, the trainer-side statistics and the rollout
weight stream, produce identical codes):

* Scales are computed in float32 from the input upcast to float32 (the trainer streams fp32
  masters or bf16), ``scale = absmax / qmax`` with qmax 127 (INT8) or 448 (FP8).
* INT8 codes are ``round(w / scale)`` with round-half-to-even (``torch.round``), clamped to
  [-127, 127]. We divide rather than multiply by ``1/scale``: it is the correctly rounded
  quotient, so the only rounding is the one to the 8-bit grid. vLLM's activation kernels
  multiply by ``qmax/absmax``; the two can differ only for inputs within one float32 ulp of a
  rounding tie.
* FP8 codes are ``(w / scale).clamp(-448, 448).to(float8_e4m3fn)`` (round to nearest even).
* A group whose absmax is zero (or so small that ``absmax/qmax`` underflows) gets the smallest
  normal float32 as its scale instead of 0. Its codes are then exactly 0, dequantization gives
  exactly 0, nothing divides by zero, and the bound |w - Q(w)| <= scale/2 (INT8) still holds.
* NaN or inf in the input raises ``ValueError`` naming the tensor: a single bad value would
  otherwise poison a whole row's scale and silently zero the row in the rollout engine.
* ``block`` (128x128 weight tiles) and ``group`` (1x128 activation groups) do not require the
  dimensions to be multiples of the block: the last block along each dimension is partial, its
  scale comes from the elements it actually holds, and the codes keep the unpadded shape. The
  scale has ``ceil(N/128) x ceil(K/128)`` entries, the layout vLLM's block-FP8 loader expects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .formats import ACTIVATION_GRANULARITIES, WEIGHT_GRANULARITIES, Granularity, QuantFormat
from .scheme import INT8_CHANNEL, QuantScheme

# Guards the scale of an all-zero group (see module docstring).
MIN_SCALE = torch.finfo(torch.float32).tiny


@dataclass
class QuantizedTensor:
    """8-bit codes plus float32 scales, and the scheme they were made with; ``data * scale`` (broadcast per
    granularity) is the value."""

    data: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme = INT8_CHANNEL

    @property
    def fmt(self) -> QuantFormat:
        return self.scheme.codes

    @property
    def granularity(self) -> Granularity:
        return self.scheme.granularity

    @property
    def block_size(self) -> int:
        return self.scheme.block_size

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def expanded_scale(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The scale broadcastable against ``data`` (materialised for block/group layouts)."""
        scale = self.scale.to(dtype)
        if self.granularity in (Granularity.CHANNEL, Granularity.TOKEN):
            return scale
        b = self.block_size
        if self.granularity is Granularity.BLOCK:
            n, k = self.data.shape
            return scale.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
        return scale.repeat_interleave(b, -1)[..., : self.data.shape[-1]]  # group

    def column_slice(self, start: int, stop: int) -> QuantizedTensor:
        """Input columns ``start:stop`` of a per-channel weight: its scales (one per output row) stay whole."""
        if self.granularity is not Granularity.CHANNEL:
            raise ValueError(f"a column slice keeps its scales only for 'channel' weights, not {self.granularity.value!r}")
        return QuantizedTensor(self.data[:, start:stop], self.scale, self.scheme)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # float64 requests are computed in float64 so references stay exact.
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        return self.data.to(compute, copy=True).mul_(self.expanded_scale(compute)).to(dtype)


def _absmax(t: torch.Tensor, dim) -> torch.Tensor:
    """float32 max |t| over ``dim`` without materialising ``t.abs()`` (that temporary costs more than the reductions)."""
    return torch.maximum(t.amax(dim=dim, keepdim=True), t.amin(dim=dim, keepdim=True).neg_()).to(torch.float32)


def _scale_from_amax(amax: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return (amax / fmt.qmax).clamp_min_(MIN_SCALE)


def _encode(scaled: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Round already-divided values to the format's grid. ``scaled`` may be modified in place."""
    if fmt.dtype == torch.int8:
        torch.round(scaled, out=scaled)
        return scaled.clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)
    return scaled.clamp_(-fmt.qmax, fmt.qmax).to(fmt.dtype)


def _check_finite(amax: torch.Tensor, name: str | None) -> None:
    # absmax propagates NaN and inf, so checking the reduced tensor is enough and cheap.
    if not bool(torch.isfinite(amax).all()):
        label = f"tensor {name!r}" if name else "tensor"
        raise ValueError(f"cannot quantize {label}: it contains NaN or inf values")


def _padded_tiles(t: torch.Tensor, b: int) -> torch.Tensor:
    """[N, K] -> [ceil(N/b), b, ceil(K/b), b], zero-padding the partial edge tiles."""
    n, k = t.shape
    pad_n, pad_k = (-n) % b, (-k) % b
    if pad_n or pad_k:
        t = F.pad(t, (0, pad_k, 0, pad_n))
    return t.view((n + pad_n) // b, b, (k + pad_k) // b, b)


def _padded_groups(t: torch.Tensor, g: int) -> torch.Tensor:
    """[M, K] -> [M, ceil(K/g), g], zero-padding the partial last group."""
    m, k = t.shape
    pad_k = (-k) % g
    if pad_k:
        t = F.pad(t, (0, pad_k))
    return t.view(m, (k + pad_k) // g, g)


def quantize(w: torch.Tensor, scheme: QuantScheme = INT8_CHANNEL, *, name: str | None = None) -> QuantizedTensor:
    """Quantize ``w`` symmetrically with absmax scales, to ``scheme.codes``.

    ``scheme.granularity``: ``CHANNEL`` (one scale per row of a 2-D [out, in] weight), ``BLOCK``
    (one per ``block_size`` x ``block_size`` tile of a 2-D weight), ``TOKEN`` (one per row of
    the last dimension, for activations of any rank) or ``GROUP`` (one per ``block_size``
    consecutive elements of the last dimension).
    """
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"quantize takes a QuantScheme (INT8_CHANNEL, parse_scheme(...)), got {scheme!r}")
    qfmt, granularity, block_size = scheme.codes, scheme.granularity, scheme.block_size
    label = f" {name!r}" if name else ""
    if not torch.is_floating_point(w) or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"quantize expects a float16/bfloat16/float32/float64 tensor{label}, got {w.dtype}")
    if granularity in WEIGHT_GRANULARITIES and w.dim() != 2:
        raise ValueError(
            f"{granularity.value!r} granularity quantizes 2-D [out_features, in_features] weights; "
            f"tensor{label} has shape {tuple(w.shape)}"
        )
    if granularity in ACTIVATION_GRANULARITIES and w.dim() < 1:
        raise ValueError(f"{granularity.value!r} granularity needs at least one dimension; tensor{label} is a scalar")
    if w.numel() == 0:
        raise ValueError(f"cannot quantize empty tensor{label} of shape {tuple(w.shape)}")
    # bf16/fp16 values are exact in float32 and ``half_tensor / float32_scale`` promotes to float32,
    # so skipping an explicit upcast gives the same codes without a full-size temporary.
    src = w.detach() if w.dtype in (torch.float32, torch.bfloat16, torch.float16) else w.detach().to(torch.float32)
    if granularity is Granularity.CHANNEL:
        amax = _absmax(src, 1)
        _check_finite(amax, name)
        scale = _scale_from_amax(amax, qfmt)
        data = _encode(src / scale, qfmt)
    elif granularity is Granularity.TOKEN:
        amax = _absmax(src, -1)
        _check_finite(amax, name)
        scale = _scale_from_amax(amax, qfmt)
        data = _encode(src / scale, qfmt)
    elif granularity is Granularity.BLOCK:
        n, k = src.shape
        tiles = _padded_tiles(src, block_size)
        amax = _absmax(tiles, (1, 3)).squeeze(3).squeeze(1)
        _check_finite(amax, name)
        scale = _scale_from_amax(amax, qfmt)
        codes = _encode(tiles / scale[:, None, :, None], qfmt)
        data = codes.reshape(tiles.shape[0] * block_size, tiles.shape[2] * block_size)[:n, :k].contiguous()
    else:  # group
        lead, k = src.shape[:-1], src.shape[-1]
        groups = _padded_groups(src.reshape(-1, k), block_size)
        amax = _absmax(groups, -1).squeeze(-1)
        _check_finite(amax, name)
        scale = _scale_from_amax(amax, qfmt)
        codes = _encode(groups / scale[..., None], qfmt)
        data = codes.reshape(codes.shape[0], -1)[:, :k].reshape(*lead, k).contiguous()
        scale = scale.reshape(*lead, math.ceil(k / block_size))
    return QuantizedTensor(data=data, scale=scale, scheme=scheme)


def fake_quantize(w: torch.Tensor, scheme: QuantScheme = INT8_CHANNEL, *, name: str | None = None) -> torch.Tensor:
    """Quantize then dequantize back to ``w``'s dtype: the values the rollout engine computes with."""
    return quantize(w, scheme, name=name).dequantize(w.dtype)
