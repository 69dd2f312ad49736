"""Load verl's critic (value model) with the attention the CPU platform runs, not flash-attn.

Targets: verl 0.9.1 (``verl/utils/model.py::load_valuehead_model``, which the FSDP engine imports
at call time for ``critic`` models, ``verl/workers/engine/fsdp/transformer_impl.py``).

Why: it passes ``attn_implementation="flash_attention_2"`` to transformers whatever
``critic.model.override_config.attn_implementation`` says. The CPU platform has no flash-attn, so
the load fails, verl's fallback (trl's value-head model) is not installed either, and a PPO run
with a critic (GAE) stops when the critic starts.

What: ``load_valuehead_model`` in ``verl.utils.model`` is wrapped so that, for the duration of the
call and only when ``flash_attn`` cannot be imported, the transformers auto classes it loads with
take ``sdpa`` where ``flash_attention_2`` is asked (the attention the CPU platform requires of the
actor too). Nothing else about the load changes; with flash-attn installed the call is verl's own.

When: the plugin applies it on the CPU platform only (``VERL_PLATFORM=cpu``), whether or not verl's
module is imported yet. On GPUs the driver asks for flash-attn instead.
"""
from __future__ import annotations

import functools
import importlib.util
from contextlib import contextmanager

from qurl_verl.patches.contract import Patch, wrap_once
from qurl_verl.patches.on_import import patch_now_or_on_import

TARGET_MODULE = "verl.utils.model"
FUNCTION = "load_valuehead_model"
CPU_ATTENTION = "sdpa"
_MARK = "_qurl_cpu_attention"


@contextmanager
def flash_attention_loaded_as(attention: str, classes):
    """While inside, ``cls.from_pretrained(..., attn_implementation="flash_attention_2")`` of each
    class loads with ``attention`` instead."""
    saved = {cls: cls.__dict__.get("from_pretrained") for cls in classes}
    for cls in classes:
        original = cls.from_pretrained

        def from_pretrained(*args, _original=original, **kwargs):
            if kwargs.get("attn_implementation") == "flash_attention_2":
                kwargs["attn_implementation"] = attention
            return _original(*args, **kwargs)

        cls.from_pretrained = from_pretrained
    try:
        yield
    finally:
        for cls, own in saved.items():
            if own is None:
                del cls.from_pretrained
            else:
                cls.from_pretrained = own


def cpu_attention_loader_for(original):
    @functools.wraps(original)
    def load_valuehead_model(*args, **kwargs):
        if importlib.util.find_spec("flash_attn") is not None:
            return original(*args, **kwargs)
        import transformers

        with flash_attention_loaded_as(CPU_ATTENTION, (transformers.AutoModelForTokenClassification,
                                                       transformers.AutoModelForCausalLM)):
            return original(*args, **kwargs)

    return load_valuehead_model


def patch_module(module) -> str:
    return wrap_once(module, FUNCTION, cpu_attention_loader_for, _MARK)


PATCH = Patch(
    module=__name__,
    target=f"{TARGET_MODULE}:{FUNCTION}",
    package="verl",
    versions=("0.9.1",),
    when="on the CPU platform, whether or not verl's module is imported yet; a no-op where flash_attn imports",
    change=lambda: patch_now_or_on_import(TARGET_MODULE, patch_module),
)


def apply() -> str:
    """"patched", "on import" (a hook patches the module when it loads) or "" (already done)."""
    return PATCH.apply()
