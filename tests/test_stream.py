import time

import pytest
import torch

from lightning_pipe.stream import (
    CPUEvent,
    CPUStream,
    current_stream,
    elapsed_ms,
    is_cuda,
    record_event,
    record_stream,
    side_stream,
    synchronize,
    use_stream,
    wait_event,
    wait_stream,
)

CPU = torch.device("cpu")


def test_the_cpu_stands_in_for_every_stream_and_the_calls_do_nothing():
    assert current_stream(CPU) is CPUStream and side_stream(CPU) is CPUStream and not is_cuda(CPUStream)
    x = torch.ones(3)
    with use_stream(CPUStream):
        y = x * 2
    wait_stream(CPUStream, CPUStream)
    record_stream(y, CPUStream)
    event = record_event(CPUStream)
    wait_event(CPUStream, event)
    synchronize(event)
    assert torch.equal(y, torch.full((3,), 2.0))


def test_cpu_events_measure_wall_time():
    start = record_event(CPUStream, timing=True)
    time.sleep(0.02)
    end = record_event(CPUStream, timing=True)
    assert isinstance(start, CPUEvent) and 15 < elapsed_ms(start, end) < 1000


@pytest.mark.cuda
def test_one_side_stream_per_device_beside_the_compute_stream():
    device = torch.device("cuda", 0)
    side = side_stream(device)
    assert is_cuda(side) and side is side_stream(torch.device("cuda")) and side != current_stream(device)


@pytest.mark.cuda
def test_waiting_orders_streams_and_events_time_the_device():
    device = torch.device("cuda", 0)
    compute, side = current_stream(device), side_stream(device)
    x = torch.zeros(1, device=device)
    start = record_event(compute, timing=True)
    torch.cuda._sleep(50_000_000)
    x.fill_(1.0)
    end = record_event(compute, timing=True)
    wait_stream(side, compute)
    with use_stream(side):
        y = x + 1  # runs after the fill
    record_stream(x, side)
    wait_stream(CPUStream, side)  # the host blocks until the side stream is done
    assert y.item() == 2.0
    assert elapsed_ms(start, end) > 1.0
