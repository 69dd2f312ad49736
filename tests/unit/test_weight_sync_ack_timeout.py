"""The CPU-platform bound on verl's wait for the vLLM worker's weight-sync acks.

verl's real ``BucketedWeightSender`` and ``BucketedWeightReceiver`` (ZMQ + shared memory, as on a
CPU host) talk over an IPC socket in this process; the receiver runs in a thread.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import torch

from qurl_verl.patches.cpu_platform import weight_sync_ack_timeout as ack_timeout

pytestmark = pytest.mark.both_stacks  # reaches vLLM's own code, which differs between the stacks

transfer = pytest.importorskip("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer")
Sender, Receiver = transfer.BucketedWeightSender, transfer.BucketedWeightReceiver
WEIGHTS = [("a.weight", torch.arange(12.0).view(3, 4)), ("b.bias", torch.ones(5, dtype=torch.bfloat16))]


class NoDevice:
    """verl's device module calls, for a CPU host whatever platform this process resolved."""

    def synchronize(self):
        pass

    def empty_cache(self):
        pass


@pytest.fixture
def stock_sender(monkeypatch):
    """verl's sender as shipped (restored after the test), on this host's CPU."""
    for name in ("_init_socket", "async_send_weights"):
        fn = getattr(Sender, name)
        monkeypatch.setattr(Sender, name, getattr(fn, "__wrapped__", fn))
    monkeypatch.setattr(Sender, ack_timeout._MARK, False, raising=False)
    monkeypatch.setattr(transfer, "get_torch_device", lambda: NoDevice())
    monkeypatch.setattr(transfer, "is_support_ipc", lambda: False)
    monkeypatch.delenv(ack_timeout.ACK_TIMEOUT_ENV, raising=False)


@pytest.fixture
def patched_sender(stock_sender, monkeypatch):
    assert ack_timeout.apply() == "patched"
    assert ack_timeout.apply() == ""
    monkeypatch.setenv(ack_timeout.ACK_TIMEOUT_ENV, "0.5")


@pytest.fixture
def handle(tmp_path):
    return f"ipc://{tmp_path}/sync-{uuid.uuid4().hex[:8]}.sock"


def start_receiver(handle: str, on_bucket_received) -> tuple[threading.Thread, list[type]]:
    """verl's receiver in a thread, as ``update_weights_from_ipc`` runs it in the vLLM worker."""
    errors: list[type] = []

    def receive():
        receiver = Receiver(handle, torch.device("cpu"), use_shm=True)
        try:
            receiver.receive_weights(on_bucket_received)
        except Exception as e:  # noqa: BLE001 - inspected by the test
            errors.append(type(e))
        if receiver.shm is not None:  # left open by verl's failed cleanup; the tensor views are gone now
            receiver.shm.close()

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    return thread, errors


def send(handle: str):
    sender = Sender(handle, bucket_size_mb=1, use_shm=True)
    asyncio.run(sender.async_send_weights(iter(WEIGHTS)))
    return sender


def failing_load(weights, is_last):
    """What vLLM-CPU's stock dispatch made verl's load do (see vllm_cpu_unquantized_gemm)."""
    raise AttributeError("'Parameter' object has no attribute 'weight_loader'")


def test_stock_sender_waits_as_long_as_the_last_ack_does_not_come(stock_sender, handle):
    """A receiver that takes the last bucket and withholds its ack, as a failed one does; it
    acks after the check so that the sender's thread ends."""
    import zmq

    sender_thread = threading.Thread(target=send, args=(handle,), daemon=True)
    sender_thread.start()
    socket = zmq.Context.instance().socket(zmq.REP)
    socket.connect(handle)
    try:
        socket.recv_pyobj()  # the shared-memory buffer
        socket.send(b"")
        assert socket.recv_pyobj()["is_last"]
        sender_thread.join(timeout=3.0)
        assert sender_thread.is_alive()  # blocked in socket.recv(), with no bound
        socket.send(b"")
        sender_thread.join(timeout=10)
        assert not sender_thread.is_alive()
    finally:
        socket.close(linger=0)


def test_patched_sender_raises_instead_of_waiting(patched_sender, handle, tmp_path):
    receiver, errors = start_receiver(handle, failing_load)
    raised: list[BaseException] = []

    def send_and_record():
        try:
            send(handle)
        except BaseException as e:  # noqa: BLE001 - inspected below
            raised.append(e)

    sender_thread = threading.Thread(target=send_and_record, daemon=True)
    start = time.monotonic()
    sender_thread.start()
    sender_thread.join(timeout=10)
    assert not sender_thread.is_alive(), "the sender is still waiting for an ack"
    assert time.monotonic() - start < 10
    assert len(raised) == 1 and isinstance(raised[0], TimeoutError), raised
    assert "no ack from the vLLM worker" in str(raised[0])
    receiver.join(timeout=10)
    assert errors and errors[0] in (AttributeError, BufferError), errors
    assert not any(tmp_path.glob("sync-*.sock"))  # the sender's cleanup ran


def test_patched_sender_delivers_a_sync_that_acks(patched_sender, handle):
    received = {}

    def load(weights, is_last):
        received.update((name, t.clone()) for name, t in weights)

    receiver, errors = start_receiver(handle, load)
    send(handle)
    receiver.join(timeout=10)
    assert not errors and not receiver.is_alive()
    assert set(received) == {name for name, _ in WEIGHTS}
    for name, tensor in WEIGHTS:
        assert torch.equal(received[name], tensor)


def test_zero_turns_the_bound_off(stock_sender, monkeypatch, handle):
    import zmq

    assert ack_timeout.apply() == "patched"
    monkeypatch.setenv(ack_timeout.ACK_TIMEOUT_ENV, "0")
    sender = Sender(handle, bucket_size_mb=1, use_shm=True)
    sender._init_socket()
    try:
        assert sender.socket.getsockopt(zmq.RCVTIMEO) == -1
        assert sender.socket.getsockopt(zmq.LINGER) == 0
    finally:
        sender.socket.close()
