"""The `qurl_vllm` rollout backend: verl's vLLM rollout with an 8-bit copy re-quantized every sync."""
