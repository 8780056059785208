"""Borrowed parameters and buffers. On a CPU every stage shares one device and nothing is
copied, so these tests make the borrower's copies real (a clone, as a copy to another device
would be) by patching the lend module's ``move``, and count them."""

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from examples.models import GPT, loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.graph.capture import capture
from lightning_pipe.runtime import lend
from lightning_pipe.runtime.build import build
from lightning_pipe.runtime.gpipe import Pipeline
from lightning_pipe.runtime.scheduled import ScheduledPipeline
from tests.helpers import max_rel_diff, trainer
from tests.models import make

CPU = torch.device("cpu")


@pytest.fixture
def copies(monkeypatch):
    """Counts, per tensor, copies made (``id``) and gradients sent back (``("grad", id)``)."""
    counts: Counter = Counter()

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.key = id(x)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            counts["grad", ctx.key] += 1
            return grad

    def move(value, device):
        counts[id(value)] += 1
        return Copy.apply(value) if value.requires_grad else value.clone()

    monkeypatch.setattr(lend, "move", move)
    return counts


def test_a_tied_weight_is_copied_once_per_batch_and_its_gradient_crosses_once(copies):
    torch.manual_seed(0)
    model = GPT(layers=2)
    reference = copy.deepcopy(model)
    captured = capture(model)
    half = len(captured.nodes) // 2
    program = build(captured, model, [half, len(captured.nodes) - half], [CPU] * 2)
    tied = model.tok_emb.weight
    assert program.stages[1].borrowed == [tied]
    pipe = Pipeline(program, model, 4, CPU)
    batch = {"input_ids": torch.randint(0, 96, (8, 16))}
    for step in (1, 2):
        pipe(batch).square().mean().backward()
        assert copies[id(tied)] == step  # not once per micro-batch (4)
        assert copies["grad", id(tied)] == step  # the 4 micro-batches' gradients are summed first
    reference(batch).square().mean().backward()
    reference(batch).square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_training_with_real_copies_matches_single_device(copies, schedule):
    """Under 1F1B each stage's backward of a micro-batch is its own autograd call, so the
    gradient of the one copy goes back once per micro-batch (holding it on the borrower until
    the batch ends would cost a second gradient's bytes there)."""
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=4, schedule=schedule, planner=None)
    trainer(strategy, 2, max_steps=2).fit(model, loader(data, 8))
    tied = model.tok_emb.weight
    assert copies[id(tied)] == 2
    assert copies["grad", id(tied)] == (2 if schedule == "gpipe" else 2 * 4)
    reference, data = make("gpt")
    trainer("auto", 1, max_steps=2).fit(reference, loader(data, 8))
    assert max_rel_diff(model, reference) < 1e-5


class SharedNorm(nn.Module):
    """One BatchNorm applied twice: with the cut between the uses, two stages share its
    parameters and its running statistics."""

    def __init__(self):
        super().__init__()
        self.l1, self.bn, self.l2, self.head = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.bn(self.l2(self.bn(self.l1(x)))))


def _shared_norm():
    torch.manual_seed(0)
    model = SharedNorm()
    captured = capture(model)
    assert [n.name for n in captured.nodes] == ["l1", "bn", "l2", "bn_1", "head"]
    return model, build(captured, model, [2, 3], [CPU, CPU])


def test_buffers_are_lent_like_parameters_and_updates_land_in_the_one_buffer(copies):
    model, program = _shared_norm()
    reference = copy.deepcopy(model)
    (segment,) = program.stages[1].segments
    assert set(segment.borrowed) == {"bn.weight", "bn.bias"}
    assert set(segment.borrowed_buffers) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    x = torch.randn(16, 8)
    Pipeline(program, model, 1, CPU)(x).sum().backward()
    reference(x).sum().backward()
    assert copies[id(model.bn.running_mean)] == 1  # the second stage read a copy ...
    assert model.bn.num_batches_tracked.item() == 2  # ... and its update came back
    for name, buffer in reference.named_buffers():
        assert torch.allclose(model.get_buffer(name), buffer), name
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_buffer_updates_keep_their_order_across_micro_batches(copies):
    """Schedule-driven, each micro-batch runs through both uses in turn, as the plain module
    run on one micro-batch after the other: the borrower copies the buffer afresh at every call."""
    model, program = _shared_norm()
    reference = copy.deepcopy(model)
    pipe = ScheduledPipeline(program, CPU)
    x = torch.randn(16, 8)
    with torch.no_grad():
        for i, part in enumerate(x.chunk(2)):
            pipe.microbatch = i
            pipe(model, part)
            reference(part)
    assert copies[id(model.bn.running_mean)] == 2
    for name, buffer in reference.named_buffers():
        assert torch.allclose(model.get_buffer(name), buffer), name
