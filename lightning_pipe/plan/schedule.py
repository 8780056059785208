"""Schedules: the order in which (micro-batch, stage) tasks run."""

from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Literal, NamedTuple, get_args

__all__ = [
    "DISTRIBUTED_ONLY", "SCHEDULES", "V_SHAPED", "Action", "BackwardState", "DistributedSchedule", "Schedule", "Step",
    "actions", "backward_states", "check_microbatches", "clock_cycles", "global_order", "gradient_waits", "in_flight",
    "placement", "planned_order", "process_stages", "stages_per_process", "weight_versions",
]


def clock_cycles(num_microbatches: int, num_stages: int) -> Iterator[list[tuple[int, int]]]:
    """GPipe's forward clock: at tick ``k`` stage ``j`` runs micro-batch ``k - j``.

    Within a tick the tasks touch different stages, so they could run concurrently; run in
    the listed order they give every device a fixed task order.
    """
    for k in range(num_microbatches + num_stages - 1):
        first = max(0, k - num_microbatches + 1)
        yield [(k - j, j) for j in range(first, min(k + 1, num_stages))]


Schedule = Literal["gpipe", "1f1b", "2bw", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"]
#: Every schedule, by the name the options, the CLI and the planner take.
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
#: The schedules the distributed runtime runs (it keeps one weight version: no 2BW).
DistributedSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"]
#: The schedules only the distributed runtime runs: several stages per process, on
#: ``torch.distributed.pipelining``'s multi-stage schedules.
DISTRIBUTED_ONLY: tuple[Schedule, ...] = ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
#: The V-shape schedules: two stages per process, process ``r`` holding stages ``r`` and ``2p - 1 - r``.
V_SHAPED: tuple[Schedule, ...] = ("zbv", "dualpipev")


def stages_per_process(schedule: Schedule, virtual_stages: int | None) -> int:
    """How many stages each process holds: 2 under a V-shape schedule, else ``virtual_stages``
    (``None``: 2 for the interleaved schedules, 1 for the others)."""
    if schedule in V_SHAPED:
        return 2
    if virtual_stages is None:
        return 2 if schedule in DISTRIBUTED_ONLY else 1
    return virtual_stages


def placement(schedule: Schedule, processes: int, virtual_stages: int) -> list[int]:
    """The pipeline process (rank in the pipeline) of each of the ``processes * virtual_stages``
    stages: a loop (stage ``s`` on process ``s % processes``, Interleaved 1F1B's and
    zero-bubble's), or under a V-shape schedule a V (process ``r`` holds stages ``r`` and
    ``2 * processes - 1 - r``: the first and the last stage on process 0), as
    ``torch.distributed.pipelining`` places them."""
    count = processes * virtual_stages
    if schedule in V_SHAPED:
        return [s if s < processes else count - 1 - s for s in range(count)]
    return [s % processes for s in range(count)]


def process_stages(schedule: Schedule, processes: int, virtual_stages: int) -> list[list[int]]:
    """Each pipeline process's stages, in order (:func:`placement`)."""
    where = placement(schedule, processes, virtual_stages)
    return [[s for s, p in enumerate(where) if p == process] for process in range(processes)]


def check_microbatches(schedule: Schedule, chunks: int, processes: int, virtual_stages: int) -> None:
    """What ``torch.distributed.pipelining`` 2.13 needs of the micro-batches per batch: 1F1B at
    least one per stage; DualPipeV at least one per stage (``2 * processes``); Interleaved 1F1B
    and interleaved zero-bubble, which run in rounds of ``max(1, chunks // processes)``, a
    multiple of the rounds (any count below ``2 * processes``); GPipe and ZBV any.

    Raises:
        ValueError: ``chunks`` that the schedule cannot run, naming the requirement and the fix.
    """
    stages = processes * virtual_stages
    if (schedule == "1f1b" and virtual_stages == 1) or schedule == "dualpipev":
        if chunks < stages:
            raise ValueError(
                f"schedule={schedule!r} needs at least one micro-batch per stage: chunks={chunks} < {stages} stages "
                f"({processes} processes x {virtual_stages}). Use chunks >= {stages}, or fewer processes."
            )
    elif schedule in ("1f1b", "interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, chunks // processes)
        if chunks % rounds:
            raise ValueError(
                f"schedule={schedule!r} runs micro-batches in rounds of chunks // processes = {rounds}, which must "
                f"divide chunks={chunks} ({processes} processes): use chunks={rounds * processes}, any multiple of "
                f"{processes}, or fewer than {2 * processes}."
            )


def planned_order(schedule: Schedule) -> Schedule:
    """The schedule whose action order the planner (cost model, simulator, fake execution)
    follows for ``schedule``. A STAND-IN: the interleaved, zero-bubble and V-shape schedules are
    planned as 1F1B over all their stages (each stage charged its share of its process's
    memory) until :func:`actions` has their own orders; then this goes."""
    return "1f1b" if schedule in DISTRIBUTED_ONLY else schedule


#: The most bytes one flat copy of gradients takes while a distributed step reduces them over
#: data-parallel replicas: DDP's default bucket (``bucket_cap_mb=25``). One flat copy of them
#: all would add a stage's whole gradient size to its peak.
GRADIENT_BUCKET_BYTES = 25 * 2**20


class Action(NamedTuple):
    """One task of one stage: a micro-batch's forward or backward, or the stage's weight update
    (``microbatch`` is -1 for an update, which covers all micro-batches of the step)."""

    kind: Literal["forward", "backward", "update"]
    microbatch: int
    stage: int


def actions(schedule: Schedule, num_microbatches: int, num_stages: int) -> list[list[Action]]:
    """Each stage's ordered task list for one training step.

    GPipe runs all forwards, then all backwards in reverse micro-batch order. 1F1B
    (PipeDream-Flush) lets stage ``s`` of ``L`` run ``min(L - s - 1, m)`` warm-up forwards,
    then alternate one forward and one backward, then drain the remaining backwards; it bounds
    the micro-batches a stage holds by ``L - s`` instead of ``m``. PipeDream-2BW uses the same
    per-stage order; what differs is that it never flushes and keeps two weight versions
    (:func:`weight_versions`), which the order itself does not show.
    """
    if num_microbatches < 1 or num_stages < 1:
        raise ValueError(f"need at least one micro-batch and one stage, got {num_microbatches} and {num_stages}.")
    m = num_microbatches
    lists = []
    for s in range(num_stages):
        if schedule == "gpipe":
            order = [Action("forward", i, s) for i in range(m)]
            order += [Action("backward", i, s) for i in reversed(range(m))]
        elif schedule in ("1f1b", "2bw"):
            warmup = min(num_stages - s - 1, m)
            order = [Action("forward", i, s) for i in range(warmup)]
            for i in range(m - warmup):
                order += [Action("forward", warmup + i, s), Action("backward", i, s)]
            order += [Action("backward", i, s) for i in range(m - warmup, m)]
        else:
            raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(map(repr, SCHEDULES))}.")
        lists.append(order + [Action("update", -1, s)])
    return lists


def in_flight(schedule: Schedule, num_microbatches: int, num_stages: int) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not, read
    off the action lists: how many micro-batches' activations the stage stashes at once."""
    counts = []
    for order in actions(schedule, num_microbatches, num_stages):
        held = most = 0
        for action in order:
            held += {"forward": 1, "backward": -1, "update": 0}[action.kind]
            most = max(most, held)
        counts.append(most)
    return counts


class Step(NamedTuple):
    """One step of the single-process order: the forward of a micro-batch through every
    stage (``stage`` is ``None``), or one stage's backward of a micro-batch."""

    kind: str
    microbatch: int
    stage: int | None


def global_order(per_stage: Sequence[Sequence[Action]]) -> list[Step]:
    """Merge per-stage action lists (items with ``kind``, ``microbatch``, ``stage``) into one
    order that keeps every stage's own order, runs each micro-batch's forward through all
    stages at once, and a stage's backward only after the stage after it."""
    lists = [[a for a in actions if a.kind in ("forward", "backward")] for actions in per_stage]
    last = len(lists) - 1
    position = [0] * len(lists)
    done: set[tuple[int, int]] = set()
    forwarded: set[int] = set()
    order: list[Step] = []
    while any(p < len(a) for p, a in zip(position, lists)):
        nxt = [a[p] if p < len(a) else None for p, a in zip(position, lists)]
        ready = [
            (s, a) for s, a in enumerate(nxt)
            if a is not None and a.kind == "backward" and a.microbatch in forwarded
            and (s == last or (a.microbatch, s + 1) in done)
        ]
        first = nxt[0]
        if ready:
            s, a = ready[0]
            order.append(Step("backward", a.microbatch, s))
            done.add((a.microbatch, s))
            position[s] += 1
        elif first is not None and all(
            a is not None and a.kind == "forward" and a.microbatch == first.microbatch for a in nxt
        ):
            order.append(Step("forward", first.microbatch, None))
            forwarded.add(first.microbatch)
            position = [p + 1 for p in position]
        else:
            raise ValueError(
                f"The schedule cannot run in one process with whole-micro-batch forwards: "
                f"stuck with next actions {nxt}."
            )
    return order


@lru_cache(maxsize=64)
def gradient_waits(schedule: Schedule, num_microbatches: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """``[p][s]``: the most micro-batches whose gradient for stage ``p``'s outputs, computed by
    stage ``s``, wait for ``p``'s backward while other steps of the single-process order run
    (the gradient a backward has just made is part of that backward's workspace). Under
    GPipe, autograd hands every gradient straight on: none wait."""
    waits = [[0] * num_stages for _ in range(num_stages)]
    if schedule == "gpipe":
        return tuple(map(tuple, waits))
    done = [0] * num_stages
    grown: int | None = None  # the stage whose backward count grew in the previous step
    for step in global_order(actions(schedule, num_microbatches, num_stages)):
        if grown is not None:  # only its differences to earlier stages can reach a new maximum
            for p in range(grown):
                waits[p][grown] = max(waits[p][grown], done[grown] - done[p])
        grown = None
        if step.stage is not None:  # a backward: forwards run through all stages
            done[step.stage] += 1
            grown = step.stage
    return tuple(map(tuple, waits))


class BackwardState(NamedTuple):
    """A stage at one of its backwards in a step: the micro-batches it holds (their forward
    ran, their backward has not; this one's included) and, per earlier stage ``p``, how many
    gradients it made for ``p``'s outputs still wait for ``p``'s backward (not counting the
    one it makes)."""

    held: int
    waits: tuple[int, ...]


@lru_cache(maxsize=64)
def backward_states(
    schedule: Schedule, num_microbatches: int, num_stages: int
) -> tuple[tuple[BackwardState, ...], ...]:
    """Per stage, its state at each of its backwards in a step, in order. GPipe's one
    backward over the whole batch runs in reverse clock order (:func:`_gpipe_backward_order`),
    so a gradient for a stage ``d`` stages back waits there for up to ``d`` micro-batches
    while the stage holds fewer and fewer."""
    done, forwards = [0] * num_stages, 0
    states: list[list[BackwardState]] = [[] for _ in range(num_stages)]
    if schedule == "gpipe":
        order, forwards = _gpipe_backward_order(num_microbatches, num_stages), num_microbatches
    else:
        order = global_order(actions(schedule, num_microbatches, num_stages))
    for step in order:
        if step.stage is None:
            forwards += 1
            continue
        s = step.stage
        waits = tuple(done[s] - done[p] if p < s else 0 for p in range(num_stages))
        states[s].append(BackwardState(forwards - done[s], waits))
        done[s] += 1
    return tuple(map(tuple, states))


def _gpipe_backward_order(num_microbatches: int, num_stages: int) -> list[Step]:
    """The order of GPipe's backward steps: autograd runs the most recently made work first,
    i.e. the forward's clock cycles backwards, each cycle's stages last to first (as the
    meter sees it: a U-Net's skip gradient made by stage 2 waits there while stage 2 runs
    two more micro-batches' backward)."""
    return [Step("backward", tick - s, s) for tick in reversed(range(num_microbatches + num_stages - 1))
            for s in reversed(range(num_stages)) if 0 <= tick - s < num_microbatches]


def weight_versions(schedule: Schedule) -> int:
    """Weight copies a stage keeps: PipeDream-2BW double-buffers its weights (the version the
    in-flight micro-batches started with, and the one being updated); flushing schedules keep one."""
    return 2 if schedule == "2bw" else 1
