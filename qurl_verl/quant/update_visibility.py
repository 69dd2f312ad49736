"""How much of an RL weight update survives quantization (the paper's "weight update problem").

For a targeted weight W_prev -> W_new quantized with the rollout's format and granularity:

* ``changed_fraction`` = share of 8-bit codes of Q(W_new) that differ from those of Q(W_prev)
  (FP8 +0 and -0 count as equal). 0 means the rollout engine did not see the update at all.
* ``update_norm`` = ||W_new - W_prev||_F and ``quant_error_norm`` = ||deq(Q(W_prev)) - W_prev||_F,
  both computed in float32 (relative error ~1e-5, plenty for a logged statistic).
* ``update_to_error_ratio`` = update_norm / quant_error_norm. Spec Eq. 10 predicts ~1e-2 or less
  for plain RL steps; UAQ with scale s multiplies it by ~s (Adam) or ~s^2 (SGD).

Aggregates (per projection type, overall) pool counts and squared norms before dividing, so the
overall ratio is sqrt(sum ||dW||^2) / sqrt(sum ||E||^2) over all targeted tensors.
Everything is vectorised per tensor and can run name by name while weights stream.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from .compressed_tensors_format import DEFAULT_IGNORE, TargetSpec, is_quantization_target
from .formats import DEFAULT_BLOCK_SIZE, QuantFormat, resolve_format
from .quantizer import QuantizedTensor, quantize


@dataclass
class UpdateStats:
    numel: int = 0
    changed_codes: int = 0
    update_sq: float = 0.0
    quant_error_sq: float = 0.0

    def __iadd__(self, other: "UpdateStats") -> "UpdateStats":
        self.numel += other.numel
        self.changed_codes += other.changed_codes
        self.update_sq += other.update_sq
        self.quant_error_sq += other.quant_error_sq
        return self

    def as_dict(self) -> dict[str, float]:
        update, error = math.sqrt(self.update_sq), math.sqrt(self.quant_error_sq)
        return {
            "changed_fraction": self.changed_codes / self.numel if self.numel else 0.0,
            "update_norm": update,
            "quant_error_norm": error,
            "update_to_error_ratio": update / error if error > 0 else (math.inf if update > 0 else 0.0),
            "numel": self.numel,
        }


def changed_code_count(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of positions whose 8-bit codes differ in value."""
    if a.dtype == torch.int8:
        return int(torch.count_nonzero(a != b))
    ua, ub = a.view(torch.uint8), b.view(torch.uint8)
    # Same bit pattern, or both a signed zero (exponent and mantissa bits all clear).
    differ = (ua != ub) & (((ua | ub) & 0x7F) != 0)
    return int(torch.count_nonzero(differ))


def squared_norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) ** 2


def quantization_error_sq(weight: torch.Tensor, q: QuantizedTensor) -> float:
    return squared_norm(q.dequantize(torch.float32).sub_(weight.detach().to(torch.float32)))


