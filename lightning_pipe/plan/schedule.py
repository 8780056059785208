"""Schedules: the order in which (micro-batch, stage) tasks run."""

from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Literal, NamedTuple, get_args

__all__ = [
    "HELD_CHANGE", "MULTI_STAGE", "SCHEDULES", "V_SHAPED", "Action", "BackwardState",
    "DistributedSchedule", "Pending", "Schedule", "Step", "TaskKind", "actions", "backward_states", "check_schedule",
    "clock_cycles", "global_order", "gradient_waits", "in_flight", "placement", "process_stages",
    "stages_per_process", "weight_versions", "weights_pending", "with_virtual_stages",
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
#: Schedules that hold several stages per process (torch.distributed.pipelining's multi-stage
#: schedules), which only the distributed runtime runs; "1f1b" with more than one virtual stage
#: is "interleaved-1f1b".
MULTI_STAGE: tuple[Schedule, ...] = ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
#: The V-shape schedules: two stages per process, process ``r`` holding stages ``r`` and ``2p - 1 - r``.
V_SHAPED: tuple[Schedule, ...] = ("zbv", "dualpipev")

#: The most bytes one flat copy of gradients takes while a distributed step reduces them over
#: data-parallel replicas: DDP's default bucket (``bucket_cap_mb=25``). One flat copy of them
#: all would add a stage's whole gradient size to its peak.
GRADIENT_BUCKET_BYTES = 25 * 2**20


#: What one task of a stage runs (:class:`Action`).
TaskKind = Literal["forward", "backward", "input", "weight", "update"]


class Action(NamedTuple):
    """One task of one stage: a micro-batch's forward or backward, or the stage's weight update
    (``microbatch`` is -1 for an update, which covers all micro-batches of the step). Zero-bubble
    schedules split some backwards in two: ``input`` (the gradients of the stage's inputs, which
    the stage before waits for) and ``weight`` (its parameters' gradients, run later to fill the
    bubble; the micro-batch's stash lives until then)."""

    kind: TaskKind
    microbatch: int
    stage: int


def actions(
    schedule: Schedule, num_microbatches: int, num_stages: int, virtual_stages: int = 1
) -> list[list[Action]]:
    """Each process's ordered task list for one training step, ``num_stages`` stages over
    ``num_stages // virtual_stages`` processes as :func:`placement` places them; with one stage
    per process, each stage's list.

    GPipe runs all forwards, then all backwards in reverse micro-batch order. 1F1B
    (PipeDream-Flush) lets stage ``s`` of ``L`` run ``min(L - s - 1, m)`` warm-up forwards,
    then alternate one forward and one backward, then drain the remaining backwards; it bounds
    the micro-batches a stage holds by ``L - s`` instead of ``m``. PipeDream-2BW uses the same
    per-stage order; what differs is that it never flushes and keeps two weight versions
    (:func:`weight_versions`), which the order itself does not show. The multi-stage schedules
    (:data:`MULTI_STAGE`) follow torch.distributed.pipelining 2.13's own orders (its
    ``pipeline_order``, without the idle slots: the order of a process's tasks is what counts).
    Each list ends with an update of each stage the process holds.

    Raises:
        ValueError: an unknown schedule, or settings it cannot run (:func:`check_schedule`).
    """
    if num_microbatches < 1 or num_stages < 1:
        raise ValueError(f"need at least one micro-batch and one stage, got {num_microbatches} and {num_stages}.")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(map(repr, SCHEDULES))}.")
    check_schedule(schedule, num_microbatches, num_stages, virtual_stages)
    m = num_microbatches
    schedule = with_virtual_stages(schedule, virtual_stages)
    if schedule in MULTI_STAGE:
        p = num_stages // virtual_stages
        held = process_stages(schedule, p, virtual_stages)
        if schedule in V_SHAPED:
            make = _zbv if schedule == "zbv" else _dualpipev
            orders = [make(rank, p, m) for rank in range(p)]
        else:
            orders = [_interleaved(rank, p, virtual_stages, m, schedule == "interleaved-zb") for rank in range(p)]
        return [order + [Action("update", -1, s) for s in stages] for order, stages in zip(orders, held)]
    lists = []
    for s in range(num_stages):
        if schedule == "gpipe":
            order = [Action("forward", i, s) for i in range(m)]
            order += [Action("backward", i, s) for i in reversed(range(m))]
        else:
            warmup = min(num_stages - s - 1, m)
            order = [Action("forward", i, s) for i in range(warmup)]
            for i in range(m - warmup):
                order += [Action("forward", warmup + i, s), Action("backward", i, s)]
            order += [Action("backward", i, s) for i in range(m - warmup, m)]
        lists.append(order + [Action("update", -1, s)])
    return lists


