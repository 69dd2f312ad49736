"""Let a caller see, or replace, the query, key and value every attention call of a transformers model
receives, exactly as its kernel receives them: K after RoPE and after ``k_norm`` where the model has one.

Targets: transformers 5.9 and 5.19 (``modeling_utils.AttentionInterface.get_interface``, which every
decoder attention of these versions calls at each forward to pick its kernel: eager, sdpa, flash,
or what verl registered for sequence parallelism).

Why: an FP8 KV cache needs the range of K and V as the cache will store them, per layer. Forward
hooks see ``k_proj``'s output, before RoPE and ``k_norm``; the attention kernel is the one place where
the final tensors exist in every model and every kernel. The same place lets a reference model
quantize-dequantize K and V as an FP8 cache does (tests, the pure-torch study).

When: while a ``kv_hook(hook)`` block is active in this process (one hook list per process); outside one, the lookup
returns transformers' own function. Applied by the ``qurl_vllm`` adapter in the trainer process when
``custom.qurl.kv_cache=fp8``, and by the callers of ``kv_hook``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager

import torch

from qurl_verl.patches.contract import Patch, wrap_once

_MARK = "_qurl_kv_hook"
# hook(module, query, key, value) -> None (keep them) or (query, key, value) to attend with instead
KVHook = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], tuple | None]
_active: list[KVHook] = []


@contextmanager
def kv_hook(hook: KVHook):
    """Within the block, every attention call of a transformers model goes through ``hook`` first
    (the innermost block's hook replaces the outer ones). Applies the patch if it is not applied yet."""
    if not apply() and not _is_applied():
        raise RuntimeError("qurl_verl: transformers' AttentionInterface.get_interface was not found; "
                           "K/V ranges cannot be observed with this transformers version")
    _active.append(hook)
    try:
        yield
    finally:
        _active.remove(hook)


def with_hook(attention: Callable, hook: KVHook) -> Callable:
    """``attention(module, query, key, value, ...)`` with ``hook`` run on its inputs first."""

    @functools.wraps(attention)
    def hooked_attention(module, query, key, value, *args, **kwargs):
        replaced = hook(module, query, key, value)
        if replaced is not None:
            query, key, value = replaced
        return attention(module, query, key, value, *args, **kwargs)

    return hooked_attention


def interface_with_hooks_for(original):
    @functools.wraps(original)
    def get_interface(self, attn_implementation, default):
        attention = original(self, attn_implementation, default)
        return with_hook(attention, _active[-1]) if _active else attention

    return get_interface


def _interface_class():
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface


def interface_available() -> bool:
    """transformers has the dispatch this patch wraps."""
    try:
        return hasattr(_interface_class(), "get_interface")
    except ImportError:
        return False


def _is_applied() -> bool:
    return bool(getattr(getattr(_interface_class(), "get_interface", None), _MARK, False))


def _wrap_get_interface() -> str:
    return wrap_once(_interface_class(), "get_interface", interface_with_hooks_for, _MARK)


PATCH = Patch(
    module=__name__,
    target="transformers.modeling_utils:AttentionInterface.get_interface",
    package="transformers",
    versions=("5.9.", "5.19."),
    when="in the trainer process of a qurl_vllm run with an FP8 KV cache, and inside kv_hook blocks",
    change=_wrap_get_interface,
)


def apply() -> str:
    """Wrap the lookup; "" if already wrapped (or absent: ``kv_hook`` then refuses)."""
    return PATCH.apply()


def layer_index(module: torch.nn.Module) -> int:
    """The decoder layer of an attention module (transformers sets ``layer_idx`` on every decoder attention)."""
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int):
        raise RuntimeError(f"qurl_verl: {type(module).__name__} has no layer_idx; its K/V ranges cannot be assigned to a layer")
    return index