def tensor_update_stats(
    prev: torch.Tensor,
    new: torch.Tensor,
    fmt: str | QuantFormat = "int8",
    granularity: str = "channel",
    *,
    name: str | None = None,
    prev_q: QuantizedTensor | None = None,
    new_q: QuantizedTensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> UpdateStats:
    """Update statistics for one tensor; pass already computed quantizations to avoid redoing them."""
    if prev.shape != new.shape:
        raise ValueError(f"tensor {name!r} changed shape: {tuple(prev.shape)} -> {tuple(new.shape)}")
    if prev_q is None:
        prev_q = quantize(prev, fmt, granularity, name=name, block_size=block_size)
    if new_q is None:
        new_q = quantize(new, fmt, granularity, name=name, block_size=block_size)
    delta = new.detach().to(torch.float32) - prev.detach().to(torch.float32)
    return UpdateStats(
        numel=new.numel(),
        changed_codes=changed_code_count(prev_q.data, new_q.data),
        update_sq=squared_norm(delta),
        quant_error_sq=quantization_error_sq(prev, prev_q),
    )


def projection_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``q_proj`` (the key for per-type aggregates)."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "weight" else name


def summarize(per_tensor: Mapping[str, UpdateStats]) -> dict:
    by_projection: dict[str, UpdateStats] = {}
    overall = UpdateStats()
    for name, stats in per_tensor.items():
        by_projection.setdefault(projection_name(name), UpdateStats()).__iadd__(stats)
        overall += stats
    return {
        "per_tensor": {name: stats.as_dict() for name, stats in per_tensor.items()},
        "by_projection": {key: stats.as_dict() for key, stats in by_projection.items()},
        "overall": overall.as_dict(),
    }


def _pairs(prev_named, new_named) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    new_items = new_named.items() if isinstance(new_named, Mapping) else new_named
    if isinstance(prev_named, Mapping):
        for name, new in new_items:
            if name in prev_named:
                yield name, prev_named[name], new
        return
    for (prev_name, prev), (name, new) in zip(prev_named, new_items, strict=True):
        if prev_name != name:
            raise ValueError(f"weight streams are out of order: {prev_name!r} vs {name!r}")
        yield name, prev, new


def update_visibility(
    prev_named_weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    new_named_weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    fmt: str | QuantFormat = "int8",
    granularity: str = "channel",
    targets: TargetSpec = None,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> dict:
    """Per-tensor, per-projection and overall update visibility of the targeted weights.

    Either argument may be a mapping or a stream of ``(name, tensor)`` pairs; two streams must
    yield the same names in the same order. Untargeted tensors are skipped.
    """
    qfmt, ignore = resolve_format(fmt), tuple(ignore)
    per_tensor = {}
    for name, prev, new in _pairs(prev_named_weights, new_named_weights):
        if is_quantization_target(name, new, targets, ignore):
            per_tensor[name] = tensor_update_stats(prev, new, qfmt, granularity, name=name, block_size=block_size)
    return summarize(per_tensor)


def sampled_rows(n_rows: int, row_stride: int, granularity: str, block_size: int = DEFAULT_BLOCK_SIZE):
    """Rows to keep so that quantizing the sample gives the same codes as sampling the quantized tensor.

    ``channel``: every ``row_stride``-th row. ``block``: every ``row_stride``-th band of ``block_size``
    rows (a band is the row extent of one block). None means all rows.
    """
    if row_stride == 1:
        return None
    if granularity == "channel":
        return slice(None, None, row_stride)
    rows = torch.arange(n_rows)
    return rows[(rows // block_size) % row_stride == 0]


class UpdateVisibilityTracker:
    """Step-to-step update visibility for a weight stream, one tensor at a time.

    Keeps, per targeted tensor, a copy of the last weights seen (same dtype), their codes and their
    quantization error. Call ``observe`` for each streamed tensor and ``end_step`` once per RL step
    to get the summary. ``row_stride`` > 1 tracks only a sample of rows (see ``sampled_rows``):
    memory and time shrink by that factor, and the statistics are those of the sampled rows,
    which are exact for them because per-channel and per-block scales never mix rows across the sample.
    """

    def __init__(self, fmt: str | QuantFormat = "int8", granularity: str = "channel", targets: TargetSpec = None,
                 ignore: Iterable[str] = DEFAULT_IGNORE, block_size: int = DEFAULT_BLOCK_SIZE, row_stride: int = 1):
        if row_stride < 1:
            raise ValueError(f"row_stride must be >= 1, got {row_stride}")
        self.fmt, self.granularity = resolve_format(fmt), granularity
        self.targets, self.ignore, self.block_size = targets, tuple(ignore), block_size
        self.row_stride = row_stride
        self._last: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        self._step: dict[str, UpdateStats] = {}

    def _sample(self, weight: torch.Tensor, q: QuantizedTensor | None):
        rows = sampled_rows(weight.shape[0], self.row_stride, self.granularity, self.block_size)
        if rows is None:
            return weight, q
        weight = weight[rows]
        if q is not None:
            scale_rows = rows if self.granularity == "channel" else slice(None, None, self.row_stride)
            q = QuantizedTensor(q.data[rows], q.scale[scale_rows], q.fmt, q.granularity, q.block_size)
        return weight, q

    @torch.no_grad()
    def observe(self, name: str, weight: torch.Tensor, quantized: QuantizedTensor | None = None) -> UpdateStats | None:
        """Record ``weight``; returns its stats against the previous sighting (None the first time or if untargeted).

        ``quantized``: the quantization of ``weight`` if the caller already has it (e.g. from the weight sync).
        """
        if not is_quantization_target(name, weight, self.targets, self.ignore):
            return None
        weight, q = self._sample(weight.detach(), quantized)
        if q is None:
            q = quantize(weight, self.fmt, self.granularity, name=name, block_size=self.block_size)
        error_sq = quantization_error_sq(weight, q)
        stats = None
        if name in self._last:
            prev, prev_codes, prev_error_sq = self._last[name]
            delta = weight.to(torch.float32) - prev.to(torch.float32)
            stats = UpdateStats(
                numel=weight.numel(),
                changed_codes=changed_code_count(prev_codes, q.data),
                update_sq=squared_norm(delta),
                quant_error_sq=prev_error_sq,
            )
            self._step[name] = stats
        self._last[name] = (weight.clone(), q.data.clone(), error_sq)
        return stats

    def end_step(self) -> dict:
        summary = summarize(self._step)
        self._step = {}
        return summary
