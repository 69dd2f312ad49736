"""A torch stand-in for vLLM's W8A8 linear layers, to check the rollout engine's log-probs.

``quantize_linear_modules_(model, scheme)`` swaps the targeted ``nn.Linear`` layers of a HF model
(same selection as ``quantize_state_dict``) for ``W8A8Linear``. Its buffers are named
``weight`` / ``weight_scale``, so the swapped model's ``state_dict()`` is already in
compressed-tensors layout.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .compressed_tensors_format import DEFAULT_IGNORE, TargetSpec, is_quantization_target
from .formats import WEIGHT_GRANULARITIES, Granularity, QuantFormat
from .matmul import w8a8_linear
from .quantizer import QuantizedTensor, fake_quantize, quantize
from .scheme import INT8_CHANNEL, QuantScheme


class W8A8Linear(nn.Module):
    """Linear layer with 8-bit weights and dynamically quantized 8-bit activations.

    ``fake=False`` multiplies the codes (``_int_mm`` / ``_scaled_mm``) and rescales in float32,
    as vLLM's kernels do. ``fake=True`` computes the same function by dequantizing both operands
    to float32 and using ``F.linear``; results agree up to float32 summation order, and it is much
    faster for FP8 on CPU.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        scheme: QuantScheme = INT8_CHANNEL,
        fake: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if not isinstance(scheme, QuantScheme):
            raise TypeError(f"W8A8Linear takes a QuantScheme (INT8_CHANNEL, parse_scheme(...)), got {scheme!r}")
        if scheme.granularity not in WEIGHT_GRANULARITIES:
            raise ValueError(f"W8A8Linear weight granularity must be one of {[g.value for g in WEIGHT_GRANULARITIES]}, "
                             f"got {scheme.granularity.value!r}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.fake = scheme, fake
        block_size = scheme.block_size
        self.input_shards = 1  # > 1: computed as that many row-parallel TP ranks (``shard_input_``)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=self.fmt.dtype, device=device))
        scale_shape = (
            (out_features, 1)
            if scheme.granularity is Granularity.CHANNEL
            else (-(-out_features // block_size), -(-in_features // block_size))
        )
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: QuantScheme = INT8_CHANNEL, fake: bool = False,
                    name: str | None = None) -> W8A8Linear:
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, scheme=scheme, fake=fake,
                    dtype=linear.weight.dtype, device=linear.weight.device)
        layer.load_weight_(linear.weight, name=name)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    @torch.no_grad()
    def load_weight_(self, weight: torch.Tensor, name: str | None = None) -> None:
        """Re-quantize from full-precision weights (what every rollout weight sync does)."""
        q = quantize(weight, self.scheme, name=name)
        self.weight.copy_(q.data)
        self.weight_scale.copy_(q.scale)

    def quantized_weight(self) -> QuantizedTensor:
        return QuantizedTensor(self.weight, self.weight_scale, self.scheme)

    @property
    def fmt(self) -> QuantFormat:
        return self.scheme.codes

    @property
    def granularity(self) -> Granularity:
        return self.scheme.granularity

    @property
    def block_size(self) -> int:
        return self.scheme.block_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qw = self.quantized_weight()
        if self.input_shards == 1:
            return self._product(x, qw, self.bias).to(x.dtype)
        # A row-parallel layer under tensor parallelism (vLLM's o_proj / down_proj at TP > 1): each rank
        # holds a slice of the input features and quantizes it with a per-token scale of its own, so the
        # activation codes depend on the TP size; the partial products are summed (the all-reduce) and
        # the bias is added once.
        k = self.in_features // self.input_shards
        out = sum(self._product(x[..., r * k:(r + 1) * k], qw.column_slice(r * k, (r + 1) * k), None)
                  for r in range(self.input_shards))
        return (out if self.bias is None else out + self.bias.to(torch.float32)).to(x.dtype)

    def shard_input_(self, shards: int) -> W8A8Linear:
        """Compute as ``shards`` row-parallel ranks do together (see ``forward``); per-channel weights only."""
        if shards < 1 or self.in_features % shards or (shards > 1 and self.granularity is not Granularity.CHANNEL):
            raise ValueError(f"cannot split {self.in_features} input features of a {self.granularity.value!r} layer "
                             f"into {shards} row-parallel shards")
        self.input_shards = shards
        return self

    def _product(self, x: torch.Tensor, qw: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` through 8-bit activations, in float32."""
        if not self.fake:
            return w8a8_linear(x, qw, bias=bias, out_dtype=torch.float32)
        x_fq = fake_quantize(x.to(torch.float32), self.scheme.activations)
        return F.linear(x_fq, qw.dequantize(torch.float32), None if bias is None else bias.to(torch.float32))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt.name}, granularity={self.granularity.value}, fake={self.fake}")


def quantize_linear_modules_(
    model: nn.Module,
    scheme: QuantScheme = INT8_CHANNEL,
    targets: TargetSpec = None,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    fake: bool = False,
) -> nn.Module:
    """Replace targeted ``nn.Linear`` modules in place by ``W8A8Linear``; returns ``model``."""
    ignore = tuple(ignore)
    swaps = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and is_quantization_target(f"{name}.weight", module.weight, targets, ignore)
    ]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, W8A8Linear.from_linear(module, scheme, fake, name=f"{name}.weight"))
    return model
