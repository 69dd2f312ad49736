"""Bound the wait for the vLLM worker's acks in verl's stock weight sync on the CPU platform.

Targets: verl 0.9.1, ``BucketedWeightSender`` in
``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py`` (REQ socket bound in
``_init_socket``; a blocking ``socket.recv()`` for every ack in ``_init_buffer``,
``_direct_send_large_weight`` and ``async_send_weights``), as driven by
``vLLMRollout.update_weights`` (``verl/workers/rollout/vllm_rollout/vllm_rollout.py``).

Why: the sender waits for each ack with no timeout. When the receiver
(``update_weights_from_ipc`` in the vLLM worker) fails, the ack never comes: its error sits in a
Ray future that verl awaits only after the sender returns, so the run hangs for ever (and the
blocking ``recv`` stalls the trainer actor's event loop meanwhile). With a receive timeout on the
socket the sender gives up, its own cleanup runs (socket, IPC path, shared memory) and the sync
raises a ``TimeoutError`` that points at the worker's log. ``LINGER`` 0 keeps the close (and the
interpreter's exit) from waiting on a message nobody will take.

When: the plugin calls ``apply()`` on the CPU platform, in every process (the sender lives in the
trainer's worker). verl's module is patched when it is imported, or at once if it already is;
nothing is imported here. Each ack may take ``QURL_WEIGHT_SYNC_ACK_TIMEOUT_S`` seconds (default
600, far above the seconds a bucket takes to load on a CPU; 0 turns the bound off), read when the
socket opens. A sync whose acks come in time behaves exactly as before.
"""
from __future__ import annotations

import functools
import os

from qurl_verl.patches.contract import Patch, wrap_once
from qurl_verl.patches.on_import import patch_now_or_on_import

TARGET_MODULE = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"
ACK_TIMEOUT_ENV = "QURL_WEIGHT_SYNC_ACK_TIMEOUT_S"
DEFAULT_ACK_TIMEOUT_S = 600.0
_MARK = "_qurl_ack_timeout"


def ack_timeout_s() -> float:
    return float(os.environ.get(ACK_TIMEOUT_ENV, DEFAULT_ACK_TIMEOUT_S))


def bounded_socket_for(init_socket):
    import zmq

    @functools.wraps(init_socket)
    def _init_socket(self):
        init_socket(self)
        self._qurl_ack_timeout_s = ack_timeout_s()
        if self._qurl_ack_timeout_s > 0:
            self.socket.setsockopt(zmq.RCVTIMEO, max(1, int(self._qurl_ack_timeout_s * 1000)))
        self.socket.setsockopt(zmq.LINGER, 0)

    return _init_socket


def timeout_error_for(send_weights):
    import zmq

    @functools.wraps(send_weights)
    async def async_send_weights(self, weights):
        try:
            return await send_weights(self, weights)
        except zmq.Again as e:
            raise TimeoutError(
                f"verl weight sync: no ack from the vLLM worker on {self.zmq_handle} within "
                f"{getattr(self, '_qurl_ack_timeout_s', ack_timeout_s()):g} s ({ACK_TIMEOUT_ENV}); its update_weights_from_ipc "
                "most likely failed: see the vLLM worker's error in the log above"
            ) from e

    return async_send_weights


def patch_sender(module) -> str:
    """Wrap ``BucketedWeightSender``'s socket setup and send; "" if already done or absent."""
    sender_cls = getattr(module, "BucketedWeightSender", None)
    if sender_cls is None:
        return ""
    did = [wrap_once(sender_cls, "_init_socket", bounded_socket_for, _MARK),
           wrap_once(sender_cls, "async_send_weights", timeout_error_for, _MARK)]
    return ", ".join(d for d in did if d)


PATCH = Patch(
    module=__name__,
    target=f"{TARGET_MODULE}:BucketedWeightSender._init_socket",  # and .async_send_weights
    package="verl",
    versions=("0.9.1",),
    when="on the CPU platform, in every process, whether or not verl's module is imported yet",
    change=lambda: patch_now_or_on_import(TARGET_MODULE, patch_sender),
)


def apply() -> str:
    """Bound every ack wait of verl's sender in this process (see above); "" if already done."""
    return PATCH.apply()
