"""Plans: a partitioner's balance plus per-node memory policies, with what they predict.

A :class:`Plan` is what the planner hands over and what a user reads before training: the
balance, which nodes are recomputed or swapped, each stage's predicted peak (by kind) and time,
and the simulated step time and bubble of the schedule. It round-trips through JSON so a plan
can be made offline from a saved profile and checked in.
"""

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lightning_pipe.plan.memory import CostModel, StagePeak, stage_ranges
from lightning_pipe.plan.optimize import StageOptimum
from lightning_pipe.plan.partitioners import fitting_split, floor, split
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.schedule import (
    MULTI_STAGE,
    Schedule,
    actions,
    backward_states,
    gradient_waits,
    in_flight,
    placement,
    weight_versions,
    weights_pending,
)
from lightning_pipe.plan.sharding import Sharding, choose_resharding
from lightning_pipe.plan.sharing import device_peaks
from lightning_pipe.plan.simulate import StageTime, simulate
from lightning_pipe.plan.stages import Stages
from lightning_pipe.units import format_bytes

__all__ = [
    "PLANNING_HEADROOM", "PLAN_FORMAT", "PREDICTION_ERROR", "UPWARD", "Considered", "InfeasiblePlanError", "Plan",
    "StageReport", "fitting_plan", "largest_plan", "make_plan", "max_microbatch", "plan_fits", "planning_stages",
]

#: How far the memory model may under-predict a stage, over models it was not checked on.
#: Measured: over every stage of ``tests/lightning/test_planned_fits.py``'s 50 random cases
#: (four families, 2-4 stages, three schedules) 4.0%, over ``python -m benchmarks.accuracy``'s
#: 36 configurations 1.6%, over ``tests/lightning/test_prediction.py``'s runs none; both tests
#: fail past this.
PREDICTION_ERROR = 0.10

#: A plan predicted within this share of every stage's memory limit fits without a check
#: (:mod:`lightning_pipe.plan.headroom`): room for :data:`PREDICTION_ERROR`. Where a plan cannot
#: be checked, its planning targets are the limits times this.
PLANNING_HEADROOM = 1 / (1 + PREDICTION_ERROR)

# max_microbatch stops doubling here: a profile whose bytes do not grow with the micro-batch.
_MAX_MICROBATCH = 1 << 20
#: Where the largest micro-batch lies within this many sizes above one that fits, the search
#: probes the next size up rather than the middle: next to the limit a size that does not fit
#: costs some four times one that fits (it is proved by every fallback search, the lowest-peak
#: split's among them; GPT-2 large on 8 A100s: 12-16 s against 1-4 s), and for such a cost
#: ratio the cheapest probe of up to five sizes is the lowest. GPT-2 large's dry run at 60
#: probes 61 alone there, not 62 then 61.
UPWARD = 4


class InfeasiblePlanError(ValueError):
    """No plan fits the planning targets. ``min_peak`` is the smallest peak (bytes) any balance
    reaches with memory optimisation, on its fullest stage ``stage``."""

    def __init__(self, message: str, min_peak: int, stage: int) -> None:
        super().__init__(message)
        self.min_peak = min_peak
        self.stage = stage

    def __reduce__(self) -> tuple[type["InfeasiblePlanError"], tuple[str, int, int]]:
        return type(self), (str(self), self.min_peak, self.stage)  # pickled whole (a dry run plans in processes)


@dataclass
class StageReport:
    """One stage of a plan: nodes ``[start, stop)``, its predicted peak and per micro-batch
    times (ms; ``send_ms`` moves its outputs to the next stage), and the bytes per micro-batch
    it recomputes or swaps. Sharded by FSDP (:mod:`~lightning_pipe.plan.sharding`): its block
    units' node ranges ``[start, stop)`` (none: the stage is one unit) and whether it reshards
    after forward (``None``: not sharded)."""

    start: int
    stop: int
    param_bytes: int
    peak: StagePeak
    forward_ms: float
    backward_ms: float
    recompute_ms: float
    swap_ms: float
    recomputed_bytes: int
    swapped_bytes: int
    send_ms: float = 0.0
    fsdp_units: list[list[int]] = field(default_factory=list)
    reshard_after_forward: bool | None = None

    @property
    def time_ms(self) -> float:
        return self.forward_ms + self.backward_ms + self.recompute_ms + self.swap_ms + self.send_ms


