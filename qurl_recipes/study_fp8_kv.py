"""The GRPO study's FP8 KV cache: per-layer K/V scales and the quantize-dequantize the cache applies.

The scales come from the K/V ranges of the trainer's update forwards, as the real system measures them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from qurl_verl.patches.qurl_vllm.attention_kv_hook import kv_hook, layer_index
from qurl_verl.quant.kv_cache import FP8_KV_MAX, KVRangeObserver, quantize_dequantize_fp8, scale_from_amax

# vLLM's K and V scale before any is loaded, so what the first rollout of a run uses (the trainer
# has not run a forward yet that could measure the ranges)
INITIAL_KV_SCALE = 1.0


@dataclass(frozen=True)
class KVScales:
    """The per-layer FP8 KV cache scales one rollout uses: ``k[layer]``, ``v[layer]`` (float32)."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def initial(cls, layers: int) -> KVScales:
        return cls(torch.full((layers,), INITIAL_KV_SCALE), torch.full((layers,), INITIAL_KV_SCALE))

    @classmethod
    def from_amax(cls, amax: dict[int, torch.Tensor]) -> KVScales:
        """Scales from ``KVRangeObserver.take()`` ({layer: [q, k, v] amax}), which must cover every layer."""
        if sorted(amax) != list(range(len(amax))) or not amax:
            raise ValueError(f"K/V ranges observed for layers {sorted(amax)}, not for every layer from 0")
        table = torch.stack([amax[i] for i in range(len(amax))])
        return cls(scale_from_amax(table[:, 1]), scale_from_amax(table[:, 2]))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"k": self.k.clone(), "v": self.v.clone()}

    def stats(self) -> dict[str, float]:
        return {"kv_k_scale_min": float(self.k.min()), "kv_k_scale_max": float(self.k.max()),
                "kv_v_scale_min": float(self.v.min()), "kv_v_scale_max": float(self.v.max())}


class FP8KVCache:
    """Attention hook (``kv_hook``) that gives every attention call K and V as an FP8 E4M3 cache with
    these per-layer scales holds them; Q is left as it is. ``fill`` keeps the largest |K| or |V| seen
    as a share of the FP8 range (448 x scale): above 1 the cache saturated.

    The hook sees the whole cache, past positions and new ones, at every call. It keeps the quantized
    tensors of each layer and, while decoding, quantizes only the positions added since the last call:
    the same values as quantizing everything again (elementwise, deterministic), without redoing the
    whole cache at every token. A call whose query covers every key (a prefill or a full forward)
    starts afresh."""

    def __init__(self, scales: KVScales):
        self.scales = scales
        self.fill = 0.0
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        layer = layer_index(module)
        k_scale, v_scale = self.scales.k[layer], self.scales.v[layer]
        added, length = query.shape[-2], key.shape[-2]
        held = self._held.get(layer)
        if held is not None and added < length and held[0].shape[:-2] == key.shape[:-2] \
                and held[0].shape[-2] == length - added:
            key, value = key[..., -added:, :], value[..., -added:, :]
        else:
            held = None
        self.fill = max(self.fill, float(key.abs().amax() / (FP8_KV_MAX * k_scale)),
                        float(value.abs().amax() / (FP8_KV_MAX * v_scale)))
        key, value = quantize_dequantize_fp8(key, k_scale), quantize_dequantize_fp8(value, v_scale)
        if held is not None:
            key, value = torch.cat([held[0], key], dim=-2), torch.cat([held[1], value], dim=-2)
        self._held[layer] = (key, value)
        return query, key, value


def attended_kv_ranges(observer: KVRangeObserver, attention_mask: torch.Tensor):
    """Attention hook that feeds ``observer`` the Q/K/V of the attended tokens of a full forward
    (``attention_mask`` [n, T]): verl's padding-free forwards never see pad positions, so their K and
    V must not widen the ranges."""

    @torch.no_grad()
    def observe(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        on = attention_mask[:, None, :, None].to(key.dtype)  # [n, 1, T, 1] against [n, heads, T, head_dim]
        observer.observe(layer_index(module), query.detach() * on, key.detach() * on, value.detach() * on)

    return observe


def attention_hook(hook):
    return contextlib.nullcontext() if hook is None else kv_hook(hook)
