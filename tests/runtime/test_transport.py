from contextlib import contextmanager

import pytest
import torch

from lightning_pipe.runtime import transport
from lightning_pipe.runtime.transport import move


def test_move_keeps_structure_and_identity_on_same_device():
    x = torch.ones(2, requires_grad=True)
    moved = move({"x": x, "n": 3}, torch.device("cpu"))
    assert moved["x"] is x and moved["n"] == 3


def test_copy_waits_for_the_producer_and_makes_the_consumer_wait(monkeypatch):
    """The stream protocol, on stand-in streams (the CPU's are no-ops, so this is the code a
    GPU runs): the source's side stream waits for the producer's stream, the copy is queued
    with the source's and the destination's side streams both current (a copy between GPUs
    then waits for neither device's queued compute), the source is recorded on the side stream
    that reads it, the consumer's stream waits for the copy, and the copy is recorded on the
    consumer's stream."""
    log = []

    @contextmanager
    def use(stream):
        log.append(("use", stream))
        yield
        log.append(("done", stream))

    monkeypatch.setattr(transport, "current_stream", lambda device: f"{device.type} compute")
    monkeypatch.setattr(transport, "side_stream", lambda device: f"{device.type} side")
    monkeypatch.setattr(transport, "use_stream", use)
    monkeypatch.setattr(transport, "wait_stream", lambda waiting, target: log.append(("wait", waiting, target)))
    monkeypatch.setattr(transport, "record_stream", lambda t, stream: log.append(("record", t, stream)))
    x = torch.randn(3, requires_grad=True)
    y = move(x, torch.device("meta"))  # a second device type a CPU-only build has
    assert y.device.type == "meta" and y.requires_grad
    assert log == [
        ("wait", "cpu side", "cpu compute"),
        ("use", "cpu side"),
        ("use", "meta side"),
        ("done", "meta side"),
        ("done", "cpu side"),
        ("record", x, "cpu side"),
        ("wait", "meta compute", "meta side"),
        ("wait", "meta compute", "cpu side"),
        ("record", y, "meta compute"),
    ]


@pytest.mark.cuda
def test_move_across_devices_carries_gradients_back():
    x = torch.randn(4, 3, requires_grad=True)
    y = move(x, torch.device("cuda", 0))
    assert y.device.type == "cuda"
    z = move(y * 3, torch.device("cpu"))
    z.sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 3.0))


@pytest.mark.cuda
def test_consumers_see_what_a_slow_producer_wrote():
    """A kernel still running on the producer's stream when the copy is queued: the copy
    waits for it, and a CPU consumer waits for the copy (torchgpipe's test with cuda_sleep)."""
    device = torch.device("cuda", 0)
    x = torch.zeros(1024, device=device)
    torch.cuda._sleep(100_000_000)  # ~0.1 s of GPU time on the compute stream
    x.fill_(1.0)
    assert torch.equal(move(x, torch.device("cpu")), torch.ones(1024))
    host = torch.ones(1024).pin_memory()
    on_device = move(host, device)
    assert torch.equal(on_device * 2, torch.full((1024,), 2.0, device=device))
