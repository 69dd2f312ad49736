"""Applied by the `qurl_vllm` rollout server to its own engine object, in the server's process only: stock
`vllm` servers, and every run without qurl, are untouched."""
from __future__ import annotations

from qurl_verl.patches.contract import Patch, apply_each, group_patches

ORDER = ("pause_generation_keyword",)


def patches() -> list[Patch]:
    return group_patches(__name__, ORDER)


def apply_all(engine) -> dict[str, str]:
    """{patch name: what it did} for this server's engine (vLLM's ``AsyncLLM``)."""
    return apply_each(patches(), engine)
