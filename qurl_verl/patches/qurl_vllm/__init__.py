"""Applied by the `qurl_vllm` rollout adapter, in its own process only."""
