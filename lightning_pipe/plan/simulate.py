"""Event simulation of one training step: when each stage runs each task, given its times.

The closed forms ((m + L - 1) * (f + b) and the like) hold only for equal stages; the planner
compares plans whose stages differ in compute, recompute, exposed swap and transfer time, so it
replays the schedule's per-process action lists (:func:`lightning_pipe.plan.schedule.actions`)
instead: a task starts when its process is free and its input has arrived.
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


#: The share of a backward's time its input-gradient half takes when a zero-bubble schedule
#: splits it (the rest: the weight-gradient half). Both halves run a matrix product per weight
#: of the backward's two (Zero Bubble's T_B = T_W); recompute and swap-in go with the first.
INPUT_SHARE = 0.5


def simulate(times: Sequence[StageTime], schedule: Sequence[Sequence[Action]]) -> Simulation:
    """Replay each process's action list in order (:func:`~lightning_pipe.plan.schedule.actions`;
    one stage per process: each stage's): a forward waits for the previous stage's forward of
    that micro-batch plus the transfer, a backward (or its input half) for the next stage's
    plus the transfer (the last stage's for its own forward), a weight half for its input
    half; a process runs its tasks one at a time, whichever of its stages they belong to."""
    return Replay(schedule).run(times)


class Replay:
    """A schedule's action lists put in one order in which every task comes after its input:
    that order does not depend on the times, so a planner comparing many splits under one
    schedule orders it once and replays each split in one pass."""

    def __init__(self, schedule: Sequence[Sequence[Action]]) -> None:
        self.devices = len(schedule)
        device = {a.stage: d for d, order in enumerate(schedule) for a in order}
        count = len(device)
        index: dict[tuple[str, int, int], int] = {}
        # per task: process, stage, kind (_KINDS), index of the task it waits for (-1: none),
        # stage whose send it waits for (-1: none); flat, since a search replays thousands of splits
        self.tasks: list[tuple[int, int, int, int, int]] = []
        position = [0] * self.devices
        remaining = sum(len(order) for order in schedule)
        while remaining:
            progressed = False
            for d, order in enumerate(schedule):
                while position[d] < len(order):
                    action = order[position[d]]
                    waits = _input(action, count)
                    if waits is not None and waits[0] not in index:
                        break
                    dependency, sender = (index[waits[0]], waits[1]) if waits is not None else (-1, -1)
                    if sender >= 0 and device[sender] == device[sender + 1]:
                        sender = -1  # two stages of one process: nothing moves between devices
                    index[_key(action)] = len(self.tasks)
                    self.tasks.append((d, action.stage, _KINDS.get(action.kind, len(_KINDS)), dependency, sender))
                    position[d] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                raise ValueError("the action lists deadlock: some task waits on one that never runs.")
        self.count = count

    def run(self, times: Sequence[StageTime]) -> Simulation:
        """Step time and bubble of the schedule with these per-stage times."""
        if len(times) != self.count:
            raise ValueError(f"{len(times)} stage times but {self.count} stages in the action lists.")
        backward = [t.recompute + t.swap + t.backward for t in times]
        durations = [
            [t.forward for t in times], backward,
            [t.recompute + t.swap + INPUT_SHARE * t.backward for t in times],
            [(1 - INPUT_SHARE) * t.backward for t in times], [0.0] * self.count,
        ]
        sends = [t.send for t in times] + [0.0]  # [-1]: no transfer
        clock = [0.0] * self.devices
        end = [0.0] * (len(self.tasks) + 1)  # [-1]: waits for nothing
        busy = 0.0
        for k, (d, s, kind, dependency, sender) in enumerate(self.tasks):
            duration = durations[kind][s]
            ready = end[dependency] + sends[sender]
            clock[d] = (clock[d] if clock[d] > ready else ready) + duration
            busy += duration
            end[k] = clock[d]
        step = max(clock)
        return Simulation(step, 1.0 - busy / (self.devices * step) if step > 0 else 0.0)


# The kinds of task that take a stage's time, by index into Replay.run's durations (others take none).
_KINDS = {"forward": 0, "backward": 1, "input": 2, "weight": 3}


def _key(action: Action) -> tuple[str, int, int]:
    """What later tasks wait for: a forward, or the gradient of a stage's inputs (made by its
    whole backward or its input half)."""
    kind = "gradient" if action.kind in ("backward", "input") else action.kind
    return kind, action.microbatch, action.stage


def _input(action: Action, count: int) -> tuple[tuple[str, int, int], int] | None:
    """The task whose end ``action`` waits for and the stage whose transfer lies between
    (-1: none); ``None``: it waits for nothing."""
    s, i = action.stage, action.microbatch
    if action.kind == "forward":
        return (("forward", i, s - 1), s - 1) if s > 0 else None
    if action.kind in ("backward", "input"):
        return (("forward", i, s), -1) if s == count - 1 else (("gradient", i, s + 1), s)
    if action.kind == "weight":
        return ("gradient", i, s), -1
    return None
