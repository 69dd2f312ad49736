"""Emit quantized weights under vLLM's compressed-tensors names, and the matching config.

A targeted linear ``X.weight`` becomes ``X.weight`` (int8 or float8_e4m3fn, [N, K]) plus
``X.weight_scale`` (float32, [N, 1] for ``channel``, [ceil(N/128), ceil(K/128)] for ``block``).
Everything else (embeddings, norms, biases, lm_head, ignored layers) passes through untouched.
``quantize_state_dict`` is a generator so the rollout weight sync can stream one tensor at a time.

``ignore`` is decided twice, by this stream (on HF module names) and by vLLM when it builds the
engine's layers (on its own, fused names): a layer the two disagree on is built as INT8 but sent
in full precision, or the other way round, and its scales never arrive. So both sides use vLLM's
rule (``should_ignore_layer`` in ``vllm/.../compressed_tensors/utils.py``: exact name or ``re:``
pattern, fused layers ignored only if all their shards are), on one list normalized by
``vllm_ignore_patterns``: the emitted config carries it and the stream matches against it.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from .formats import WEIGHT_GRANULARITIES, Granularity
from .quantizer import quantize
from .scheme import INT8_CHANNEL, QuantScheme

# The linear projections of Llama/Qwen/Mistral decoder layers: attention (``self_attn.*``) and MLP
# (``mlp.*``). Fused-layer checkpoints (qkv_proj, gate_up_proj) are covered by passing them
# explicitly in ``targets``.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_TARGET_MODULES = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
DEFAULT_IGNORE = ("lm_head",)
# vLLM runs these HF projections as one layer (the ``packed_modules_mapping`` of Qwen2, Qwen3 and
# Llama) and decides ``ignore`` for that layer as a whole.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# The top-level modules of the supported causal LMs: a plain ``ignore`` name that starts with one
# of them is a full module path and stays an exact name.
MODULE_ROOTS = ("model", "lm_head")
# Mixture-of-experts decoder layers (Qwen2-MoE, Qwen3-MoE). The routers pick the experts each token
# goes to and always stay in full precision: vLLM builds Qwen3-MoE's ``mlp.gate`` with the model's
# quantization config, so it is kept by name (Qwen2-MoE's gates are built unquantized either way).
ROUTER_MODULES = ("mlp.gate", "mlp.shared_expert_gate")
# The routed experts, one HF module per expert and projection (``mlp.experts.<e>.gate_proj``), which
# vLLM runs as one fused layer per decoder layer (``w13_weight``: gate and up; ``w2_weight``: down).
EXPERTS_MODULE = "mlp.experts"
EXPERT_PROJECTIONS = MLP_PROJECTIONS  # each expert is an MLP
EXPERTS_IGNORE = r"re:(?:.*\.)?mlp\.experts(?:\..*)?$"  # every routed expert, kept in full precision

TargetSpec = Callable[[str, torch.Tensor], bool] | Iterable[str] | None


def _module_matches(module: str, pattern: str) -> bool:
    """A ``targets`` entry: what vLLM matches (exact name, ``re:`` regex), or a name suffix."""
    return _vllm_matches(module, pattern) or (not pattern.startswith("re:") and module.endswith("." + pattern))


@functools.lru_cache(maxsize=1024)
def vllm_ignore_pattern(pattern: str) -> str:
    """``pattern`` as vLLM's compressed-tensors ``ignore`` matches it.

    vLLM takes an exact module name or ``re:<regex>`` only, so a name like ``down_proj`` or
    ``mlp.down_proj`` would match nothing there. ``re:`` patterns and full module paths are kept;
    any other plain name becomes a regex for that name or any ``.<name>`` suffix. vLLM applies
    ``re.match`` (anchored at the start only), hence the ``$``. A fused layer's name
    (``qkv_proj``) also matches its shards, so that every vLLM version reads it alike (see
    ``is_ignored``). Idempotent.
    """
    if pattern.startswith("re:") or pattern.split(".", 1)[0] in MODULE_ROOTS:
        return pattern
    parent, _, leaf = pattern.rpartition(".")
    if leaf in FUSED_MODULES:  # the fused name and each shard: vLLM 0.24 decides a fused layer by its shards
        prefix = re.escape(parent + ".") if parent else ""
        names = "|".join(re.escape(n) for n in (leaf, *FUSED_MODULES[leaf]))
        return rf"re:(?:.*\.)?{prefix}(?:{names})$"
    return rf"re:(?:.*\.)?{re.escape(pattern)}$"


def vllm_ignore_patterns(patterns: Iterable[str]) -> tuple[str, ...]:
    """Each pattern through ``vllm_ignore_pattern``, duplicates dropped, order kept."""
    return tuple(dict.fromkeys(vllm_ignore_pattern(p) for p in patterns))


def _vllm_matches(name: str, pattern: str) -> bool:
    """vLLM's ``is_equal_or_regex_match``: the exact name, or ``re.match`` of a ``re:`` regex."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def is_ignored(module: str, ignore: Iterable[str] = DEFAULT_IGNORE) -> bool:
    """Whether vLLM keeps the engine layer that runs HF module ``module`` in full precision.

    vLLM's ``should_ignore_layer`` on the normalized patterns. A projection vLLM fuses (``q_proj``
    into ``qkv_proj``, ...) is decided by its fused layer, and there vLLM versions differ: 0.24
    matches the fused name only as an exact entry and otherwise decides by the shards, 0.32 first
    tries every pattern on the fused name. This applies the rule both share (the exact fused name,
    else all shards) and refuses a ``re:`` pattern that matches the fused name but not its shards,
    which the two versions would read differently. Only some shards ignored: vLLM refuses to
    build the engine, and so does this.
    """
    ignore = tuple(ignore)
    patterns = vllm_ignore_patterns(ignore)
    parent, _, leaf = module.rpartition(".")
    fused = next((f for f, shards in FUSED_MODULES.items() if leaf in shards), None)
    if fused is None:
        return any(_vllm_matches(module, p) for p in patterns)
    prefix = parent + "." if parent else ""
    if prefix + fused in patterns:
        return True
    shards = FUSED_MODULES[fused]
    ignored = [any(_vllm_matches(prefix + s, p) for p in patterns) for s in shards]
    if any(ignored) and not all(ignored):
        raise ValueError(
            f"ignore={list(ignore)} keeps only {[s for s, i in zip(shards, ignored) if i]} of {prefix}{fused} in "
            f"full precision; vLLM runs {'/'.join(shards)} as one layer: ignore all of them or none"
        )
    on_fused = [p for p in patterns if p.startswith("re:") and _vllm_matches(prefix + fused, p)]
    if on_fused and not all(ignored):
        raise ValueError(
            f"ignore pattern {on_fused[0]!r} matches vLLM's fused layer {prefix}{fused} but not its shards "
            f"{'/'.join(shards)}: vLLM 0.24 decides that layer by its shards, 0.32 by the fused name, so the two "
            f"would build it differently; write the plain name {fused!r}, or a pattern that matches the shards"
        )
    return all(ignored)


