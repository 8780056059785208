"""Configuration search: how to lay a global batch out over a cluster of identical GPUs.

A cluster of ``G`` GPUs trains as ``width`` data-parallel replicas of a pipeline ``depth``
stages deep (``depth * width == G``), which is how ``MemoryPipeStrategy(runtime="distributed",
stages=depth)`` runs it. Each replica takes ``global_batch / width`` samples per step, in
``chunks`` micro-batches under a ``schedule``. :func:`search` plans every such configuration
with dawnpiper (the planner's best partitioner) and ranks the ones that fit by simulated
samples per second: the pipeline's simulated step plus the gradient all-reduce among the
replicas, which a step waits for before its optimizer step.

The candidate numbers of micro-batches are the divisors of the replica's batch up to
:data:`CHUNKS_PER_STAGE` times the depth: past that the bubble of ``depth - 1`` micro-batches
is a small share of the step, while each micro-batch gets smaller. The micro-batch size
follows: ``global_batch / (width * chunks)``.

Only the schedules the distributed runtime runs are searched (:data:`SEARCHED_SCHEDULES`):
PipeDream-2BW keeps two weight versions, which only the one-process runtime does, and one
process cannot hold data-parallel replicas.

The search plans on one profile scaled to each micro-batch size
(:meth:`~lightning_pipe.plan.profile.Profile.scaled`: one profiling run, not one per size) and
visits configurations best :func:`bound` first, so that one whose bound cannot reach the
``top`` found so far is never planned: planning a large model with recompute takes seconds.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_pipe.plan.plan import PLANNING_HEADROOM, Plan, fitting_plan
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.schedule import Schedule, check_schedule

__all__ = ["BOUND_ROUNDING", "CHUNKS_PER_STAGE", "SEARCHED_SCHEDULES", "Candidate", "Cluster", "Configuration",
           "Search", "allreduce_ms", "bound", "candidates", "search"]

#: Micro-batches per batch are tried up to this many per pipeline stage.
CHUNKS_PER_STAGE = 4
#: How far a plan's simulated samples/s may exceed :func:`bound`: the cost model sums its times
#: in single precision.
BOUND_ROUNDING = 1e-3
#: The schedules tried: those of the distributed runtime, which runs data-parallel replicas, with
#: one stage per process (the search knows no stages per process; ``schedule="auto"`` weighs the
#: multi-stage ones: :mod:`~lightning_pipe.plan.auto`).
SEARCHED_SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Cluster:
    """``gpus`` identical GPUs, each with ``memory_limit`` bytes for its stage; ``link_bandwidth``
    (bytes/s, one direction) between any two, which prices both the sends between stages and
    the gradient all-reduce (``None``: both free); ``host_bandwidth`` lets stages swap (``None``:
    no swap).

    Raises:
        ValueError: a count or a size out of range, naming it.
    """

    gpus: int
    memory_limit: int
    link_bandwidth: float | None = None
    host_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"the cluster has {self.gpus} GPUs: give at least one.")
        if self.memory_limit <= 0:
            raise ValueError(f"memory_limit must be positive (bytes per GPU), got {self.memory_limit}.")


@dataclass(frozen=True)
class Candidate:
    """One configuration to plan: ``depth`` stages x ``width`` replicas, each replica's batch in
    ``chunks`` micro-batches of ``microbatch_size`` under ``schedule``."""

    depth: int
    width: int
    schedule: Schedule
    chunks: int
    microbatch_size: int

    @property
    def batch(self) -> int:
        """Samples per step, all replicas together."""
        return self.width * self.chunks * self.microbatch_size


@dataclass
class Configuration:
    """A candidate that fits, with the plan of one replica's pipeline (all replicas plan alike)
    and what a step costs: the pipeline's simulated step and the all-reduce after it (ms)."""

    candidate: Candidate
    plan: Plan
    allreduce_ms: float
    memory_limit: int

    @property
    def step_ms(self) -> float:
        return self.plan.step_ms + self.allreduce_ms

    @property
    def samples_per_second(self) -> float:
        return 1e3 * self.candidate.batch / self.step_ms if self.step_ms > 0 else float("inf")

    @property
    def peaks(self) -> list[int]:
        """Each stage's predicted peak (bytes)."""
        return [s.peak.total for s in self.plan.stages]

    def to_dict(self) -> dict[str, Any]:
        """The configuration as ``--json`` writes it: sizes in bytes, times in ms."""
        c = self.candidate
        return {
            "depth": c.depth, "width": c.width, "schedule": c.schedule, "chunks": c.chunks,
            "micro_batch": c.microbatch_size, "samples_per_second": self.samples_per_second,
            "step_ms": self.step_ms, "pipeline_ms": self.plan.step_ms, "allreduce_ms": self.allreduce_ms,
            "bubble": self.plan.bubble, "balance": self.plan.balance, "stage_peaks": self.peaks,
            "memory_limit": self.memory_limit,
        }


