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

``UpdateVisibilityTracker`` does so across syncs. Its state outlives every sync, so it lives in
CPU memory, compact (a row sample, kept exactly as received, plus 1-byte codes) and capped
(``max_resident_bytes``; the rollout worker uses ``DEFAULT_TRACKER_MAX_BYTES``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from .compressed_tensors_format import DEFAULT_IGNORE, TargetSpec, is_quantization_target
from .formats import Granularity
from .quantizer import QuantizedTensor, quantize
from .scheme import INT8_CHANNEL, QuantScheme


@dataclass
class UpdateStats:
    numel: int = 0
    changed_codes: int = 0
    update_sq: float = 0.0
    quant_error_sq: float = 0.0

    def __iadd__(self, other: UpdateStats) -> UpdateStats:
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
    scheme: QuantScheme = INT8_CHANNEL,
    *,
    name: str | None = None,
    prev_q: QuantizedTensor | None = None,
    new_q: QuantizedTensor | None = None,
) -> UpdateStats:
    """Update statistics for one tensor; pass already computed quantizations to avoid redoing them."""
    if prev.shape != new.shape:
        raise ValueError(f"tensor {name!r} changed shape: {tuple(prev.shape)} -> {tuple(new.shape)}")
    if prev_q is None:
        prev_q = quantize(prev, scheme, name=name)
    if new_q is None:
        new_q = quantize(new, scheme, name=name)
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
    scheme: QuantScheme = INT8_CHANNEL,
    targets: TargetSpec = None,
    ignore: Iterable[str] = DEFAULT_IGNORE,
) -> dict:
    """Per-tensor, per-projection and overall update visibility of the targeted weights.

    Either argument may be a mapping or a stream of ``(name, tensor)`` pairs; two streams must
    yield the same names in the same order. Untargeted tensors are skipped.
    """
    ignore = tuple(ignore)
    per_tensor = {}
    for name, prev, new in _pairs(prev_named_weights, new_named_weights):
        if is_quantization_target(name, new, targets, ignore):
            per_tensor[name] = tensor_update_stats(prev, new, scheme, name=name)
    return summarize(per_tensor)


