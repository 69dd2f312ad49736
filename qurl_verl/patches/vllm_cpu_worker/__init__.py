"""Applied by the `qurl_vllm` worker extension inside vLLM-CPU workers (some only on some CPU classes)."""