def placement(schedule: Schedule, processes: int, virtual_stages: int) -> list[int]:
    """The pipeline process (rank in the pipeline) of each of the ``processes * virtual_stages``
    stages: a loop (stage ``s`` on process ``s % processes``, Interleaved 1F1B's and
    zero-bubble's), or under a V-shape schedule a V (process ``r`` holds stages ``r`` and
    ``2 * processes - 1 - r``: the first and the last stage on process 0, so that the last
    stage's loss and the first backward run where the first stage is), as
    ``torch.distributed.pipelining`` places them."""
    count = processes * virtual_stages
    if schedule in V_SHAPED:
        return [s if s < processes else count - 1 - s for s in range(count)]
    return [s % processes for s in range(count)]


def process_stages(schedule: Schedule, processes: int, virtual_stages: int) -> list[list[int]]:
    """Each pipeline process's stages, in order (:func:`placement`)."""
    where = placement(schedule, processes, virtual_stages)
    return [[s for s, p in enumerate(where) if p == process] for process in range(processes)]


def with_virtual_stages(schedule: Schedule, virtual_stages: int) -> Schedule:
    """The schedule that runs: ``"1f1b"`` with several stages per process is ``"interleaved-1f1b"``."""
    return "interleaved-1f1b" if schedule == "1f1b" and virtual_stages > 1 else schedule


def stages_per_process(schedule: Schedule, virtual_stages: int | None) -> int:
    """How many stages each process holds: ``virtual_stages`` where given (:func:`check_schedule`
    refuses a count the schedule cannot hold), else 2 for the multi-stage schedules (the V-shape
    ones always hold two) and 1 for the others."""
    if virtual_stages is not None:
        return virtual_stages
    return 2 if schedule in MULTI_STAGE else 1