def experts_ignored(experts: str, num_experts: int, ignore: Iterable[str] = DEFAULT_IGNORE) -> bool:
    """Whether vLLM keeps the routed experts under ``experts`` (``model.layers.<i>.mlp.experts``) in full precision.

    vLLM builds all experts of a layer as one fused layer and decides ``ignore`` for it on expert 0's
    three projections alone (``CompressedTensorsMoEMethod.get_moe_method``), while the stream decides
    per HF tensor. The two agree only if every expert and projection of the layer gets the same
    verdict; a list that splits them is refused (the engine would quantize tensors the stream sends in
    full precision, or run a layer whose scales never arrive).
    """
    ignore = tuple(ignore)
    verdicts = {(e, p): is_ignored(f"{experts}.{e}.{p}", ignore) for e in range(num_experts) for p in EXPERT_PROJECTIONS}
    if len(set(verdicts.values())) > 1:
        kept = sorted({f"{e}.{p}" for (e, p), v in verdicts.items() if v})
        raise ValueError(
            f"ignore={list(ignore)} keeps only some of {experts} in full precision ({', '.join(kept[:6])}"
            f"{', ...' if len(kept) > 6 else ''}); vLLM runs all experts of a layer, and their gate/up/down "
            "projections, as one layer: ignore all of them or none"
        )
    return next(iter(verdicts.values()), False)