def sampled_rows(n_rows: int, row_stride: int, scheme: QuantScheme):
    """Rows to keep so that quantizing the sample gives the same codes as sampling the quantized tensor.

    ``channel``: every ``row_stride``-th row. ``block``: every ``row_stride``-th band of ``block_size``
    rows (a band is the row extent of one block). None means all rows.
    """
    if row_stride == 1:
        return None
    if scheme.granularity is Granularity.CHANNEL:
        return slice(None, None, row_stride)
    rows = torch.arange(n_rows)
    return rows[(rows // scheme.block_size) % row_stride == 0]


# Cap on the tracker's state in a rollout worker (bytes): ~50M sampled elements from fp32 masters,
# far more than a logged rate needs, and small next to the host memory of a GPU node.
DEFAULT_TRACKER_MAX_BYTES = 256 * 2**20

_EXACT_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CODE_BYTES = 1  # int8 and float8_e4m3fn codes


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the tracker keeps sampled rows in: the received one when float32/bf16/fp16 (exact).

    Never narrower than received: an RL step moves weights by ~1e-6 relative, far below a bf16 ulp
    (~4e-3), so rounding fp32 masters to bf16 would make ||W_new - W_prev|| measure rounding, not
    the update. float64 is kept as float32, the precision the statistics are computed in anyway.
    """
    return dtype if dtype in _EXACT_STORAGE_DTYPES else torch.float32


def sampled_units(n_rows: int, scheme: QuantScheme) -> int:
    """How many units ``sampled_rows`` picks from: rows (``channel``) or bands of ``block_size`` rows."""
    return n_rows if scheme.granularity is Granularity.CHANNEL else -(-n_rows // scheme.block_size)


def sampled_row_count(n_rows: int, row_stride: int, scheme: QuantScheme) -> int:
    """``len`` of the rows ``sampled_rows`` keeps, without building them (the last band may be short)."""
    if scheme.granularity is Granularity.CHANNEL:
        return -(-n_rows // row_stride)
    block_size = scheme.block_size
    kept_bands = -(-sampled_units(n_rows, scheme) // row_stride)
    last_start = (kept_bands - 1) * row_stride * block_size
    return (kept_bands - 1) * block_size + min(block_size, n_rows - last_start)


def tracker_state_bytes(shape, dtype: torch.dtype, row_stride: int, scheme: QuantScheme = INT8_CHANNEL) -> int:
    """Bytes ``UpdateVisibilityTracker`` holds for one [rows, cols] weight: sampled rows + their codes."""
    n_rows, n_cols = int(shape[0]), math.prod(int(d) for d in shape[1:])
    per_element = storage_dtype(dtype).itemsize + _CODE_BYTES
    return sampled_row_count(n_rows, row_stride, scheme) * n_cols * per_element


@dataclass
class _Held:
    """One tensor's previous sighting: sampled rows and codes (storage device, contiguous, own storage)."""

    rows: torch.Tensor
    codes: torch.Tensor
    error_sq: float  # ||deq(Q(rows)) - rows||^2, float32 as in ``quantization_error_sq``
    shape: torch.Size  # of the full tensor
    units: int  # rows (channel) or bands (block) of the full tensor

    @property
    def nbytes(self) -> int:
        return self.rows.untyped_storage().nbytes() + self.codes.untyped_storage().nbytes()


def _own_copy(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous copy on ``device`` that shares no storage with ``t`` (e.g. a transport buffer)."""
    return t.to(device=device, dtype=dtype or t.dtype, copy=True, memory_format=torch.contiguous_format)


class UpdateVisibilityTracker:
    """Step-to-step update visibility for a weight stream, one tensor at a time.

    Keeps, per targeted tensor, the last sampled rows seen (``storage_dtype``: exact for fp32/bf16/fp16),
    their 8-bit codes and their quantization error, on ``storage_device`` (default CPU: the state
    lives for the whole run and must stay out of the accelerator memory the engine budgets for).
    Call ``observe`` for each streamed tensor and ``end_step`` once per RL step to get the summary.
    ``row_stride`` > 1 tracks only a sample of rows (see ``sampled_rows``): memory and time shrink by
    that factor, and the statistics are those of the sampled rows, which are exact for them because
    per-channel and per-block scales never mix rows across the sample.

    ``max_resident_bytes`` (None = unbounded) caps ``resident_bytes()``. All tracked tensors share
    one effective stride, ``row_stride * 2**k``: when a tensor seen for the first time (or arriving in
    a wider dtype) would push the state over the cap, the stride rises to the smallest such value at
    which it fits next to the others, and every held sample is thinned to every ``2**j``-th of its
    rows (channel) or bands (block) -- a subset of the rows it already has, so nothing is re-read
    and the statistics stay exact for the rows kept. The stride is thus fixed during the first sync
    (streams arrive in a fixed order: deterministic) and ends as the smallest ``row_stride * 2**k``
    at which all tensors fit -- within 2x of the smallest stride that fits at all -- with every layer
    sampled alike, where a per-tensor budget would starve the last layers. Tensors already compared
    in the step of a rise keep the statistics of their rows at the earlier stride. A tensor that
    does not fit even with every tensor down to one row (band) is left untracked (counted in
    ``end_step()``) and the stride stays. Between calls the state never exceeds the cap; during
    ``observe`` one tensor's new sample exists next to its old one.
    """

    def __init__(self, scheme: QuantScheme = INT8_CHANNEL, targets: TargetSpec = None,
                 ignore: Iterable[str] = DEFAULT_IGNORE, row_stride: int = 1,
                 *, storage_device: str | torch.device = "cpu", max_resident_bytes: int | None = None):
        if row_stride < 1:
            raise ValueError(f"row_stride must be >= 1, got {row_stride}")
        if max_resident_bytes is not None and (isinstance(max_resident_bytes, bool) or max_resident_bytes <= 0):
            raise ValueError(f"max_resident_bytes must be a positive byte count or None, got {max_resident_bytes!r}")
        if not isinstance(scheme, QuantScheme):
            raise TypeError(f"UpdateVisibilityTracker takes a QuantScheme (INT8_CHANNEL, parse_scheme(...)), got {scheme!r}")
        self.scheme = scheme
        self.targets, self.ignore = targets, tuple(ignore)
        self.row_stride = row_stride
        self.storage_device = torch.device(storage_device)
        self.max_resident_bytes = max_resident_bytes
        self._stride = row_stride
        self._held: dict[str, _Held] = {}
        self._held_bytes = 0
        self._untracked: set[str] = set()
        self._step: dict[str, UpdateStats] = {}

    @property
    def effective_row_stride(self) -> int:
        """The stride every held sample is taken at (``row_stride`` unless the cap raised it)."""
        return self._stride

    def resident_bytes(self) -> int:
        """Bytes of tensor storage the tracker holds (the sampled rows and codes of every tensor)."""
        return sum(held.nbytes for held in self._held.values())

    def _sample(self, weight: torch.Tensor, q: QuantizedTensor | None):
        rows = sampled_rows(weight.shape[0], self._stride, self.scheme)
        if rows is None:
            return weight, q
        weight = weight[rows]
        if q is not None:
            scale_rows = rows if self.scheme.granularity is Granularity.CHANNEL else slice(None, None, self._stride)
            q = QuantizedTensor(q.data[rows], q.scale[scale_rows], q.scheme)
        return weight, q

    def _thin(self, factor: int) -> None:
        """Multiply the stride by ``factor``: keep every ``factor``-th sampled row (band) of every held
        tensor, which is exactly its sample at the new stride, and recompute its quantization error."""
        self._stride *= factor
        for name, held in self._held.items():
            keep = sampled_rows(held.rows.shape[0], factor, self.scheme)
            rows = _own_copy(held.rows[keep], self.storage_device)
            codes = _own_copy(held.codes[keep], self.storage_device)
            # Requantizing the kept rows gives their codes and scales back: scales never mix rows across the sample.
            q = quantize(rows, self.scheme, name=name)
            self._held[name] = _Held(rows, codes, quantization_error_sq(rows, q), held.shape, held.units)
        self._held_bytes = self.resident_bytes()

    def _fits(self, name: str, weight: torch.Tensor) -> bool:
        """Make room for ``weight``'s sample: raise the stride to the smallest ``stride * 2**k`` at which
        it fits next to every other held tensor. False, with nothing changed, if it never fits."""
        cap = self.max_resident_bytes
        if cap is None:
            return True

        def need(stride: int) -> int:
            return tracker_state_bytes(weight.shape, weight.dtype, stride, self.scheme)

        held = self._held.get(name)
        if self._held_bytes - (held.nbytes if held is not None else 0) + need(self._stride) <= cap:
            return True
        others = [h for n, h in self._held.items() if n != name]
        units = sampled_units(weight.shape[0], self.scheme)
        most_units = max([units, *(h.units for h in others)])
        stride = self._stride
        while stride < most_units:  # beyond that every tensor is down to one row (band): nothing shrinks
            stride *= 2
            total = need(stride) + sum(
                tracker_state_bytes(h.shape, h.rows.dtype, stride, self.scheme) for h in others
            )
            if total <= cap:
                self._thin(stride // self._stride)
                return True
        return False

    def _forget(self, name: str) -> None:
        held = self._held.pop(name, None)
        if held is not None:
            self._held_bytes -= held.nbytes
        self._untracked.add(name)

    @torch.no_grad()
    def observe(self, name: str, weight: torch.Tensor, quantized: QuantizedTensor | None = None) -> UpdateStats | None:
        """Record ``weight``; returns its stats against the previous sighting (None the first time, if
        untargeted, or if left untracked by the memory cap).

        ``quantized``: the quantization of ``weight`` if the caller already has it (e.g. from the weight sync).
        Sampling and quantization run where ``weight`` is; the sample is then copied to the storage
        device and compared there.
        """
        if not is_quantization_target(name, weight, self.targets, self.ignore) or name in self._untracked:
            return None
        shape = weight.shape
        if name in self._held and self._held[name].shape != shape:
            raise ValueError(f"tensor {name!r} changed shape: {tuple(self._held[name].shape)} -> {tuple(shape)}")
        if not self._fits(name, weight):
            self._forget(name)
            return None
        weight, q = self._sample(weight.detach(), quantized)
        if q is None:
            q = quantize(weight, self.scheme, name=name)
        error_sq = quantization_error_sq(weight, q)
        rows = _own_copy(weight, self.storage_device, storage_dtype(weight.dtype))
        codes = _own_copy(q.data, self.storage_device)
        stats = None
        prev = self._held.get(name)
        if prev is not None:
            delta = rows.to(torch.float32) - prev.rows.to(torch.float32)
            stats = UpdateStats(
                numel=rows.numel(),
                changed_codes=changed_code_count(prev.codes, codes),
                update_sq=squared_norm(delta),
                quant_error_sq=prev.error_sq,
            )
            self._step[name] = stats
            self._held_bytes -= prev.nbytes
        units = sampled_units(shape[0], self.scheme)
        held = self._held[name] = _Held(rows, codes, error_sq, shape, units)
        self._held_bytes += held.nbytes
        return stats

    def end_step(self) -> dict:
        """The step's summary (see ``summarize``) plus ``tracker``: the stride, state size and coverage."""
        summary = summarize(self._step)
        summary["tracker"] = {
            "row_stride": self._stride,
            "requested_row_stride": self.row_stride,
            "resident_bytes": self.resident_bytes(),
            "tracked_tensors": len(self._held),
            "untracked_tensors": len(self._untracked),
        }
        self._step = {}
        return summary