def check_schedule(
    schedule: Schedule, chunks: int, stages: int, virtual_stages: int, *, distributed: bool = False
) -> None:
    """Whether ``schedule`` can run ``chunks`` micro-batches per batch through ``stages`` stages,
    ``virtual_stages`` on each process: the stages per process it holds, and what
    ``torch.distributed.pipelining`` 2.13 needs of the micro-batches (its schedules'
    constructors, checked here before any process starts). DualPipeV needs at least one per
    stage, and so does 1F1B with one stage per process where it runs on torch (``distributed``;
    the local runtime's 1F1B takes any); Interleaved 1F1B and interleaved zero-bubble, which run
    in ``max(1, chunks // processes)`` rounds, a multiple of the rounds (any count below
    ``2 * processes``); GPipe and ZBV any.

    Raises:
        ValueError: naming the requirement and the fix.
    """
    v, m = virtual_stages, chunks
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {v}: give the number of stages each process holds.")
    if stages % v:
        raise ValueError(
            f"virtual_stages={v} does not divide the {stages} stages: each process holds the same number of "
            f"stages; give a number of stages that is a multiple of {v}, or virtual_stages dividing {stages}."
        )
    if v > 1 and schedule in ("gpipe", "2bw"):
        raise ValueError(
            f"schedule={schedule!r} runs one stage per process, got virtual_stages={v}: use 'interleaved-1f1b' "
            f"(or 'interleaved-zb', 'zbv', 'dualpipev') for several stages per process, or virtual_stages=1."
        )
    if schedule in V_SHAPED and v != 2:
        raise ValueError(
            f"schedule={schedule!r} holds exactly 2 stages per process (a V), got virtual_stages={v}: give "
            f"virtual_stages=2 (or leave it out), or use 'interleaved-1f1b'/'interleaved-zb' for other counts."
        )
    processes = stages // v
    if (schedule == "1f1b" and v == 1 and distributed) or schedule == "dualpipev":
        if m < stages:
            raise ValueError(
                f"schedule={schedule!r} needs at least one micro-batch per stage: chunks={m} < {stages} stages "
                f"({processes} processes x {v}). Use chunks >= {stages}, or fewer processes"
                + (", or schedule='zbv'." if schedule == "dualpipev" else ".")
            )
    elif schedule in ("interleaved-1f1b", "interleaved-zb") or (schedule == "1f1b" and v > 1):
        rounds = max(1, m // processes)
        if m % rounds:
            raise ValueError(
                f"schedule={schedule!r} runs micro-batches in rounds of chunks // processes = {rounds}, which must "
                f"divide chunks={m} ({processes} processes): use chunks={rounds * processes}, any multiple of "
                f"{processes}, or fewer than {2 * processes}."
            )


def _interleaved(rank: int, p: int, v: int, m: int, zero_bubble: bool) -> list[Action]:
    """Process ``rank``'s order under torch's ``ScheduleInterleaved1F1B`` (``zero_bubble``:
    ``ScheduleInterleavedZeroBubble``, the ZB1P schedule, whose weight-gradient halves trail
    the input-gradient ones by ``rank`` tasks): warm-up forwards, then one forward and one
    backward each, then the remaining backwards, stage by stage in rounds of micro-batches."""
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), m * v)
    total = m * v

    def forward_stage(op: int) -> int:
        return (op // per_round) % v * p + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - (op - warmup) // per_round % v) * p + rank

    counts: dict[tuple[str, int], int] = {}

    def task(kind: Literal["forward", "backward", "input", "weight"], stage: int) -> Action:
        counts[kind, stage] = (i := counts.get((kind, stage), 0)) + 1
        return Action(kind, i, stage)

    order: list[Action] = []
    backwards: list[int] = []  # the ops of the backwards so far, whose weight halves follow in turn
    weights = 0
    for op in range(total + warmup):
        if op < total:
            order.append(task("forward", forward_stage(op)))
        if op >= warmup:
            order.append(task("input" if zero_bubble else "backward", backward_stage(op)))
            backwards.append(op)
            if zero_bubble and op - warmup >= rank:
                order.append(task("weight", backward_stage(backwards[weights])))
                weights += 1
    while zero_bubble and weights < len(backwards):
        order.append(task("weight", backward_stage(backwards[weights])))
        weights += 1
    return order


def _zbv(rank: int, p: int, m: int) -> list[Action]:
    """Process ``rank``'s order under torch's ``ScheduleZBVZeroBubble`` (ZB-V): it plans for at
    least ``2p - 1`` micro-batches and leaves out the tasks of those beyond ``m``."""
    first, second = rank, 2 * p - 1 - rank
    planned = max(2 * p - 1, m)
    count = dict.fromkeys(("f0", "f1", "b0", "b1"), 0)
    order: list[Action] = []

    def add(kind: Literal["forward", "input", "weight"], stage: int, key: str, advance: bool = True) -> None:
        order.append(Action(kind, count[key], stage))
        if advance:
            count[key] += 1

    for _ in range(2 * (p - rank) - 1):
        add("forward", first, "f0")
    for _ in range(rank):
        add("forward", second, "f1")
        add("forward", first, "f0")
    for _ in range(p - rank):
        add("forward", second, "f1")
        add("input", second, "b1", False)
        add("weight", second, "b1")
    while count["f1"] < count["f0"] or count["f0"] < planned:
        if count["f0"] < planned:
            add("forward", first, "f0")
        add("input", first, "b0", False)
        add("weight", first, "b0")
        add("forward", second, "f1")
        add("input", second, "b1", False)
        add("weight", second, "b1")
    count["w0"], count["w1"] = count["b0"], count["b1"]
    for _ in range(rank):
        add("input", first, "b0")
        add("input", second, "b1")
    for _ in range(p - rank):
        add("input", first, "b0")
        add("weight", first, "w0")
    while count["w1"] < count["b1"]:
        add("weight", second, "w1")
    while count["w0"] < count["b0"]:
        add("weight", first, "w0")
    return [a for a in order if a.microbatch < m]


def _dualpipev(rank: int, p: int, m: int) -> list[Action]:
    """Process ``rank``'s order under torch's ``ScheduleDualPipeV`` (DeepSeek's DualPipe folded
    into a V): a forward and a backward of the other stage overlap in its main phase (here one
    after the other, as one process runs them), and only the first and last backwards split
    into input and weight halves."""
    first, second = rank, 2 * p - 1 - rank
    count: dict[tuple[str, int], int] = {}
    pending: list[tuple[int, int]] = []  # (stage, micro-batch) whose weight half is still to run
    order: list[Action] = []

    def add(kind: Literal["forward", "backward", "input"], stage: int) -> None:
        key = ("forward" if kind == "forward" else "input", stage)
        order.append(Action(kind, count.get(key, 0), stage))
        if kind == "input":
            pending.append((stage, count.get(key, 0)))
        count[key] = count.get(key, 0) + 1

    def weight() -> None:
        if pending:
            stage, i = pending.pop(0)
            order.append(Action("weight", i, stage))

    for _ in range(2 * (p - rank - 1)):
        add("forward", first)
    for _ in range(rank + 1):
        add("forward", first)
        add("forward", second)
    for _ in range(p - rank - 1):
        add("input", second)
        weight()
        add("forward", second)
    for _ in range(m - 2 * p + rank + 1):
        add("forward", first)
        add("backward", second)
        add("forward", second)
        add("backward", first)
    for _ in range(p - rank - 1):
        add("backward", second)
        add("forward", second)
        add("backward", first)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add("input" if split else "backward", second)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add("input" if split else "backward", first)
    for _ in range(p - rank - 1):
        weight()
        add("input" if split else "backward", first)
    for _ in range(rank + 1):
        weight()
    return order


def in_flight(schedule: Schedule, num_microbatches: int, num_stages: int, virtual_stages: int = 1) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not (under a
    split backward: whose weight half has not), read off the action lists: how many
    micro-batches' activations the stage stashes at once."""
    held, most = [0] * num_stages, [0] * num_stages
    for order in actions(schedule, num_microbatches, num_stages, virtual_stages):
        for action in order:
            held[action.stage] += HELD_CHANGE[action.kind]
            most[action.stage] = max(most[action.stage], held[action.stage])
    return most


#: What a task does to the micro-batches its stage holds: a forward stashes one, a whole
#: backward or a weight half frees it; an input half keeps it for the weight half.
HELD_CHANGE = {"forward": 1, "backward": -1, "input": 0, "weight": -1, "update": 0}


class Pending(NamedTuple):
    """A stage's micro-batches whose input half ran and whose weight half has not (each keeps
    the gradients its weight half reads): ``forward``, the most while it runs a forward;
    ``backward``, at its backward tasks (whole, input or weight halves) the micro-batches it
    holds (the task's own included) and those pending (the task's own not: its live bytes
    are the stage's backward's), at its first task, then at those no other task exceeds in
    both: the most held and the most pending seldom meet (ZB-V over 8 processes: its stage 1
    holds 15 micro-batches at its first backward, 8 once one waits for its weight half)."""

    forward: int
    backward: tuple[tuple[int, int], ...]


def weights_pending(
    schedule: Schedule, num_microbatches: int, num_stages: int, virtual_stages: int = 1
) -> list[Pending | None]:
    """Per stage, its :class:`Pending` micro-batches, read off the action lists; ``None`` for
    a stage whose backwards are all whole."""
    held, pending, forward = [0] * num_stages, [0] * num_stages, [0] * num_stages
    states: list[list[tuple[int, int]]] = [[] for _ in range(num_stages)]
    split = [False] * num_stages
    for order in actions(schedule, num_microbatches, num_stages, virtual_stages):
        for action in order:
            s, change = action.stage, HELD_CHANGE[action.kind]
            held[s] += max(change, 0)
            pending[s] -= action.kind == "weight"
            if action.kind == "forward":
                forward[s] = max(forward[s], pending[s])
            elif action.kind != "update":
                states[s].append((held[s], pending[s]))
            held[s] += min(change, 0)
            pending[s] += action.kind == "input"
            split[s] = split[s] or action.kind == "input"
    found: list[Pending | None] = []
    for f, state, x in zip(forward, states, split):
        later = set(state[1:])
        front = sorted(a for a in later if not any(b != a and b[0] >= a[0] and b[1] >= a[1] for b in later))
        found.append(Pending(f, (state[0], *front)) if x else None)
    return found


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
