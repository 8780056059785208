"""Event simulation of one training step: when each stage runs each task, given its times.

The closed forms ((m + L - 1) * (f + b) and the like) hold only for equal stages; the planner
compares plans whose stages differ in compute, recompute, exposed swap and transfer time, so it
replays the schedule's per-stage action lists (:func:`lightning_pipe.plan.schedule.actions`)
instead: a task starts when its stage is free and its input has arrived.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.plan.schedule import Action

__all__ = ["Replay", "Simulation", "StageTime", "simulate"]


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


@dataclass
class Simulation:
    """Step time (ms) and the fraction of stage time spent idle (the bubble)."""

    step_ms: float
    bubble: float


def simulate(times: Sequence[StageTime], schedule: Sequence[Sequence[Action]]) -> Simulation:
    """Replay each stage's action list in order: a forward waits for the previous stage's
    forward of that micro-batch plus the transfer, a backward for the next stage's backward
    plus the transfer (the last stage's for its own forward, which its order puts first)."""
    return Replay(schedule).run(times)


class Replay:
    """A schedule's action lists put in one order in which every task comes after its input:
    that order does not depend on the times, so a planner comparing many splits under one
    schedule orders it once and replays each split in one pass."""

    def __init__(self, schedule: Sequence[Sequence[Action]]) -> None:
        count = len(schedule)
        index: dict[tuple[str, int, int], int] = {}
        # per task: stage, kind (_KINDS), index of the task it waits for (-1: none), stage whose
        # send it waits for (-1: none); flat, since a search replays thousands of splits
        self.tasks: list[tuple[int, int, int, int]] = []
        position = [0] * count
        remaining = sum(len(order) for order in schedule)
        while remaining:
            progressed = False
            for s, order in enumerate(schedule):
                while position[s] < len(order):
                    action = order[position[s]]
                    waits = _input(action, count)
                    if waits is not None and waits[0] not in index:
                        break
                    dependency, sender = (index[waits[0]], waits[1]) if waits is not None else (-1, -1)
                    index[(action.kind, action.microbatch, s)] = len(self.tasks)
                    self.tasks.append((s, _KINDS.get(action.kind, len(_KINDS)), dependency, sender))
                    position[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                raise ValueError("the action lists deadlock: some task waits on one that never runs.")
        self.count = count

    def run(self, times: Sequence[StageTime]) -> Simulation:
        """Step time and bubble of the schedule with these per-stage times."""
        if len(times) != self.count:
            raise ValueError(f"{len(times)} stage times but {self.count} action lists.")
        durations = [[t.forward for t in times], [t.recompute + t.swap + t.backward for t in times], [0.0] * self.count]
        sends = [t.send for t in times] + [0.0]  # [-1]: no transfer
        clock = [0.0] * self.count
        end = [0.0] * (len(self.tasks) + 1)  # [-1]: waits for nothing
        busy = 0.0
        for k, (s, kind, dependency, sender) in enumerate(self.tasks):
            duration = durations[kind][s]
            ready = end[dependency] + sends[sender]
            clock[s] = (clock[s] if clock[s] > ready else ready) + duration
            busy += duration
            end[k] = clock[s]
        step = max(clock)
        return Simulation(step, 1.0 - busy / (self.count * step) if step > 0 else 0.0)


# The kinds of task that take a stage's time, by index into Replay.run's durations (others take none).
_KINDS = {"forward": 0, "backward": 1}


def _input(action: Action, count: int) -> tuple[tuple[str, int, int], int] | None:
    """The task whose end ``action`` waits for and the stage whose transfer lies between
    (-1: none); ``None``: it waits for nothing."""
    s, i = action.stage, action.microbatch
    if action.kind == "forward":
        return (("forward", i, s - 1), s - 1) if s > 0 else None
    if action.kind == "backward":
        return (("forward", i, s), -1) if s == count - 1 else (("backward", i, s + 1), s)
    return None
