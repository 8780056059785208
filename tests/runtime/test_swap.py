from contextlib import contextmanager

import pytest
import torch
from torch import nn

from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.runtime import swap
from lightning_pipe.runtime.build import build

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _own_pool(monkeypatch):
    monkeypatch.setattr(swap, "pool", swap.HostPool())


def test_parameters_and_their_views_stay_on_the_device():
    linear, x = nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    hooks = swap.to_host(inputs=(x,))
    with hooks:
        torch.tanh(linear(x))  # linear saves x and W.t(), a view of W
    assert [s.nbytes for s in hooks.swapped] == [4 * 8 * 4]  # tanh's result only


def test_views_of_one_storage_share_one_host_copy_and_come_back_equal():
    base = torch.randn(6, 8, requires_grad=True)
    expected = torch.autograd.grad(((base * 2)[:3] * (base * 2)[3:]).sum(), base)[0]
    hooks = swap.to_host(inputs=(base,))
    with hooks:
        x = base * 2  # made inside the region
        out = (x[:3] * x[3:]).sum()  # mul saves two views of x's one storage
    assert len(hooks.swapped) == 1 and hooks.swapped[0].nbytes == 6 * 8 * 4
    assert torch.equal(torch.autograd.grad(out, base)[0], expected)


def test_saved_tensors_go_to_host_and_gradients_are_unchanged(monkeypatch):
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(32, 32))
    expected = torch.autograd.grad((torch.tanh(x @ w) * 2).sum(), [x, w])
    hooks = swap.to_host()
    with hooks:
        out = torch.tanh(x @ w) * 2
    kinds = [type(s) for s in hooks.swapped]
    assert kinds and all(k is swap.Swapped for k in kinds)  # x and tanh's result; not w (a parameter)
    assert [s.nbytes for s in hooks.swapped] == [16 * 32 * 4] * 2
    started = []
    prefetch = swap.Swapped.prefetch
    monkeypatch.setattr(swap.Swapped, "prefetch", lambda s: (started.append(s), prefetch(s)))
    swap.prefetch(out, hooks.swapped)
    got = torch.autograd.grad(out.sum(), [x, w])
    assert set(map(id, started)) == set(map(id, hooks.swapped))  # every one, when backward reached out
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_host_buffers_are_not_charged_and_are_reused():
    meter = MemoryMeter(1)
    x = torch.randn(64, 64)
    with meter, meter.running(0):
        s = swap.Swapped(x)
        host = s.host
        assert meter.stages[0].total == 0  # the host copy is not device memory
        del s
        again = swap.Swapped(x)
    assert again.host is host


def test_pool_keeps_only_what_a_step_had_out_at_once():
    """Whenever every buffer is back, the pool releases sizes no swap took since, and of the
    others keeps as many as were out at once: it does not grow with changing shapes."""
    a, b = torch.randn(8, 8), torch.randn(4, 4)
    step = [swap.Swapped(a) for _ in range(3)]  # three micro-batches' worth out at once
    del step
    assert swap.pool.nbytes() == 3 * a.nelement() * 4
    for _ in range(2):  # the next steps see another shape, one at a time
        one = swap.Swapped(b)
        del one
        assert swap.pool.nbytes() == b.nelement() * 4


def test_copies_run_on_the_side_stream_and_the_loaded_buffer_is_recorded_on_the_compute_stream(monkeypatch):
    """The stream calls, on stand-in streams: the swap-out waits for the compute stream and
    records the device tensor on the side stream; the copy back is allocated and written
    under the side stream and recorded on the compute stream that reads it."""
    log = []
    inside: list[str] = []

    @contextmanager
    def use(stream):
        inside.append(stream)
        log.append(("use", stream))
        yield
        inside.pop()

    monkeypatch.setattr(swap, "side_stream", lambda device: "side")
    monkeypatch.setattr(swap, "current_stream", lambda device: "compute")
    monkeypatch.setattr(swap, "use_stream", use)
    monkeypatch.setattr(swap, "wait_stream", lambda a, b: log.append(("wait", a, b)))
    monkeypatch.setattr(swap, "wait_event", lambda s, e: log.append(("wait event", s, e)))
    monkeypatch.setattr(swap, "record_stream", lambda t, s: log.append(("record", t.untyped_storage().data_ptr(), s)))
    events = iter(range(100))
    monkeypatch.setattr(swap, "record_event", lambda s: (log.append(("event", s)), next(events))[1])
    empty = torch.empty

    def tracked_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        log.append(("alloc", t.device.type, inside[-1] if inside else None))
        return t

    monkeypatch.setattr(torch, "empty", tracked_empty)
    x = torch.randn(4, 4, requires_grad=True)
    hooks = swap.to_host(inputs=(x,))
    with hooks:
        y = torch.exp(x)  # saves its result
    out = y.sum()
    made = y.untyped_storage().data_ptr()
    assert log == [
        ("alloc", "cpu", None),  # the host buffer (from the pool)
        ("wait", "side", "compute"),
        ("use", "side"),
        ("record", made, "side"),
        ("event", "side"),
    ]
    log.clear()
    out.backward()
    assert log == [
        ("use", "side"),
        ("alloc", "cpu", "side"),  # allocated on the stream that writes it
        ("event", "side"),
        ("wait event", "compute", 1),  # the compute stream waits for that copy
        ("record", log[-1][1], "compute"),
    ]


def test_prefetch_starts_when_the_next_segment_s_backward_begins(monkeypatch):
    """A swapped segment's tensors start coming back when backward reaches the segment after
    it, so the copy overlaps that segment's backward, not at its own backward."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    model = Net()
    captured = capture(model)
    names = [n.name for n in captured.nodes]
    assert names == ["a", "tanh", "b", "tanh_1", "c"]
    program = build(captured, model, [5], [CPU], {"a": "swap", "tanh": "swap"})
    (stage,) = program.stages
    assert [s.policy for s in stage.segments] == ["swap", "keep"]
    log = []
    prefetch = swap.Swapped.prefetch

    def logged(s):
        if s.loaded is None:
            log.append("prefetch")
        prefetch(s)

    monkeypatch.setattr(swap.Swapped, "prefetch", logged)
    model.c.register_full_backward_pre_hook(lambda *_: log.append("c begins"))
    model.b.register_full_backward_hook(lambda *_: log.append("b done"))
    model.a.register_full_backward_pre_hook(lambda *_: log.append("a begins"))
    x = torch.randn(4, 8, requires_grad=True)
    (out,) = stage(x)
    assert log == []  # nothing comes back during forward
    out.sum().backward()
    # Before: at "a begins" (the segment's own backward), after the next segment's was done.
    assert log.count("prefetch") == 1  # tanh's result; a saves the stage's input and its weight
    assert log.index("prefetch") < log.index("b done") and log[-1] == "a begins"
