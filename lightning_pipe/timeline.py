"""Timeline: predict each stage's peak by replaying a schedule's task order over memory events.

The closed formula of :mod:`lightning_pipe.memory` is what the partitioners search with; this
replay is the finer prediction to check a split against: it knows when each micro-batch's
activations appear and go, when gradients first exist, and how long the gradients a stage
sends back stay alive.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from lightning_pipe.memory import stage_ranges
from lightning_pipe.profile import Profile
from lightning_pipe.schedule import clock_cycles

__all__ = ["StageCosts", "Task", "gpipe_order", "replay_peaks", "stage_costs"]


class Task(NamedTuple):
    kind: Literal["forward", "backward"]
    microbatch: int
    stage: int


def gpipe_order(num_microbatches: int, num_stages: int) -> list[Task]:
    """The order tasks run in under autograd-driven GPipe in one process: forwards by clock
    cycle, then backwards in exactly the reverse order (autograd runs the most recently
    created work first, and fork/join keeps micro-batches in reverse per stage)."""
    forward = [Task("forward", i, j) for tick in clock_cycles(num_microbatches, num_stages) for i, j in tick]
    return forward + [Task("backward", i, j) for _, i, j in reversed(forward)]


@dataclass
class StageCosts:
    """One stage's memory terms for one micro-batch (bytes)."""

    static: int  # parameters and optimizer state
    grads: int
    stashed: int  # activations kept for backward
    sent: int  # outputs read by later stages and not stashed: live until the last reader ran
    forward_peak: int  # workspace while a forward runs
    backward_peak: int  # fresh gradients and workspace while a backward runs
    input_grads: int  # gradients of the stage's inputs, which its backward sends back
    last_reader: int  # last stage reading this stage's outputs (-1: none)


def stage_costs(profile: Profile, balance: Sequence[int]) -> list[StageCosts]:
    """Per-stage memory terms of a split."""
    ranges = stage_ranges(balance)
    stage_of = {i: s for s, r in enumerate(ranges) for i in r}
    costs = []
    for r in ranges:
        nodes = [profile.nodes[i] for i in r]
        leaving = [n for n in nodes if any(u < 0 or u >= r.stop for u in n.users)]
        readers = [stage_of[u] for n in nodes for u in n.users if u >= r.stop]
        entering = [n for n in profile.nodes[: r.start] if any(u in r for u in n.users)]
        costs.append(
            StageCosts(
                static=sum(n.param_bytes + n.optimizer_bytes for n in nodes),
                grads=sum(n.grad_bytes for n in nodes),
                stashed=sum(n.saved_bytes for n in nodes),
                sent=sum(max(0, n.output_bytes - n.saved_bytes) for n in leaving),
                forward_peak=max(n.transient_bytes for n in nodes),
                backward_peak=max(n.backward_bytes for n in nodes),
                input_grads=sum(n.output_grad_bytes for n in entering),
                last_reader=max(readers, default=-1),
            )
        )
    return costs


def replay_peaks(
    profile: Profile, balance: Sequence[int], order: Sequence[Task], grads_in_forward: bool = True
) -> list[int]:
    """Predicted peak bytes of every stage when the tasks run in ``order``.

    A gradient a stage sends back may be a view (e.g. a slice of a concatenation's gradient)
    that stays alive until the micro-batch's backward has left the pipeline, so it is held
    until stage 0's backward of that micro-batch.

    Args:
        grads_in_forward: the previous step's gradients are still alive during the forward
            and freed just before backward, as in Lightning's automatic optimization;
            ``False`` when gradients are set to ``None`` before the forward.
    """
    first_backward = next((k for k, t in enumerate(order) if t.kind == "backward"), len(order))
    peaks = []
    for s, c in enumerate(stage_costs(profile, balance)):
        has_grads = grads_in_forward
        memory = peak = c.static + (c.grads if has_grads else 0)
        for k, task in enumerate(order):
            if k == first_backward and has_grads:
                memory -= c.grads  # zero_grad(set_to_none=True) before backward
                has_grads = False
            if task.stage == s and task.kind == "forward":
                peak = max(peak, memory + c.forward_peak)
                memory += c.stashed + (c.sent if c.last_reader >= 0 else 0)
            elif task.stage == c.last_reader and task.kind == "forward":
                memory -= c.sent
            elif task.stage == s:
                peak = max(peak, memory + c.backward_peak)
                memory += c.input_grads - c.stashed + (0 if has_grads else c.grads)
                has_grads = True
            if task.stage == 0 and task.kind == "backward":
                memory -= c.input_grads
        peaks.append(peak)
    return peaks
