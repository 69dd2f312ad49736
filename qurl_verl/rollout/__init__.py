"""The `qurl_vllm` rollout backend: verl's vLLM rollout with an 8-bit copy re-quantized every sync.

Select it with ``actor_rollout_ref.rollout.name=qurl_vllm`` and the format with
``actor_rollout_ref.rollout.quantization=int8|fp8|fp8_block|bf16`` (see ``settings``); the
``+qurl=<preset>`` presets set both.

* ``registration``: makes the name known to verl (replica + adapter), without importing vLLM;
* ``server``: engine server and replica (quantized engine, our worker extension);
* ``adapter``: trainer-side client, keeps each sync's cost;
* ``worker_extension``: the vLLM-side sync, as named steps (receive, stream, reload, check, stats);
* ``layerwise_reload``: what the sync adds around vLLM's layerwise reload (checks, dtypes);
* ``features``: what a sync carries or does beyond the W8A8 codes, one module each;
* ``weight_stream``: which trainer tensors get quantized, and under which names.

The log-probs the engine returns (``rollout_log_probs`` in verl) are those of the 8-bit model
itself: vLLM computes them from the quantized forward, and with verl's default
``logprobs_mode=processed_logprobs`` they are log softmax(logits / temperature), the distribution
the tokens were sampled from (checked against a torch W8A8 reference in
``tests/integration/test_qurl_vllm_reload.py``).
"""
