"""Event simulation of one training step: when each stage runs each task, given its times.

The closed forms ((m + L - 1) * (f + b) and the like) hold only for equal stages; the planner
compares plans whose stages differ in compute, recompute, exposed swap and transfer time, so it
replays the schedule's per-stage action lists (:func:`lightning_pipe.plan.schedule.actions`)
instead: a task starts when its stage is free and its input has arrived.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.plan.schedule import Action

__all__ = ["Simulation", "StageTime", "simulate"]


@dataclass
class StageTime:
    """One stage's per micro-batch times (ms). A backward task runs the stage's recompute and
    waits for its exposed swap-in, then its backward; ``send`` is the transfer from this stage
    to the next (activation forward, gradient back)."""

    forward: float
    backward: float
    recompute: float = 0.0
    swap: float = 0.0
    send: float = 0.0

    def duration(self, action: Action) -> float:
        if action.kind == "forward":
            return self.forward
        if action.kind == "backward":
            return self.recompute + self.swap + self.backward
        return 0.0


@dataclass
class Simulation:
    """Step time (ms) and the fraction of stage time spent idle (the bubble)."""

    step_ms: float
    bubble: float


def simulate(times: Sequence[StageTime], schedule: Sequence[Sequence[Action]]) -> Simulation:
    """Replay each stage's action list in order: a forward waits for the previous stage's
    forward of that micro-batch plus the transfer, a backward for the next stage's backward
    plus the transfer (the last stage's for its own forward, which its order puts first)."""
    count = len(times)
    if len(schedule) != count:
        raise ValueError(f"{count} stage times but {len(schedule)} action lists.")
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * count
    busy = 0.0
    position = [0] * count
    remaining = sum(len(order) for order in schedule)
    while remaining:
        progressed = False
        for s, order in enumerate(schedule):
            while position[s] < len(order):
                action = order[position[s]]
                ready = _ready(action, done, times, count)
                if ready is None:
                    break
                duration = times[s].duration(action)
                clock[s] = max(clock[s], ready) + duration
                busy += duration
                done[(action.kind, action.microbatch, s)] = clock[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the action lists deadlock: some task waits on one that never runs.")
    step = max(clock)
    return Simulation(step, 1.0 - busy / (count * step) if step > 0 else 0.0)


def _ready(
    action: Action, done: dict[tuple[str, int, int], float], times: Sequence[StageTime], count: int
) -> float | None:
    """When the inputs of ``action`` are there; ``None`` while they are not yet computed."""
    s, i = action.stage, action.microbatch
    if action.kind == "forward":
        if s == 0:
            return 0.0
        end = done.get(("forward", i, s - 1))
        return None if end is None else end + times[s - 1].send
    if action.kind == "backward":
        if s == count - 1:
            return done.get(("forward", i, s))
        end = done.get(("backward", i, s + 1))
        return None if end is None else end + times[s].send
    return 0.0
