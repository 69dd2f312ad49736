"""Lazy registration of the `qurl_vllm` backend with verl (no vLLM import here)."""


def register() -> None:
    return None