@dataclass
class Search:
    """What :func:`search` found: the configurations that fit, best first; how many candidates
    it planned, how many of those did not fit, and how many it skipped because even their
    bound could not reach the ``top`` it was asked for."""

    configurations: list[Configuration]
    planned: int
    infeasible: int
    skipped: int


def candidates(
    gpus: int, global_batch: int, max_depth: int, schedules: Iterable[Schedule] = SEARCHED_SCHEDULES,
    chunks: int | None = None,
) -> list[Candidate]:
    """Every configuration of ``gpus`` GPUs for ``global_batch`` samples per step: each depth
    dividing ``gpus`` up to ``max_depth`` (the graph's nodes: a stage holds one at least), whose
    width divides the batch; each schedule; each number of micro-batches dividing the replica's
    batch up to :data:`CHUNKS_PER_STAGE` per stage (only ``chunks`` where given) that the
    schedule runs on torch (:func:`~lightning_pipe.plan.schedule.check_schedule`).

    Raises:
        ValueError: a global batch below one, a schedule without replicas (2BW), or no
            candidate (naming the batch, the widths and the fix).
    """
    if global_batch < 1:
        raise ValueError(f"the global batch is {global_batch} samples: give at least one.")
    for s in schedules:
        if s not in SEARCHED_SCHEDULES:
            why = ("it runs only with runtime='local', one process without data-parallel replicas" if s == "2bw"
                   else "it holds several stages per process, which the search does not lay out")
            raise ValueError(f"schedule {s!r} cannot be searched: {why}; give one of "
                             f"{', '.join(map(repr, SEARCHED_SCHEDULES))}.")
    found = []
    for depth in _depths(gpus, max_depth):
        width = gpus // depth
        if global_batch % width:
            continue
        replica = global_batch // width
        counts = [chunks] if chunks is not None else range(1, CHUNKS_PER_STAGE * depth + 1)
        for count in (c for c in counts if replica % c == 0):
            found += [Candidate(depth, width, s, count, replica // count) for s in schedules if _runs(s, count, depth)]
    if not found:
        raise ValueError(_none_found(gpus, global_batch, max_depth, chunks))
    return found


def _runs(schedule: Schedule, chunks: int, depth: int) -> bool:
    """Whether torch runs ``schedule`` with ``chunks`` micro-batches over ``depth`` processes
    (1F1B: one per stage at least); a pipeline of one stage takes any."""
    try:
        check_schedule(schedule, chunks, depth, 1, distributed=True)
    except ValueError:
        return False
    return True


def allreduce_ms(plan: Plan, width: int, link_bandwidth: float | None) -> float:
    """The gradient all-reduce among ``width`` replicas of ``plan``'s pipeline: each stage
    reduces its own with its replicas by a ring, ``2 (w - 1) / w`` times its parameter bytes
    over the link, all stages at once, so the stage with the most parameters decides. No
    replicas or no link price: nothing."""
    return _ring_ms(max(s.param_bytes for s in plan.stages), width, link_bandwidth)


def _ring_ms(nbytes: float, width: int, link_bandwidth: float | None) -> float:
    """A ring all-reduce of ``nbytes`` among ``width`` ranks: ``2 (w - 1) / w`` times them over
    the link; nothing for one rank or an unpriced link."""
    if width == 1 or link_bandwidth is None:
        return 0.0
    return 1e3 * 2 * (width - 1) / width * nbytes / link_bandwidth


def search(
    profile: Profile, cluster: Cluster, global_batch: int, *, schedules: Sequence[Schedule] = SEARCHED_SCHEDULES,
    chunks: int | None = None, top: int | None = 10, progress: Callable[[int, int], None] | None = None,
) -> Search:
    """The configurations of ``cluster`` for ``global_batch`` samples per step that fit (every
    stage planned below its GPU's limit by the flat
    :data:`~lightning_pipe.plan.plan.PLANNING_HEADROOM`), best first by simulated samples per
    second. With ``top``, a candidate whose :func:`bound` cannot beat the ``top``-th found so
    far is skipped;
    ``None``: every candidate is planned. ``progress(done, total)`` after each candidate.

    Raises:
        ValueError: no candidate (:func:`candidates`), naming the batch, the GPUs and the fix.
    """
    pending = candidates(cluster.gpus, global_batch, len(profile.nodes), schedules, chunks)
    # best bound first; among equals the smallest micro-batch, the likeliest to fit without recompute
    bounds = {c: bound(profile, cluster, c) for c in pending}
    pending.sort(key=lambda c: (-bounds[c], c.microbatch_size))
    target = int(cluster.memory_limit * PLANNING_HEADROOM)
    scaled: dict[int, Profile] = {}
    found: list[Configuration] = []
    planned = infeasible = 0
    for done, c in enumerate(pending, 1):
        reach = bounds[c] * (1 + BOUND_ROUNDING)
        if top is not None and len(found) >= top and reach < found[top - 1].samples_per_second:
            break  # sorted by bound: none after it can reach the top either
        if c.microbatch_size not in scaled:
            scaled[c.microbatch_size] = profile.scaled(c.microbatch_size)
        request = PlanRequest([target] * c.depth, "dawnpiper", c.schedule, c.chunks, cluster.host_bandwidth,
                              cluster.link_bandwidth, carry=True, replicas=c.width)
        plan = fitting_plan(scaled[c.microbatch_size], request)
        planned += 1
        if plan is None:
            infeasible += 1
        else:
            found.append(Configuration(c, plan, allreduce_ms(plan, c.width, cluster.link_bandwidth),
                                       cluster.memory_limit))
            found.sort(key=lambda f: (-f.samples_per_second, max(f.peaks)))  # as fast: the one with more room
        if progress is not None:
            progress(done, len(pending))
    if progress is not None:
        progress(len(pending), len(pending))
    return Search(found, planned, infeasible, len(pending) - planned)


def bound(profile: Profile, cluster: Cluster, candidate: Candidate) -> float:
    """Samples/s no plan of ``candidate`` beats. A stage can start only after the first
    micro-batch's forward through the stages before it and ends before the last one's backward
    through them, so a step takes at least ``P_s + chunks * t_s`` for every stage ``s`` (its
    time ``t_s`` per micro-batch, ``P_s`` the earlier stages'); the split making these equal is
    the least any split reaches: ``T / (1 - (1 - 1/chunks) ** depth)`` for a compute time ``T``
    per micro-batch (recompute and sends only add). The all-reduce moves at least an even share
    of the parameters."""
    c = candidate
    compute = sum(n.forward_ms + n.backward_ms for n in profile.nodes) * c.microbatch_size / profile.microbatch_size
    pipeline = compute / (1 - (1 - 1 / c.chunks) ** c.depth)
    reduce = _ring_ms(sum(n.param_bytes for n in profile.nodes) / c.depth, c.width, cluster.link_bandwidth)
    return 1e3 * c.batch / (pipeline + reduce) if pipeline + reduce > 0 else float("inf")


def _depths(gpus: int, max_depth: int) -> list[int]:
    """The pipeline depths of ``gpus`` GPUs: those dividing the count, up to ``max_depth``."""
    return [d for d in range(1, min(gpus, max_depth) + 1) if gpus % d == 0]


def _none_found(gpus: int, global_batch: int, max_depth: int, chunks: int | None) -> str:
    """Why no configuration lays ``global_batch`` out over ``gpus`` GPUs, and what to change."""
    widths = sorted(gpus // d for d in _depths(gpus, max_depth))
    fitting = [w for w in widths if global_batch % w == 0]
    if not fitting:
        return (f"a global batch of {global_batch} splits evenly over no data-parallel width: {gpus} GPUs with a "
                f"pipeline depth of at most {max_depth} (the graph's nodes) make widths "
                f"{', '.join(map(str, widths))}; give a global batch divisible by one of them, e.g. "
                f"{-(-global_batch // widths[0]) * widths[0]}.")
    replicas = ", ".join(str(global_batch // w) for w in fitting)
    return (f"chunks={chunks} divides no replica's batch ({replicas} samples for widths "
            f"{', '.join(map(str, fitting))}): give a number of micro-batches dividing one of them, or leave "
            f"chunks out to search them.")
