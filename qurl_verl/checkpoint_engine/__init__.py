"""Checkpoint engines for verl's disaggregated modes (``separate_async``, one-step-off, fully async).

``qurl_int8`` (``int8_engine``): quantizes the trainer's weights on the trainer side, with the run's
``RolloutSettings``, and sends 8-bit codes + fp32 scales (+ the rest in the rollout's dtype) to the rollout.
Its parts: the codec (``wire_codec``: encode, align for verl's buckets, decode), the plain-data messages
(``wire_messages``: JSON bucket metadata, fixed-size reports), and two transports: verl's own
``NCCLCheckpointEngine`` on CUDA (``nccl_transport``) and a gloo group of the same shape on CPU
(``gloo_transport``). Selected with ``actor_rollout_ref.rollout.checkpoint_engine.backend=qurl_int8`` and
registered by ``custom_backend_module=qurl_verl.checkpoint_engine.int8_engine`` (verl imports it in every
process that builds an engine). This package module imports nothing, so the driver can read
``engine_settings`` without importing verl's checkpoint engines.
"""