@dataclass
class Considered:
    """A schedule ``schedule="auto"`` planned and weighed: its simulated step (ms) and each
    process's predicted peak, or why it has no plan (``step_ms`` ``None``)."""

    schedule: str
    virtual_stages: int
    step_ms: float | None
    device_peaks: list[int] = field(default_factory=list)
    why: str = ""


#: The meaning of a plan.json's fields; raised whenever a version of lightning_pipe reads one
#: differently, so that a plan made by another is refused rather than followed wrongly.
PLAN_FORMAT = 1


@dataclass
class Plan:
    """A balance with per-node policies (``keep``/``recompute``/``swap``) and predictions.
    ``targets`` are the bytes each stage was planned to fit: the planning target, not the
    device's limit (:data:`PLANNING_HEADROOM`), one per process. ``input_shapes``: the training
    batch's tensor shapes (by path) the strategy planned for. ``nodes``: the graph's node names,
    in order, so that a saved plan is only followed on the graph it was made for.
    ``virtual_stages``: stages per process, placed by ``placement`` (each stage's process;
    empty: stage ``s`` on process ``s``); ``device_peaks``: each process's predicted peak, its
    stages' together over its action order (:func:`~lightning_pipe.plan.sharing.device_peaks`).
    ``considered``: under ``schedule="auto"``, every schedule it weighed, the pick first."""

    partitioner: str
    schedule: str
    targets: list[int]
    microbatch_size: int
    chunks: int
    host_bandwidth: float | None
    balance: list[int]
    policies: list[str]
    stages: list[StageReport]
    step_ms: float
    bubble: float
    link_bandwidth: float | None = None
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    precision: str = "32-true"  # the Trainer precision whose bytes it planned
    data_parallel: str = "ddp"  # how each stage's replicas hold it: whole copies, or sharded by FSDP
    replicas: int = 1
    virtual_stages: int = 1
    placement: list[int] = field(default_factory=list)
    device_peaks: list[int] = field(default_factory=list)
    considered: list[Considered] = field(default_factory=list)

    def process(self, stage: int) -> int:
        """The process (device) running ``stage``."""
        return self.placement[stage] if self.placement else stage

    def process_peaks(self) -> list[int]:
        """Each process's predicted peak (bytes): :attr:`device_peaks`, or where the plan has none
        (made by hand, or saved without them) its stages' peaks added, which is at least it."""
        if self.device_peaks:
            return list(self.device_peaks)
        peaks = [0] * (1 + max(map(self.process, range(len(self.stages))), default=-1))
        for s, stage in enumerate(self.stages):
            peaks[self.process(s)] += stage.peak.total
        return peaks

    @property
    def time_ms(self) -> float:
        """The slowest stage's time per micro-batch."""
        return max(s.time_ms for s in self.stages)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "format": PLAN_FORMAT}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        data.pop("format", None)
        data["stages"] = [StageReport(**{**s, "peak": StagePeak(**s["peak"])}) for s in data["stages"]]
        data["considered"] = [Considered(**c) for c in data.get("considered", [])]
        return cls(**data)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> "Plan":
        """A ``plan.json`` as the strategy and ``lightning-pipe plan --out`` write it.

        Raises:
            ValueError: the file is missing, is not such a plan, or another version of
                lightning_pipe wrote it.
        """
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"plan={str(path)!r} cannot be read ({error.strerror}); give the path of a plan.json "
                             f"that lightning-pipe plan --out or a training run's logger folder holds.") from None
        try:
            written = json.loads(text).get("format")
            plan = cls.from_json(text)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"plan={str(path)!r} is not a plan.json written by lightning_pipe ({error}); make "
                             f"one with lightning-pipe plan --out, or take it from a training run's logger "
                             f"folder.") from None
        if written != PLAN_FORMAT:
            raise ValueError(f"plan={str(path)!r} was written by another version of lightning_pipe (plan format "
                             f"{written}; this one reads {PLAN_FORMAT}): plan again with lightning-pipe plan --out.")
        return plan

    def table(self) -> str:
        """One line per stage, within 100 columns: nodes, parameter bytes, one micro-batch's
        activations and the predicted peak against the planning target, time per micro-batch,
        bytes recomputed and swapped (every term of the peak: :meth:`to_json`)."""
        head = ["stage", "nodes", "params", "activ", "peak", "target", "ms", "recomp", "swap"]
        rows = [head]
        for s, r in enumerate(self.stages):
            sizes = (r.param_bytes, r.peak.activations, r.peak.total, self.targets[self.process(s)])
            rows.append(
                [str(s), f"{r.start}-{r.stop - 1}"]
                + [format_bytes(v) for v in sizes]
                + [f"{r.time_ms:.2f}", format_bytes(r.recomputed_bytes), format_bytes(r.swapped_bytes)]
            )
        widths = [max(len(row[k]) for row in rows) for k in range(len(head))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
        if self.virtual_stages > 1:
            for d, peak in enumerate(self.device_peaks):
                held = ", ".join(str(s) for s in range(len(self.stages)) if self.process(s) == d)
                lines.append(f"process {d} (stages {held}): peak {format_bytes(peak)} of "
                             f"{format_bytes(self.targets[d])}")
        lines.append(
            f"{self.partitioner}, {self.schedule}"
            + (f" x{self.virtual_stages} stages per process" if self.virtual_stages > 1 else "")
            + f", {self.chunks} micro-batches of {self.microbatch_size}: "
            f"step {self.step_ms:.2f} ms, bubble {self.bubble:.1%}"
        )
        if self.considered:
            lines.append("schedule=\"auto\" weighed (fastest simulated step that fits, first):")
            for c in self.considered:
                what = (f"step {c.step_ms:.2f} ms, peaks {', '.join(map(format_bytes, c.device_peaks))}"
                        if c.step_ms is not None else c.why)
                lines.append(f"  {c.schedule} x{c.virtual_stages}: {what}")
        return "\n".join(lines)


def make_plan(profile: Profile, request: PlanRequest) -> Plan:
    """Plan ``profile`` over one stage per planning target in ``request.capacities`` (bytes):
    split with its partitioner, then fit every stage with recompute and, given a host
    bandwidth, swap (``optimise_memory`` false: neither); see :class:`PlanRequest`.

    Raises:
        InfeasiblePlanError: a stage does not fit even with memory optimisation.
    """
    if request.schedule == "auto":
        from lightning_pipe.plan.auto import auto_plan  # which plans each schedule it weighs here

        found: Plan = auto_plan(profile, request)
        return found
    if request.virtual > 1:  # several stages per process
        if isinstance(shared := _shared_plan(profile, request), Plan):
            return shared
        raise _infeasible(shared[0], request.partitioner, shared[1], shared[2])
    stages, balance, optima = _attempt(profile, request)
    if not all(o.fits for o in optima):
        raise _infeasible(stages, request.partitioner, balance, optima)
    return _plan(stages, request, balance, optima)


#: How far the stages of one process may together be planned over its target: they peak at
#: different tasks, so the sum of their peaks overstates the process's; a plan made so is kept
#: only where each process's peak (:func:`~lightning_pipe.plan.sharing.device_peaks`) fits.
OVERCOMMIT = (1.0, 1.5, 2.0, 3.0)
#: Rounds of sharing a process's target among its stages, each by what they needed in the
#: round before (BERT-large on 8 A100s, ZB-V: the second round's plans go over some process,
#: the third's fit it at micro-batch 40).
SHARE_ROUNDS = 3


def _shared_plan(
    profile: Profile, request: PlanRequest, first: bool = False
) -> Plan | tuple[Stages, list[int], list[StageOptimum]]:
    """:func:`make_plan` for several stages per process (else the first attempt that did not
    fit, for :func:`_infeasible`): the fastest of the plans whose
    processes fit, their stages sharing each process's target :data:`OVERCOMMIT` times over,
    first by the micro-batches each holds, then :data:`SHARE_ROUNDS` - 1 times by what each
    needed in the round before's first plan (a last stage holding one micro-batch may need
    much for its loss). ``first``: the first plan that fits instead, for a caller asking only
    whether one does (a size search: of 12 attempts it prices those up to the first fit)."""
    r, schedule = request, _schedule(request)
    where = placement(schedule, len(r.capacities), r.virtual)
    weights = [h + 1 for h in in_flight(schedule, r.chunks, r.stage_count, r.virtual)]
    best: Plan | None = None
    failed: tuple[Stages, list[int], list[StageOptimum]] | None = None
    for _ in range(SHARE_ROUNDS):
        needs: list[int] = []
        for factor in OVERCOMMIT:
            stages = planning_stages(profile, r, _shares(r.capacities, where, weights, factor))
            stages, balance, optima = _chosen(stages, r)
            needs = needs or [o.peak.total for o in optima]
            if not all(o.fits for o in optima):
                failed = failed or (stages, balance, optima)
                continue
            plan = _plan(stages, r, balance, optima)
            fits = all(p <= c for p, c in zip(plan.device_peaks, r.capacities))
            if fits and first:
                return plan
            if fits and (best is None or plan.step_ms < best.step_ms):
                best = plan
        weights = needs
    if best is None:
        assert failed is not None  # the stages of the first plan fit a process together
        return failed
    return best


def fitting_plan(profile: Profile, request: PlanRequest) -> Plan | None:
    """:func:`make_plan`'s plan, or ``None`` where it does not fit, without the search for the
    lowest peak that :class:`InfeasiblePlanError` reports (on a large model it costs more than
    the plan): for a caller trying sizes that needs no reason (:func:`plan_fits` where it
    needs no plan either)."""
    if request.virtual > 1:  # several stages per process
        return shared if isinstance(shared := _shared_plan(profile, request), Plan) else None
    stages, balance, optima = _attempt(profile, request)
    return _plan(stages, request, balance, optima) if all(o.fits for o in optima) else None


def plan_fits(profile: Profile, request: PlanRequest) -> bool:
    """Whether :func:`fitting_plan` finds a plan, found without choosing among the splits that
    fit (:func:`~lightning_pipe.plan.partitioners.fitting_split`): what a search over sizes asks."""
    return _probed(profile, request) is not None


def _probed(profile: Profile, request: PlanRequest) -> Stages | None:
    """:func:`plan_fits`' stages where a split fits, with what it found (``None``: none fits).
    Several stages per process: where :func:`fitting_plan` finds a plan (their shares are
    its choice)."""
    stages = planning_stages(profile, request)
    if request.virtual > 1:  # several stages per process
        return stages if isinstance(_shared_plan(profile, request, first=True), Plan) else None
    return stages if fitting_split(request.partitioner, stages) is not None else None


def _plan(stages: Stages, request: PlanRequest, balance: list[int], optima: list[StageOptimum]) -> Plan:
    """The plan of a split whose stages fit, with what it predicts."""
    model = stages.model
    policies = ["keep"] * model.n
    reports, times = [], []
    for r, o in zip(stage_ranges(balance), optima):
        for i, p in o.policies.items():
            policies[i] = p
        forward = model.forward_time(r.start, r.stop)
        backward = model.compute_ms(r.start, r.stop) - forward
        send = model.send_ms(r.start, r.stop)
        reports.append(
            StageReport(
                start=r.start,
                stop=r.stop,
                param_bytes=model.params(r.start, r.stop),
                peak=o.peak,
                forward_ms=forward,
                backward_ms=backward,
                recompute_ms=o.recompute_ms,
                swap_ms=o.swap_ms,
                recomputed_bytes=sum(model.saved[i] for i, p in o.policies.items() if p == "recompute"),
                swapped_bytes=sum(model.saved[i] for i, p in o.policies.items() if p == "swap"),
                send_ms=send,
                fsdp_units=[] if model.sharding is None else model.sharding.units(r.start, r.stop),
                reshard_after_forward=None if model.sharding is None else bool(model.sharding.resharded[r.start]),
            )
        )
        times.append(StageTime(forward, backward, o.recompute_ms, o.swap_ms, send))
    schedule, virtual = _schedule(request), request.virtual
    order = actions(schedule, model.chunks, stages.count, virtual)
    sim = simulate(times, order)
    chosen = {i: p for o in optima for i, p in o.policies.items()}
    return Plan(
        partitioner=request.partitioner,
        schedule=schedule,
        targets=list(request.capacities),
        microbatch_size=model.profile.microbatch_size,
        chunks=model.chunks,
        host_bandwidth=stages.host_bandwidth,
        balance=balance,
        policies=policies,
        stages=reports,
        step_ms=sim.step_ms,
        bubble=sim.bubble,
        link_bandwidth=model.link_bandwidth,
        nodes=[n.name for n in model.profile.nodes],
        virtual_stages=virtual,
        placement=placement(schedule, len(request.capacities), virtual) if schedule in MULTI_STAGE else [],
        device_peaks=device_peaks(model, balance, chosen, [o.peak for o in optima], stages.in_flight, order,
                                  stages.pending),
        data_parallel=request.data_parallel,
        replicas=request.replicas,
    )


def max_microbatch(profile: Profile, request: PlanRequest, *, at_least: int = 1) -> int:
    """The largest micro-batch size whose plan for ``request`` fits, predicting other sizes with
    :meth:`Profile.scaled` (doubling from ``at_least``, then binary search, up from below once
    :data:`UPWARD` sizes are left). ``at_least``
    above one: a size known to fit (another partitioner's answer, where this is dawnpiper,
    which fits whatever another fits), so that the search starts near the answer.

    Raises:
        InfeasiblePlanError: not even a micro-batch of one fits.
    """
    return _largest(profile, request, at_least)[0]


def largest_plan(profile: Profile, request: PlanRequest, *, at_least: int = 1, near: int | None = None) -> Plan:
    """:func:`fitting_plan`'s plan at :func:`max_microbatch`'s size (``plan.microbatch_size``),
    made on what the search's probe of that size found: choosing among the splits that fit
    starts from the ones it priced. ``near``: a size the answer is likely at or next to (the
    answer for slightly larger capacities, as a check's next round asks), probed first: where
    it fits, the sizes above it one, two, four, ... further; where not, doubling from
    ``at_least`` below it. A size that does not fit costs a search many times a fitting
    one's; where ``near`` is the answer this probes one (the doubling and its bisection probe
    up to one per halving: on GPT-2 large two, 64 and 61). Like the doubling's, the answer fits and the
    size above it does not.

    Raises:
        InfeasiblePlanError: not even a micro-batch of one fits.
    """
    size, stages = _largest(profile, request, at_least, near)
    if request.virtual > 1:  # several stages per process
        return make_plan(profile.scaled(size), request)
    if stages is None:  # at_least, never probed
        stages = planning_stages(profile.scaled(size), request)
    stages, balance, optima = _chosen(stages, request)
    if not all(o.fits for o in optima):  # at_least did not fit after all
        raise _infeasible(stages, request.partitioner, balance, optima)
    return _plan(stages, request, balance, optima)


def _largest(profile: Profile, request: PlanRequest, at_least: int,
             near: int | None = None) -> tuple[int, Stages | None]:
    """:func:`max_microbatch`'s size, with the stages its probe of that size priced (``None``:
    ``at_least``, taken as known to fit, was the answer); ``near``: :func:`largest_plan`'s."""
    found: Stages | None = None  # the last probe that fit: each probe is above every size found to fit

    def fits(size: int) -> bool:
        nonlocal found
        stages = _probed(profile.scaled(size), request)
        if stages is not None:
            found = stages
        return stages is not None

    if at_least < 1:
        raise ValueError(f"at_least={at_least} is not a micro-batch size; give 1 or a size known to fit.")
    near = near if near is not None and near > at_least else None
    if near is not None and fits(near):
        low, step = near, 1
        while low + step <= _MAX_MICROBATCH and fits(low + step):
            low, step = low + step, 2 * step
        high = low + step
    else:  # doubling, below near where that does not fit
        if at_least == 1 and not fits(1):
            make_plan(profile.scaled(1), request)  # raises
        low, high = at_least, 2 * at_least
        while high <= _MAX_MICROBATCH and (near is None or high < near) and fits(high):
            low, high = high, high * 2
        high = high if near is None else min(high, near)
    while high - low > 1:
        mid = low + 1 if high - low <= UPWARD else (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low, found


def planning_stages(
    profile: Profile, request: PlanRequest, shares: Sequence[int] | None = None, sharding: Sharding | None = None,
) -> Stages:
    """What :func:`make_plan` hands its partitioner (:func:`~lightning_pipe.plan.partitioners.split`).

    Several stages on a process share its planning target: ``shares`` gives each stage its
    part (bytes), else each gets the part its held micro-batches ask (:func:`_shares`), so that
    their peaks together, and so the process's (:func:`~lightning_pipe.plan.sharing.device_peaks`,
    at most their sum), fit it. Sharded by FSDP (``data_parallel="fsdp"``): by ``sharding``
    (default: every stage kept gathered after forward)."""
    r, schedule = request, _schedule(request)
    if sharding is None and r.data_parallel == "fsdp":
        sharding = Sharding(profile, r.replicas, r.chunks, r.link_bandwidth,
                            accumulates_in_forward=schedule != "gpipe")
    count = r.stage_count
    model = CostModel(profile if sharding is None else sharding.profile, r.link_bandwidth, schedule=schedule,
                      chunks=r.chunks, carry=r.chunks if r.carry else 0, replicas=r.replicas, sharding=sharding)
    held = in_flight(schedule, r.chunks, count, r.virtual)
    order = actions(schedule, r.chunks, count, r.virtual)
    pending = weights_pending(schedule, r.chunks, count, r.virtual)
    if schedule in MULTI_STAGE:  # as processes only: the distributed runtime hands gradients on at once
        if shares is None:
            where = placement(schedule, len(r.capacities), r.virtual)
            shares = _shares(r.capacities, where, [h + 1 for h in held], 1.0)
        return Stages(model, list(shares), held, 1, r.host_bandwidth, (), order, optimise_memory=r.optimise_memory,
                      pending=pending)
    return Stages(
        model, list(r.capacities), held,
        weight_versions(schedule), r.host_bandwidth, gradient_waits(schedule, r.chunks, count),
        order, optimise_memory=r.optimise_memory,
        # the distributed runtime sends a stage's input gradients back at once: none wait
        backward_states=() if r.carry else backward_states(schedule, r.chunks, count), pending=pending,
    )


def _schedule(request: PlanRequest) -> Schedule:
    """The request's schedule, which a caller planning ``"auto"`` (:mod:`~lightning_pipe.plan.auto`) replaced."""
    if request.schedule == "auto":
        raise ValueError("schedule='auto' is planned by make_plan (lightning_pipe.plan.auto.auto_plan), which "
                         "plans each schedule it weighs; give a schedule to the other entry points.")
    return request.schedule


def _shares(capacities: Sequence[int], where: Sequence[int], weights: Sequence[int], overcommit: float) -> list[int]:
    """Each stage's part of its process's planning target, ``overcommit`` times, by
    ``weights``: by default the micro-batches it holds at most plus one (its parameters and
    state, about alike across stages), so that the V's first stage, holding many, gets more
    than its last, holding one."""
    total = [0] * len(capacities)
    for s, d in enumerate(where):
        total[d] += weights[s]
    return [min(capacities[d], round(overcommit * capacities[d] * weights[s] / max(1, total[d])))
            for s, d in enumerate(where)]


def _attempt(profile: Profile, request: PlanRequest) -> tuple[Stages, list[int], list[StageOptimum]]:
    """Split and optimise every stage; the caller checks whether all fit."""
    stages = planning_stages(profile, request)
    return _chosen(stages, request)


def _chosen(stages: Stages, request: PlanRequest) -> tuple[Stages, list[int], list[StageOptimum]]:
    """The request's partitioner's split of ``stages`` and its stages optimised, with the stages
    that priced them (sharded: after each stage's ``reshard_after_forward`` is chosen); the
    caller checks whether all fit."""
    balance = split(request.partitioner, stages)
    optima = stages.pruned(balance)
    if stages.model.sharding is not None:
        stages, optima = choose_resharding(
            stages, balance, optima, lambda sharding: planning_stages(sharding.source, request, sharding=sharding))
    return stages, balance, optima


def _infeasible(
    stages: Stages, partitioner: str, balance: list[int], optima: list[StageOptimum]
) -> InfeasiblePlanError:
    """Explain what does not fit and what to change, with the lowest peak any plan reaches."""
    # optimised as far as they go, whatever the targets, searched further than a split's search can afford
    lowest = floor(stages)
    unbounded = replace(stages.searched_further(), capacities=[0] * stages.count)
    bad = next(s for s, o in enumerate(optima) if not o.fits)
    optimised = "with memory optimisation" if stages.optimise_memory else "without memory optimisation"
    fitting = split("dawnpiper", stages) if partitioner != "dawnpiper" else balance
    fits = stages.fits(fitting)  # dawnpiper fits whenever one of the balances it tries does

    def fullest(candidate: list[int]) -> tuple[float, int, list[int]]:
        peaks = [o.peak.total for o in unbounded.placed(candidate)]
        worst = max(range(stages.count), key=lambda s: peaks[s] / stages.capacities[s])
        return peaks[worst] / stages.capacities[worst], worst, peaks

    # the lowest-peak search is a heuristic: a balance that fits is a lower one
    _, worst, peaks = min(fullest(lowest), fullest(fitting)) if fits else fullest(lowest)
    if fits:
        return InfeasiblePlanError(
            f"partitioner {partitioner!r} gave balance {balance}, whose stage {bad} needs "
            f"{optima[bad].peak.total} bytes {optimised}, over its planning target "
            f"{stages.capacities[bad]}. Other balances fit (the smallest peak any plan reaches is "
            f"{peaks[worst]} bytes, on stage {worst}): use partitioner 'dawnpiper', which keeps the "
            f"fastest balance that fits among every partitioner's, or give balance={fitting}.",
            peaks[worst],
            worst,
        )
    if not stages.optimise_memory:
        relief = "let stages recompute (optimise_memory=True)"
    elif stages.host_bandwidth is None:
        relief = "allow swapping by giving host_bandwidth"
    else:
        relief = "use a faster host link"
    return InfeasiblePlanError(
        f"no plan fits: the smallest peak any plan reaches {optimised} is {peaks[worst]} "
        f"bytes on stage {worst} (planning target {stages.capacities[worst]}), with balance {lowest}. "
        f"Lower the micro-batch size (max_microbatch finds the largest that fits), add stages or "
        f"device memory, use a schedule that holds fewer micro-batches ('1f1b' rather than 'gpipe'), "
        f"or {relief}.",
        peaks[worst],
        worst,
    )