def is_quantization_target(
    name: str,
    tensor: torch.Tensor,
    targets: TargetSpec = None,
    ignore: Iterable[str] = DEFAULT_IGNORE,
) -> bool:
    """Whether ``name`` is the weight of a linear layer the rollout engine runs in 8 bits.

    ``targets`` is either a predicate ``(name, tensor) -> bool`` or a list of module-name
    suffixes (default: the seven decoder projections, matched only under ``layers.``).
    Modules ``is_ignored`` by ``ignore`` (vLLM's rule) always stay in full precision.
    """
    if not name.endswith(".weight") or tensor.dim() != 2:
        return False
    module = name[: -len(".weight")]
    if is_ignored(module, ignore):
        return False
    if callable(targets):
        return bool(targets(name, tensor))
    suffixes = DEFAULT_TARGET_MODULES if targets is None else tuple(targets)
    if targets is None and "layers." not in module:
        return False
    return any(_module_matches(module, suffix) for suffix in suffixes)


def _check_vllm_combination(scheme: QuantScheme) -> None:
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"a QuantScheme (INT8_CHANNEL, FP8_BLOCK, parse_scheme(...)) is needed, got {scheme!r}")
    if scheme.granularity not in WEIGHT_GRANULARITIES:
        raise ValueError(f"weight granularity must be one of {[g.value for g in WEIGHT_GRANULARITIES]}, "
                         f"got {scheme.granularity.value!r}")
    if scheme.granularity is Granularity.BLOCK and scheme.codes.name != "fp8":
        # vLLM's compressed-tensors INT8 scheme accepts only per-tensor/per-channel weights.
        raise ValueError("block granularity is an FP8 layout; vLLM has no INT8 block-scaled kernel. "
                         "Use FP8 codes with 'block' (FP8_BLOCK), or 'channel' granularity for INT8 (INT8_CHANNEL).")


def quantize_state_dict(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    scheme: QuantScheme = INT8_CHANNEL,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    targets: TargetSpec = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` pairs in compressed-tensors layout, one input tensor at a time: each target
    weight as its codes in ``scheme`` and ``weight_scale``, every other tensor as it comes."""
    _check_vllm_combination(scheme)
    ignore = tuple(ignore)
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    for name, tensor in items:
        if is_quantization_target(name, tensor, targets, ignore):
            q = quantize(tensor, scheme, name=name)
            yield name, q.data
            yield name[: -len("weight")] + "weight_scale", q.scale
        else:
            yield name, tensor


def compressed_tensors_config(scheme: QuantScheme = INT8_CHANNEL, ignore: Iterable[str] = DEFAULT_IGNORE) -> dict:
    """The ``quantization_config`` entry of config.json that makes vLLM load our W8A8 weights.

    Channel weights pair with dynamic per-token activations (vLLM's W8A8 INT8/FP8 schemes);
    block weights pair with dynamic 1 x block_size activation groups (the FP8_BLOCK preset).
    ``ignore`` is emitted as ``vllm_ignore_patterns`` writes it, the list the stream matches.
    """
    _check_vllm_combination(scheme)
    qfmt, block_size = scheme.codes, scheme.block_size
    weights = {
        "num_bits": 8,
        "type": qfmt.compressed_tensors_type,
        "symmetric": True,
        "strategy": scheme.granularity.value,
        "dynamic": False,
    }
    activations = {
        "num_bits": 8,
        "type": qfmt.compressed_tensors_type,
        "symmetric": True,
        "strategy": "token",
        "dynamic": True,
    }
    if scheme.granularity is Granularity.BLOCK:
        weights["block_structure"] = [block_size, block_size]
        activations["strategy"] = "group"
        activations["group_size"] = block_size
    return {
        "quant_method": "compressed-tensors",
        "format": qfmt.compressed_tensors_format,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations},
        },
        "ignore": list(vllm_ignore_patterns(ignore)),
    }
