"""Give vLLM's ``WeightsMapper`` the method verl 0.9.1 calls when it loads a LoRA adapter from tensors.

Targets: verl 0.9.1 (``verl/utils/vllm/utils.py``, ``VLLMHijack`` -> ``hijack__load_adapter``) on vLLM
0.32.0 (``vllm/model_executor/models/utils.py``, ``WeightsMapper``).

Why: for vLLM >= 0.25 verl asks the model's ``hf_to_vllm_mapper`` for ``get_unstacked_mapper()``, the
mapper without its fused-layer (stacked) entries, so adapter names keep ``q_proj`` rather than becoming
``qkv_proj``. vLLM 0.32 names that method ``get_rename_mapper`` (its docstring: for consumers that name
modules, "LoRA name parsing"), and has no ``get_unstacked_mapper``: every adapter sync of a model with
a mapper (Qwen2, Llama, ...) fails with ``AttributeError`` inside the worker. The patch adds
``get_unstacked_mapper`` as an alias of ``get_rename_mapper``.

Applies where ``WeightsMapper`` has ``get_rename_mapper`` and lacks ``get_unstacked_mapper`` (0.32); on
0.24, where verl takes the other branch and the class has neither, it does nothing.
"""
from __future__ import annotations

from qurl_verl.patches.contract import Patch

ALIAS, RENAMED = "get_unstacked_mapper", "get_rename_mapper"


def needs_alias(cls) -> bool:
    return hasattr(cls, RENAMED) and not hasattr(cls, ALIAS)


def _alias() -> str:
    from vllm.model_executor.models.utils import WeightsMapper

    if not needs_alias(WeightsMapper):
        return ""
    setattr(WeightsMapper, ALIAS, getattr(WeightsMapper, RENAMED))
    return f"WeightsMapper.{ALIAS} = {RENAMED}"


PATCH = Patch(
    module=__name__,
    target="vllm.model_executor.models.utils:WeightsMapper.get_unstacked_mapper",
    package="vllm",
    versions=("0.32.0",),
    when="in a vLLM worker whose WeightsMapper has get_rename_mapper but not get_unstacked_mapper",
    change=_alias,
)


def apply() -> str:
    return PATCH.apply()
