"""Applied by the `qurl_vllm` worker extension inside every vLLM worker process, on every platform, once,
before the model loads; each patch does nothing where its upstream mismatch is absent."""
from __future__ import annotations

from qurl_verl.patches.contract import Patch, apply_each, group_patches

ORDER = ("verl_lora_weights_mapper",)


def patches() -> list[Patch]:
    return group_patches(__name__, ORDER)


def apply_all() -> dict[str, str]:
    """{patch name: what it did}."""
    return apply_each(patches())
