import time

import torch

from lightning_pipe.measure import clock
from lightning_pipe.measure.clock import StageClock

CPU, META = torch.device("cpu"), torch.device("meta")


def _stand_ins(monkeypatch):
    """Events numbered in recording order on stand-in streams; a span of events a..b reads
    as 10 * (b - a) ms. Returns the log of recordings and reads."""
    log = []
    monkeypatch.setattr(clock, "current_stream", lambda device: f"{device.type} stream")

    def record(stream, timing):
        log.append(("event", stream))
        return len(log)

    monkeypatch.setattr(clock, "record_event", record)
    monkeypatch.setattr(clock, "elapsed_ms", lambda a, b: (log.append(("read", a, b)), 10.0 * (b - a))[1])
    return log


def test_spans_are_events_on_the_stage_device_s_stream_read_at_the_step_end(monkeypatch):
    log = _stand_ins(monkeypatch)
    c = StageClock(2)
    with c.forward(0, CPU):
        pass
    with c.backward(1, META):
        pass
    assert log == [("event", "cpu stream")] * 2 + [("event", "meta stream")] * 2  # nothing waited for yet
    assert c.forward_ms == [10.0, 0.0] and c.backward_ms == [0.0, 10.0]
    assert [e for e in log if e[0] == "read"] == [("read", 1, 2), ("read", 3, 4)]  # each span read once
    c.reset()
    assert c.forward_ms == [0.0, 0.0]


def test_autograd_driven_backward_is_marked_on_each_stage_s_device(monkeypatch):
    log = _stand_ins(monkeypatch)
    c = StageClock(2)
    x = torch.randn(4, requires_grad=True)
    a = x * 2
    c.watch_backward(a, 0)
    b = a * 3
    c.watch_backward(b, 1)
    b.sum().backward()
    c.end_backward()
    # stage 1 starts (1); stage 0 starts: stage 1 ends (2), stage 0 starts (3); end (4)
    assert log == [("event", "cpu stream")] * 4
    assert c.backward_ms == [10.0, 10.0]


def test_cpu_times_are_wall_clock():
    c = StageClock(1)
    with c.forward(0, CPU):
        time.sleep(0.02)
    assert 15 < c.forward_ms[0] < 1000
