"""What one weight sync adds around vLLM's layerwise reload (``vllm/model_executor/model_loader/reload``).

The reload itself (``initialize_layerwise_reload``, ``model.load_weights`` per bucket,
``finalize_layerwise_reload``) raises on nothing a stream can get wrong, so these helpers supply
what it leaves out:

* ``param_dtypes``: the dtype each streamed name loads into (fused shards and MoE experts too), for
  the stream to send exactly that dtype;
* ``check_all_layers_loaded`` (before finalize) and ``check_reloaded_model`` (after): a stream that
  missed a layer, or a model left on meta or with bad scales, fails the sync (``WeightReloadError``);
* ``quiet_config_only_layers``, ``quiet_skipped_lm_head``: finalize's "Failed to load weights"
  warnings for what no stream carries on purpose;

What a feature adds to the reload (the attention layers' scales) lives with the feature (``rollout.features``).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from qurl_verl.rollout import vllm_versions

logger = logging.getLogger("qurl_verl")

# vLLM's fused MoE layer holds all routed experts of a decoder layer in these two parameters
# (gate and up stacked in w13, down in w2), loaded from the per-expert HF tensors.
EXPERT_WEIGHT_PARAMS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}


class WeightReloadError(RuntimeError):
    """A weight sync failed part-way; the engine holds no usable model any more."""


def param_dtypes(model: torch.nn.Module, stream_name=lambda name: name) -> dict[str, torch.dtype]:
    """The dtype vLLM loads each parameter in, under the names the stream sends (a fused layer's
    under each of its HF shard names too, a fused expert parameter under each expert's names; a
    parameter whose name the stream writes differently under ``stream_name`` of it too).

    Read right after ``initialize_layerwise_reload``: the model then holds its checkpoint-format
    parameters, the ones the loaders copy into (post-processed kernels may be stored differently)."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    dtypes: dict[str, torch.dtype] = {}
    for wrapped_name, param in model.named_parameters():
        dtypes[wrapped_name] = param.dtype
        name = stream_name(wrapped_name)
        dtypes.setdefault(name, param.dtype)
        module, _, leaf = name.rpartition(".")
        parent, _, layer = module.rpartition(".")
        for shard in packed.get(layer, ()):
            dtypes.setdefault(f"{parent}.{shard}.{leaf}" if parent else f"{shard}.{leaf}", param.dtype)
        dtypes.update(expert_names(model.get_submodule(module), name, param))
    return dtypes


def expert_names(module: torch.nn.Module, name: str, param: torch.Tensor) -> dict[str, torch.dtype]:
    """The per-expert HF names (``<...>.mlp.experts.<e>.gate_proj.weight``) that load into a fused expert
    parameter (``<...>.mlp.experts[.routed_experts].w13_weight``), with its dtype; empty for any other."""
    leaf = name.rpartition(".")[2]
    if leaf not in EXPERT_WEIGHT_PARAMS or ".experts." not in name:
        return {}
    base = name.split(".experts.")[0] + ".experts"
    count = int(getattr(module, "global_num_experts", 0) or param.shape[0])
    return {f"{base}.{e}.{proj}.weight": param.dtype for e in range(count) for proj in EXPERT_WEIGHT_PARAMS[leaf]}


