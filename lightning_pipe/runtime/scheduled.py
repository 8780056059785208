"""Run, schedule-driven: each micro-batch's backward at its place in a schedule (1F1B, 2BW).

The user's ``training_step`` runs once per micro-batch and its ``self(x)`` runs that micro-
batch's forward through every stage at once, so a micro-batch's forwards are contiguous.
Stages are cut apart in autograd so that one stage's backward can run on its own: its
outputs' gradients arrive from the stages that read them, and the gradients of its inputs go
back to the stages that made them. Between its forward and backward a micro-batch holds no
boundary value beyond what autograd saves: a stage keeps only the gradient edges of its
outputs, and its inputs hand their gradients over without being leaves that must stay alive.

``training_step`` may call ``self(x)`` several times per micro-batch (two augmented views, a
teacher pass under ``no_grad``): each call's values get keys of their own, and a stage's
backward of the micro-batch runs the backward of all its calls at once.
"""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.fx.node import map_aggregate

from lightning_pipe.internals import tree_flatten, tree_unflatten
from lightning_pipe.measure.clock import StageClock
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.runtime.build import Program
from lightning_pipe.runtime.transport import move

__all__ = ["ScheduledPipeline"]


Key = tuple[int, str, int]  # the call, a value's name and the index of a tensor among its pytree leaves


@dataclass
class _Record:
    """What a micro-batch left at one stage for its backward: where the outputs of each of
    its calls enter autograd (edges, not tensors, so the output values can be freed once read)."""

    outputs: dict[Key, GradientEdge] = field(default_factory=dict)


class ScheduledPipeline:
    """Forward of one micro-batch at a time, backward one stage at a time."""

    def __init__(
        self,
        program: Program,
        output_device: torch.device,
        meter: MemoryMeter | None = None,
        clock: StageClock | None = None,
    ) -> None:
        self.program = program
        self.output_device = output_device
        self.meter = meter
        self.clock = clock
        self.microbatch = 0  # set by the caller before each micro-batch's forward
        self.active = False  # the module's forward is routed here only while True
        self._records: dict[tuple[int, int], _Record] = {}
        self._calls = 0  # numbers every call, so that several calls per micro-batch keep apart
        self._grads: dict[int, dict[Key, tuple[int, Tensor]]] = {}  # waiting gradients and their holder

    def __call__(self, root: nn.Module, *args: Any, **kwargs: Any) -> Any:
        i, call = self.microbatch, self._calls
        self._calls += 1
        if not self._records:  # a new batch: borrowed parameters may have changed
            self.program.lender.new_batch()
        made: set[str] = set()
        env = {**self.program.bind(args, kwargs), **self.program.attribute_values(root)}
        for stage in self.program.stages:
            record = self._records.setdefault((i, stage.index), _Record())
            received: dict[Key, Tensor] = {}
            with self.meter.running(stage.index) if self.meter else nullcontext():
                inputs = []
                for name in stage.inputs:
                    value = self.program.fetch(name, env[name], stage.device)
                    if name in made:  # cut autograd at the stage boundary
                        value = _receive((call, name), value, received, partial(self._deliver, i, stage.index))
                    inputs.append(value)
                with self.clock.forward(stage.index, stage.device) if self.clock else nullcontext():
                    outputs = stage(*inputs)
            if self.meter:
                self.meter.tag_backward(outputs, stage.index)
                self.meter.mark(outputs, "boundary")
            for name, value in zip(stage.outputs, outputs):
                record.outputs.update((key, get_gradient_edge(t)) for key, t in _tensors((call, name), value).items())
            env.update(zip(stage.outputs, outputs))
            made.update(stage.outputs)
        leaves: dict[Key, Tensor] = {}
        on_grad = partial(self._output_grad, i)
        last = len(self.program.stages) - 1

        def output(name: Any) -> Any:  # a value's name
            if name not in made:
                return env[name]
            # on the output device, the last stage's: the loss holds its copy there, not the maker its own
            value = _cut((call, name), move(env[name], self.output_device), leaves, on_grad)
            if self.meter:
                self.meter.keep(last, [value], "boundary")
            return value

        return map_aggregate(self.program.output, output)

    def abandon(self) -> None:
        """Drop what a batch that failed part-way left for its backwards (so its tensors go)."""
        self._records.clear()
        self._grads.clear()
        self.active = False

    def ran(self, microbatch: int) -> bool:
        """Whether ``microbatch``'s forward ran through the pipeline and waits for its backward."""
        return (microbatch, len(self.program.stages) - 1) in self._records

    def backward(self, microbatch: int, stage: int, loss: Tensor | None = None) -> None:
        """Run ``stage``'s backward of ``microbatch``; the last stage's first runs ``loss``'s
        (which hands the outputs' gradients on, see :meth:`_output_grad`)."""
        if loss is not None:
            torch.autograd.backward(loss)
        grads = self._grads.setdefault(microbatch, {})
        record = self._records.pop((microbatch, stage))
        pairs = [(edge, grads.pop(key)[1]) for key, edge in record.outputs.items() if key in grads]
        if pairs:
            device = self.program.stages[stage].device
            with self.clock.backward(stage, device) if self.clock else nullcontext():
                # the stage's inputs deliver their gradients (see _Receive)
                torch.autograd.backward([e for e, _ in pairs], [move(g, device) for _, g in pairs])
        if not self._records.keys() & {(microbatch, s) for s in range(len(self.program.stages))}:
            self._grads.pop(microbatch, None)

    def _output_grad(self, microbatch: int, key: Key, leaf: Tensor) -> None:
        """Hand the gradient of a pipeline output on to the stage that made it. It must arrive
        from the loss, before the last stage's backward of the micro-batch: a gradient
        arriving later came through a stage's backward, from an output fed back into
        ``self(...)``, and would need that stage's backward to run again."""
        last = len(self.program.stages) - 1
        if (microbatch, last) not in self._records:
            raise RuntimeError(
                "The output of one self(...) call in training_step was fed into another self(...) "
                "call of the same micro-batch. Under schedule='1f1b' or '2bw' every stage's backward "
                "of a micro-batch runs once, in the schedule's order, so a gradient cannot flow back "
                "through the pipeline twice. Use schedule='gpipe' for such a training_step, or feed "
                "the second call a detached output."
            )
        assert leaf.grad is not None
        self._deliver(microbatch, last, key, leaf.grad)
        leaf.grad = None  # the user's graph may still hold the leaf; the gradient is handed on

    def _deliver(self, microbatch: int, stage: int, key: Key, grad: Tensor) -> None:
        """Keep a gradient ``stage``'s backward computed for an earlier stage's output until
        that stage's backward. A value read by several stages gets the sum of their gradients,
        held where the first arrived (the last reader's device, which stashes fewer
        micro-batches than the producer under 1F1B); the meter charges it there too."""
        grads = self._grads.setdefault(microbatch, {})
        if key in grads:
            holder, total = grads[key]
            grad = total + move(grad, total.device)
        else:
            holder = stage
            if grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
                grad = grad.clone()  # a view (say, a slice of cat's gradient) would keep all its storage waiting
        grads[key] = holder, grad
        if self.meter:
            self.meter.own(holder, [grad], "boundary")


