import pytest
import torch
from torch import nn

from examples.models import GPT, EncoderDecoder
from lightning_pipe.graph.capture import capture
from lightning_pipe.plan.balance import balance_by_weight
from lightning_pipe.plan.schedule import BackwardState, backward_states, clock_cycles
from lightning_pipe.runtime.build import build
from lightning_pipe.runtime.gpipe import Pipeline

CPU = torch.device("cpu")


def _pipeline(model, stages, chunks, leaf_modules=()):
    captured = capture(model, leaf_modules)
    balance = balance_by_weight(captured.param_bytes(), stages)
    return Pipeline(build(captured, model, balance, [CPU] * stages), model, chunks, CPU)


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_output_and_gradients_equal_the_plain_module(chunks):
    torch.manual_seed(0)
    model = EncoderDecoder()
    src, tgt = torch.randint(64, (10, 6)), torch.randint(64, (10, 6))
    expected = model(src, tgt)
    expected.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = _pipeline(model, 3, chunks)(src, tgt=tgt)
    assert torch.allclose(out, expected, atol=1e-6)
    out.square().mean().backward()
    for p, g in zip(model.parameters(), grads):
        assert torch.allclose(p.grad, g, atol=1e-6)


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, tag):
        ctx.log, ctx.tag = log, tag
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.tag)
        return grad, None, None


class Probe(nn.Module):
    """Logs (name, micro-batch) in forward and backward; micro-batches count calls."""

    def __init__(self, name, log):
        super().__init__()
        self.name, self.log, self.calls = name, log, 0

    def forward(self, x):
        tag = (self.name, self.calls)
        self.calls += 1
        self.log.append(("fwd", *tag))
        return _Log.apply(x, self.log, ("bwd", *tag))


class Probed(nn.Module):
    def __init__(self, log):
        super().__init__()
        self.l0, self.p0 = nn.Linear(4, 4), Probe("s0", log)
        self.l1, self.p1 = nn.Linear(4, 4), Probe("s1", log)

    def forward(self, x):
        return self.p1(self.l1(self.p0(self.l0(x))))


def test_clock_cycle_forward_and_reverse_backward_per_stage():
    log = []
    pipe = _pipeline(Probed(log), 2, 3, leaf_modules=["Probe"])
    pipe(torch.randn(6, 4)).sum().backward()
    forwards = [t[1:] for t in log if t[0] == "fwd"]
    assert forwards == [("s0", 0), ("s0", 1), ("s1", 0), ("s0", 2), ("s1", 1), ("s1", 2)]
    for stage in ("s0", "s1"):
        assert [m for kind, s, m in log if kind == "bwd" and s == stage] == [2, 1, 0]


def test_no_grad_forward_keeps_no_graph():
    model = GPT(layers=2)
    batch = {"input_ids": torch.randint(96, (4, 16))}
    with torch.no_grad():
        out = _pipeline(model, 2, 2)(batch)
    assert not out.requires_grad
    assert torch.allclose(out, model(batch), atol=1e-6)


def test_backward_runs_in_reverse_clock_order_as_the_planner_assumes():
    """The planner's GPipe backward order (what waits where, plan/schedule.py) is the order
    autograd runs the stages' backwards in."""
    log = []
    pipe = _pipeline(Probed(log), 2, 3, leaf_modules=["Probe"])
    pipe(torch.randn(6, 4)).sum().backward()
    ran = [(int(s[1:]), m) for kind, s, m in log if kind == "bwd"]
    # the forward's clock cycles backwards, each cycle's stages last to first
    assert ran == [(j, m) for cycle in reversed(list(clock_cycles(3, 2))) for m, j in reversed(cycle)]
    # the planner's states at each backward (micro-batches held, gradients waiting) are this order's
    done, states = [0, 0], [[], []]
    for s, _ in ran:
        states[s].append(BackwardState(3 - done[s], tuple(done[s] - done[p] if p < s else 0 for p in range(2))))
        done[s] += 1
    assert backward_states("gpipe", 3, 2) == tuple(map(tuple, states))
