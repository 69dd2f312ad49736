"""The trainer -> engine weight stream, bucket by bucket: quantize the targeted linears, copy the rest.

The trainer streams full, unsharded HF-named tensors (fp32 masters or bf16). Per bucket this
turns them into what vLLM's ``load_weights`` takes for a compressed-tensors W8A8 model:

* each targeted ``*_proj.weight`` becomes ``X.weight`` (int8 / fp8 codes) + ``X.weight_scale``
  (fp32) via ``qurl_verl.quant``. Scales come from whole rows, before vLLM shards anything, so
  every tensor-parallel rank computes the same scales;
* every other tensor (embeddings, norms, biases, kept-bf16 linears) is **copied**: verl's
  receiver hands out views into one transport buffer that the next bucket overwrites, while
  vLLM's layerwise reload holds on to a layer's tensors until the layer is complete. The copy is
  made in the dtype of the engine parameter it loads into (``param_dtypes``): vLLM's loaders would
  cast it there anyway (``copy_``, the same rounding), but log a dtype warning for every such
  tensor on every sync, and an fp32 copy of a bf16 parameter costs twice the memory;
* tensors that already arrive quantized (an 8-bit weight with its ``weight_scale``, i.e. a
  trainer that quantized on its side) are cloned unchanged;
* names the engine has no tensor of its own for (``skip``: ``lm_head.weight`` when the engine
  ties it to the input embedding, see ``qurl_verl.tied_lm_head``) are dropped before any copy. A
  trainer's tied ``lm_head.weight`` is a full vocab x hidden fp32 tensor (0.5-1.6 GB for 1.5B-7B
  models) that vLLM would discard or write a second time into the embedding's Parameter.

Which linears stay in full precision is vLLM's ``ignore`` rule on the engine's own list
(``compressed_tensors_format.is_ignored``), so the stream never keeps a layer the engine built as
8-bit, or the reverse.

Optionally an ``UpdateVisibilityTracker`` sees every quantized weight with the codes just computed,
so the share of codes a sync changed costs no second quantization.

The numerics live in ``qurl_verl.quant``; this module only decides what goes where.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from qurl_verl.quant import QuantizedTensor, UpdateVisibilityTracker
from qurl_verl.quant.compressed_tensors_format import is_quantization_target, quantize_state_dict
from qurl_verl.rollout.sync_stats import StreamStats
from qurl_verl.settings import RolloutSettings

EIGHT_BIT_DTYPES = (torch.int8, torch.float8_e4m3fn)
CASTABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class WeightStreamQuantizer:
    """Turns trainer buckets into engine buckets for one rollout format.

    ``param_dtypes``: the engine's parameter dtype under each name the stream may send (HF names,
    fused shards included); a pass-through float tensor is copied in that dtype. Names it lacks,
    and all tensors when it is None, keep the dtype they arrive in.
    ``skip``: names the engine does not load (``tied_lm_head.TIED_LM_HEAD_NAMES`` for a tied engine); they are
    neither copied nor returned, only counted.
    """

    settings: RolloutSettings
    tracker: UpdateVisibilityTracker | None = None
    stats: StreamStats = field(default_factory=StreamStats)
    param_dtypes: Mapping[str, torch.dtype] | None = None
    skip: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.ignore = self.settings.ignore_patterns  # normalized as vLLM matches it: the engine's own list

    def is_target(self, name: str, tensor: torch.Tensor) -> bool:
        return (
            self.settings.quantized
            and tensor.dtype not in EIGHT_BIT_DTYPES
            and is_quantization_target(name, tensor, ignore=self.ignore)
        )

    def pass_through(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` that owns its memory, in the engine parameter's dtype when it is a float."""
        dtype = (self.param_dtypes or {}).get(name, tensor.dtype)
        if tensor.dtype not in CASTABLE_DTYPES or dtype not in CASTABLE_DTYPES:
            dtype = tensor.dtype
        return tensor.to(dtype=dtype, copy=True)

    def transform(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """One bucket in, the tensors to load out; nothing returned aliases the input buffers."""
        received = list(bucket)
        bucket = [(n, t) for n, t in received if n not in self.skip]
        is_target = [self.is_target(n, t) for n, t in bucket]
        start = time.perf_counter()
        out = [(n, self.pass_through(n, t)) for (n, t), q in zip(bucket, is_target) if not q]
        copied = time.perf_counter()
        targets = [item for item, q in zip(bucket, is_target) if q]
        if targets:
            s = self.settings
            out.extend(quantize_state_dict(targets, s.quant_scheme, ignore=self.ignore))
        quantized = time.perf_counter()
        if self.tracker is not None and targets:
            self._observe(targets, out[len(out) - 2 * len(targets) :])
        self.stats.copy_s += copied - start
        self.stats.quantize_s += quantized - copied
        self.stats.code_change_s += time.perf_counter() - quantized
        self.stats.tensors_in += len(received)
        self.stats.quantized += len(targets)
        self.stats.passed_through += len(bucket) - len(targets)
        self.stats.skipped += len(received) - len(bucket)
        self.stats.bytes_in += sum(t.numel() * t.element_size() for _, t in received)
        self.stats.numel_in += sum(t.numel() for _, t in bucket)
        self.stats.quantized_numel += sum(t.numel() for _, t in targets)
        self.stats.add_checksum(out)
        return out

    def _observe(self, targets, quantized) -> None:
        """``quantized`` is (codes, scale) per target, in order, as quantize_state_dict yields them."""
        scheme = self.settings.quant_scheme
        for (name, weight), (_, codes), (_, scale) in zip(targets, quantized[0::2], quantized[1::2]):
            self.tracker.observe(name, weight, QuantizedTensor(codes, scale, scheme))