def _tensors(name: tuple[int, str], value: Any) -> dict[Key, Tensor]:
    leaves = tree_flatten(value)[0]
    return {(*name, k): t for k, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad}


def _receive(
    name: tuple[int, str], value: Any, received: dict[Key, Tensor], deliver: Callable[[Key, Tensor], None]
) -> Any:
    """``value`` as a stage's input: every tensor that needs grad becomes the output of a
    :class:`_Receive` (one per tensor however often the stage reads the value)."""
    flat, spec = tree_flatten(value)
    for k, t in enumerate(flat):
        if isinstance(t, Tensor) and t.requires_grad:
            key = (*name, k)
            if key not in received:
                received[key] = cast(Tensor, _Receive.apply(_PHONY, t.detach(), deliver, key))  # type: ignore[no-untyped-call]
            flat[k] = received[key]
    return tree_unflatten(flat, spec)


_PHONY = torch.empty(0, requires_grad=True)  # makes _Receive's output require grad


class _Receive(torch.autograd.Function):
    """Identity whose backward delivers the gradient to where the producing stage's backward
    picks it up. Unlike a detached leaf, nothing here
    holds the value, so it lives only as long as the stage's own graph saves it. The output
    aliases the received storage without being an autograd view of it (a view made in a custom
    Function may not be written in place: a stage starting with ``ReLU(inplace=True)``), so
    the stage's in-place write needs no copy."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, x: Tensor, deliver: Callable[[Key, Tensor], None], key: Key) -> Tensor:
        ctx.deliver, ctx.key = deliver, key
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None]:
        ctx.deliver(ctx.key, grad)
        return None, None, None, None


def _cut(
    name: tuple[int, str], value: Any, leaves: dict[Key, Tensor], on_grad: Callable[[Key, Tensor], None]
) -> Any:
    """``value`` with every tensor that needs grad replaced by a detached leaf (one per tensor
    however often the value is read) that calls ``on_grad`` once its gradient has arrived. Only
    the user's graph holds the leaf: an output the loss does not use is freed at once."""
    flat, spec = tree_flatten(value)
    for k, t in enumerate(flat):
        if isinstance(t, Tensor) and t.requires_grad:
            key = (*name, k)
            if key not in leaves:
                leaves[key] = t.detach().requires_grad_()
                leaves[key].register_post_accumulate_grad_hook(partial(on_grad, key))  # type: ignore[no-untyped-call]
            flat[k] = leaves[key]
    return tree_unflatten(flat, spec)