def check_all_layers_loaded(model: torch.nn.Module, allowed_missing: torch.nn.Module | None) -> None:
    """Every layer with a ``weight`` (linears, embeddings, norms) or fused expert weights
    (``EXPERT_WEIGHT_PARAMS``: all of a layer's routed experts) got all the elements a stream can
    deliver; else vLLM would keep stale weights (nothing loaded) or post-process uninitialized
    memory (partly loaded) without an error. Attention layers' scales are not streamed and
    are not checked. Vocabulary padding rows are never loaded (``streamable_numel``).
    ``allowed_missing``: the tied lm_head (a layer of its own sharing the embedding's Parameter),
    whose weight the stream skips; vLLM then keeps the shared Parameter, updated through the
    embedding, which is checked like any layer."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    missing = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or layer is allowed_missing or not ({"weight", *EXPERT_WEIGHT_PARAMS} & set(info.restore_metadata[0])):
            continue
        expected = streamable_numel(layer, info.load_numel_total)
        if info.load_numel < expected:
            missing.append(f"{name or type(layer).__name__} ({info.load_numel}/{expected})")
    if missing:
        raise WeightReloadError(f"the weight stream did not cover these layers: {', '.join(missing)}")


def streamable_numel(layer: torch.nn.Module, load_numel_total: int) -> int:
    """How many of the layer's ``load_numel_total`` elements a complete stream loads.

    All of them, except in vLLM's vocabulary layers (``VocabParallelEmbedding``, ``ParallelLMHead``
    in ``vllm/model_executor/layers/vocab_parallel_embedding.py``): their rows are padded to a
    multiple of 64 (and split over tensor-parallel ranks), and their ``weight_loader`` copies only
    this rank's rows of the checkpoint vocabulary (``shard_indices.org_vocab_*``), then zero-fills
    the rest with ``fill_``, which the reload's element count does not see. A vocabulary that is not
    a multiple of 64 (a checkpoint resized to ``len(tokenizer)``) therefore never reaches the total.
    Tensors sharded along the vocabulary (``output_dim`` set) count those rows; others count whole.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    if not isinstance(layer, VocabParallelEmbedding):
        return load_numel_total
    rows, padded_rows = layer.shard_indices.num_org_elements, layer.num_embeddings_per_partition
    padding = 0
    skipped = vllm_versions.skip_load_tensor_names()
    for name, tensor in get_layer_tensors(layer).items():
        if name in skipped or getattr(tensor, "output_dim", None) is None:
            continue
        numel = vllm_versions.tensor_load_numel(tensor)
        padding += numel - numel * rows // padded_rows
    return load_numel_total - padding


@contextmanager
def quiet_config_only_layers(model: torch.nn.Module):
    """Around ``finalize_layerwise_reload``: drop its "<Layer>: Failed to load weights" warning for
    layers that hold buffers only, computed from the config (RoPE's ``cos_sin_cache``).

    vLLM warns for every layer with loadable tensors that received none. For these no checkpoint
    has tensors and the models' ``load_weights`` drops them (Qwen2, Llama skip ``rotary_emb.*``), so
    no stream can avoid the warning on any sync; vLLM puts the engine's own buffers back,
    unchanged. A layer with parameters is never silenced: ``check_all_layers_loaded`` has already
    raised for one that got nothing, and the filter is scoped to this logger and this call.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    infos = [(type(m).__name__, layerwise.get_layerwise_info(m).restore_metadata) for m in model.modules()]
    with_params = {cls for cls, (params, _) in infos if params}
    with _without_load_warnings({cls for cls, (params, buffers) in infos if buffers and not params} - with_params):
        yield


@contextmanager
def quiet_skipped_lm_head(lm_head: torch.nn.Module | None):
    """Around ``finalize_layerwise_reload``: drop its "<Layer>: Failed to load weights" warning for the
    tied lm_head, whose weight the stream skips on purpose; vLLM then puts the shared Parameter back,
    the embedding's, already reloaded. Matched by class name, as vLLM logs it: any other layer of
    that class that got nothing has already failed ``check_all_layers_loaded``."""
    with _without_load_warnings(set() if lm_head is None else {type(lm_head).__name__}):
        yield


@contextmanager
def _without_load_warnings(layer_classes: set[str]):
    """Filter the reload's "<Layer>: Failed to load weights" warning for these layer classes, on its
    own logger, for the duration of the block."""
    from vllm.model_executor.model_loader.reload import layerwise

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in layer_classes)

    log = logging.getLogger(layerwise.__name__)
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def check_reloaded_model(model: torch.nn.Module) -> None:
    """After finalize: no tensor left on meta, every weight scale finite and positive."""
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if on_meta:
        raise WeightReloadError(f"parameters left on meta after the reload: {on_meta[:5]}")
    bad = [
        n
        for n, p in model.named_parameters()
        if n.endswith("weight_scale") and not (torch.isfinite(p).all() and (p > 0).all())
    ]
    if bad:
        raise WeightReloadError(f"non-finite or non-positive weight scales after the reload: {bad[:5]}")
