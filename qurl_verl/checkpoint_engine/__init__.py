"""Checkpoint engines for verl's disaggregated modes (``separate_async``, one-step-off, fully async).

``qurl_int8`` (``int8_engine``): quantizes the trainer's weights on the trainer side, with the run's
``RolloutSettings``, and sends 8-bit codes + fp32 scales (+ the full-precision rest) to the rollout.
Selected with ``actor_rollout_ref.rollout.checkpoint_engine.backend=qurl_int8``; registered by the
``verl.plugins`` entry point and by ``custom_backend_module=qurl_verl.checkpoint_engine``.
"""
from __future__ import annotations

from .int8_engine import ENGINE_NAME, QurlInt8CheckpointEngine

__all__ = ["ENGINE_NAME", "QurlInt8CheckpointEngine"]
