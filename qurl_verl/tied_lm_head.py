"""Whether a vLLM engine model computes its logits from the input embedding's Parameter (tied lm_head).

Read by the weight stream (a tied ``lm_head.weight`` is dropped from the sync, the engine has no tensor
of its own for it) and by the vLLM-CPU patch that rebuilds the lm_head's packed copy after a reload
(``patches/vllm_cpu_worker/vllm_cpu_tied_lm_head_refresh``). Here, outside both, so that
``qurl_verl.patches`` imports nothing from ``qurl_verl.rollout``. No vLLM import.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TIED_LM_HEAD_NAMES = frozenset({"lm_head.weight"})  # HF name of the output layer in Qwen2/Qwen3/Llama


def tied_output_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    """The engine model's ``lm_head`` if it computes logits from the input embedding's Parameter, else None.

    Read from the engine's modules (Qwen2/Qwen3/Llama layout), not from the config, because the two
    vLLM versions tie differently: 0.24's Qwen2 makes ``lm_head`` the embedding module itself and its
    ``load_weights`` drops ``lm_head.*``; 0.32's Qwen2 and both versions' Llama build a
    ``ParallelLMHead`` whose ``weight`` is the embedding's Parameter. Call it while the model is
    intact: a layerwise reload gives the lm_head its own meta weight until it finalizes.
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(lm_head, "weight", None)
    if weight is None or embed is None or weight is not getattr(embed, "weight", None):
        return None
    return lm_head
