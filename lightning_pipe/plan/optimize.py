"""Per-stage memory optimisation: choose which nodes to swap or recompute so a stage fits.

Capuchin's cost model, applied to the nodes of one stage (DawnPiper does the same per
partition candidate). A node's saved bytes can go to host memory and come back before its
backward; the transfer hides behind the compute between its forward and its backward (its
*FreeTime* is that window minus the round trip). Or they can be dropped and rebuilt by running
the forward again (*MSPS*: memory saved per second of recompute). Swaps that stay hidden are
taken first, most FreeTime first; after that each step takes whichever of the next exposed swap
and the highest-MSPS recompute costs less time per byte it frees, until the stage fits.
A choice that would bring back more bytes at once for one backward (a merged recompute region,
a large swapped node) than it frees in flight is skipped. If the greedy runs out, segmented
recompute (checkpointing) and swapping everything are tried outright.

Times are per micro-batch, in milliseconds; ``host_bandwidth`` is bytes per second of the
device-host link (``None``: no swapping).
"""

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from lightning_pipe.plan.memory import CostModel, StagePeak, Waiting
from lightning_pipe.plan.nodes import Array
from lightning_pipe.plan.policy import CodedPolicies, Codes, Policy, chosen_codes

__all__ = ["TIME_NOISE", "Descent", "StageOptimum", "lowest_peak", "optimize_stage", "policy_time", "prune_stage"]

# Measured times closer than this (relative) count as equal when a stage orders the nodes to
# recompute or swap. Node times are measured: on a CPU a plan's predicted step moves by 1-2%
# (one standard deviation) from one profile to the next; 10% is some five of them, so that
# profiling again does not change a stage's choices. (Splits tie within partitioners.TIE.)
TIME_NOISE = 0.1
# A stage the greedy and the low-memory fallbacks leave at most this far over its capacity is
# searched further (Descent). Not every stage: the descent prices a stage hundreds of times and
# a split search tries thousands of stages; one this far over is dropped without it.
DESCENT_MARGIN = 1.25


@dataclass
class StageOptimum:
    """A stage's policies (non-``keep`` nodes only), what they add per micro-batch and the peak
    they reach. ``fits`` is false when no choice brings the peak under the capacity; ``peak``
    is then the lowest one found."""

    policies: dict[int, Policy] = field(default_factory=dict)
    recompute_ms: float = 0.0
    swap_ms: float = 0.0
    peak: StagePeak = field(default_factory=lambda: StagePeak(0, 0, 0, 0))
    fits: bool = True

    @property
    def added_ms(self) -> float:
        return self.recompute_ms + self.swap_ms

    @cached_property
    def coded(self) -> tuple[Array, Codes]:
        """Its chosen nodes and their policies' codes (:func:`chosen_codes`; cached: a split
        search lays every stage's choices into one array for each split it prices, most stages'
        as before)."""
        return chosen_codes(self.policies)


def policy_time(
    model: CostModel, lo: int, hi: int, policies: dict[int, Policy], host_bandwidth: float | None
) -> tuple[float, float]:
    """(recompute, exposed swap) milliseconds per micro-batch of a stage's policies.

    Exposed swap time: each transfer beyond its own window, or the link's total busy time
    beyond the stage's compute, whichever is larger (transfers share one link).
    """
    recompute = sum(model.forward_ms[i] for i, p in policies.items() if p == "recompute")
    swapped = [i for i, p in policies.items() if p == "swap"]
    if not swapped:
        return recompute, 0.0
    if host_bandwidth is None:
        raise ValueError("swap policies need a host_bandwidth.")
    late = link = 0.0
    for i in swapped:
        t = _round_trip_ms(model, i, host_bandwidth)
        late += max(0.0, t - model.compute_ms(i + 1, hi))
        link += t
    return recompute, max(late, link - model.compute_ms(lo, hi))


def _round_trip_ms(model: CostModel, i: int, host_bandwidth: float) -> float:
    return 2e3 * model.saved[i] / host_bandwidth


def optimize_stage(
    model: CostModel,
    lo: int,
    hi: int,
    in_flight: float,
    capacity: float,
    weight_versions: int = 1,
    host_bandwidth: float | None = None,
    optimise: bool = True,
    thorough: bool = False,
    waiting: Waiting = (0, ()),
    earlier: Mapping[int, Policy] = {},
) -> StageOptimum:
    """Cheapest policies (by the greedy above) bringing stage ``[lo, hi)`` under ``capacity``;
    with ``optimise`` false, every node keeps its activations. A stage left near its capacity
    is searched further (:class:`Descent`); with ``thorough``, so is one asked for its lowest
    peak (``capacity`` 0), which costs a planner's search too much to do for every range.
    ``waiting``: what waits at the stage for others (:meth:`CostModel.waiting`), once known;
    ``earlier``: the policies of earlier stages' nodes keeping or making values the stage reads
    (:meth:`CostModel.depends_on`), once chosen: a value such a node drops, a recomputed
    region of the stage keeps. Choices the stage turns out to fit without stay
    (:func:`prune_stage` drops them, at one pricing per choice: a search prunes only the split
    it chooses)."""
    stage = PricedStage(model, lo, hi, in_flight, capacity, weight_versions, host_bandwidth, waiting, earlier)
    base = stage.kept()
    if base.fits or not optimise:
        return base
    best = _greedy(stage, base)
    if not best.fits and ((capacity <= 0 and thorough) or best.peak.total <= DESCENT_MARGIN * capacity):
        best = Descent(stage, best).down_to(capacity)
    return best


def lowest_peak(
    model: CostModel, lo: int, hi: int, in_flight: float, weight_versions: int = 1,
    host_bandwidth: float | None = None, optimise: bool = True,
) -> "Descent":
    """The lowest peak of stage ``[lo, hi)`` (:func:`optimize_stage` at capacity 0, ``thorough``),
    as a descent run only as far as it is asked: whether a stage gets under a limit is known
    once it does, and most of a search's questions are that."""
    stage = PricedStage(model, lo, hi, in_flight, 0, weight_versions, host_bandwidth, (0, ()), {})
    base = stage.kept()
    return Descent(stage, _greedy(stage, base) if optimise and not base.fits else base)


def _greedy(stage: "PricedStage", base: StageOptimum) -> StageOptimum:
    """The greedy of the module docstring from the stage's ``base`` (nothing chosen, over its
    capacity), then the low-memory fallbacks: its first choices that fit, else the lowest peak
    found."""
    model, lo, hi, capacity = stage.model, stage.lo, stage.hi, stage.capacity
    in_flight, host_bandwidth = stage.in_flight, stage.host_bandwidth
    compute = model.compute_ms(lo, hi)

    swaps: list[tuple[float, int]] = []  # (round trip, node), most FreeTime first
    if host_bandwidth:
        swaps = sorted(
            ((_round_trip_ms(model, i, host_bandwidth), i) for i in range(lo, hi) if model.saved[i] > 0),
            key=lambda c: c[0] - model.compute_ms(c[1] + 1, hi),
        )
    # ms per byte freed and node, highest MSPS first. A node keeps its inputs (it saves them
    # first) or what it made: inside a recomputed region with their producers, both go.
    recompute_costs, recomputes = _steady_order(model, lo, hi)

    policies: dict[int, Policy] = {}
    late = link = 0.0
    estimate = float(base.peak.total)  # the peak if every choice frees what it promises
    restore = 0  # largest bytes brought back at once for one backward (see memory.py)
    run_start: dict[int, int] = {}  # last node of a recomputed run -> its first
    run_stop: dict[int, int] = {}  # first node of a recomputed run -> one past its last
    best = base
    si = ri = 0

    def exposed(extra_late: float, extra_link: float) -> float:
        return max(late + extra_late, link + extra_link - compute)

    def check() -> StageOptimum | None:
        nonlocal estimate, best
        found = stage.priced(dict(policies))
        if found.fits:
            return found
        if found.peak.total < best.peak.total:
            best = found
        estimate = found.peak.total  # choices freed less than promised
        return None

    while si < len(swaps) or ri < len(recomputes):
        swap_cost = recompute_cost = float("inf")
        if si < len(swaps):
            t, i = swaps[si]
            window = model.compute_ms(i + 1, hi)
            hidden = t <= window and link + t <= compute
            swap_cost = 0.0 if hidden else (exposed(max(0.0, t - window), t) - exposed(0.0, 0.0)) / model.saved[i]
        if ri < len(recomputes):
            recompute_cost = recompute_costs[ri]
        if swap_cost <= recompute_cost:
            t, i = swaps[si]
            si += 1
            gain = in_flight * model.saved[i] - max(0, model.saved[i] - restore)
            if i in policies or gain < 0:
                continue
            policies[i] = "swap"
            _join_swaps(model, lo, hi, i, policies)
            late += max(0.0, t - model.compute_ms(i + 1, hi))
            link += t
            restore = max(restore, model.saved[i])
        else:
            i = recomputes[ri]
            ri += 1
            if i in policies:
                continue
            first = run_start[i - 1] if policies.get(i - 1) == "recompute" else i
            stop = run_stop[i + 1] if policies.get(i + 1) == "recompute" else i + 1
            region = model.stashed(first, stop)
            gain = in_flight * model.saved[i] - max(0, region - restore)
            if gain < 0:  # the merged region would bring back more than it saves
                continue
            policies[i] = "recompute"
            run_start[stop - 1], run_stop[first] = first, stop
            restore = max(restore, region)
        estimate -= gain
        if estimate <= capacity and (found := check()):
            return found
    for found in stage.priced_all([dict(policies)] + lowest_memory_policies(model, lo, hi, host_bandwidth)):
        if _better(found, best):
            best = found
    return best


def prune_stage(
    model: CostModel,
    lo: int,
    hi: int,
    in_flight: float,
    capacity: float,
    found: StageOptimum,
    weight_versions: int = 1,
    host_bandwidth: float | None = None,
    waiting: Waiting = (0, ()),
    earlier: Mapping[int, Policy] = {},
) -> StageOptimum:
    """``found`` (an :func:`optimize_stage` result) without the choices the stage fits
    without."""
    return _pruned(PricedStage(model, lo, hi, in_flight, capacity, weight_versions, host_bandwidth, waiting, earlier),
                   found)


class Descent:
    """A stage's choices (from :func:`_greedy`) dropped one at a time while each drop lowers the
    peak: recomputing everything is seldom the lowest (a node kept between two regions can keep
    less than the merged region would). Each round drops the choice lowering the peak most
    among the runs where the backward peaks (a region's stash comes back there); when none
    there lowers it, the first that does in node order from the last such drop on, wrapping
    round (started over from the first node every time, the scans of a long stage price it
    many times over). Every drop lowers the peak, so a descent stopped at a limit goes on
    from there as it would have."""

    def __init__(self, stage: "PricedStage", found: StageOptimum) -> None:
        self.stage, self.found = stage, found
        self.ended = not found.policies  # no drop lowers the peak (none is left to drop)
        self.scanned = stage.lo  # where the scan in node order goes on from
        self.coded = CodedPolicies.of({**stage.earlier, **found.policies}, stage.model.n)

    def down_to(self, limit: float) -> StageOptimum:
        """The choices once the peak is at most ``limit`` bytes, or no drop lowers it."""
        while not self.ended and self.found.peak.total > limit:
            self._drop()
        return self.found

    def _drop(self) -> None:
        """One round: drop the choice the class docstring says, or end where none lowers the peak."""
        stage, found, coded = self.stage, self.found, self.coded
        peaking = [i for i in stage.model.backward_peak_runs(stage.lo, stage.hi, coded) if i in found.policies]
        lowest = min(zip(stage.totals(coded, peaking), peaking), default=None)
        if lowest is None or lowest[0] >= found.peak.total:
            order = sorted(found.policies, key=lambda i: (i < self.scanned, i))
            first = _first_drop(stage, coded, order, found.peak.total - 1)  # totals are whole bytes
            lowest = (first[1], order[first[0]]) if first else None
            self.scanned = lowest[1] if lowest else self.scanned
        if lowest is None:
            self.ended = True
            return
        self.found = stage.priced({j: p for j, p in found.policies.items() if j != lowest[1]})  # in the order chosen
        self.coded = coded.without(lowest[1])


def _first_drop(
    stage: "PricedStage", coded: CodedPolicies, order: Sequence[int], at_most: float
) -> tuple[int, int] | None:
    """The position in ``order`` of the first choice whose drop leaves a peak total of at most
    ``at_most``, and that total: priced in batches, growing from a few (such a drop is often
    near the start of ``order``; else the whole order may be priced)."""
    size, start = 4, 0
    while start < len(order):
        batch = order[start : start + size]
        found = next(((start + k, total) for k, total in enumerate(stage.totals(coded, batch)) if total <= at_most),
                     None)
        if found:
            return found
        start += size
        size = min(2 * size, 64)
    return None


def _pruned(stage: "PricedStage", found: StageOptimum) -> StageOptimum:
    """``found`` without the choices the stage fits without: recomputes before swaps (a swap
    the link hides costs nothing, a recompute always costs its forward), each kind those
    keeping the fewest bytes first (bytes, unlike times, do not vary between profiles): a node
    chosen early can turn out to free nothing once its neighbours are chosen (a recomputed
    region keeps its inputs, so what one node keeps may be the region's input). Dropping a
    choice never adds time (:func:`policy_time` sums over the choices), so only peaks are
    priced."""
    policies = dict(found.policies)  # in the order chosen
    coded = CodedPolicies.of({**stage.earlier, **policies}, stage.model.n)
    order = sorted(found.policies, key=lambda i: (found.policies[i] == "swap", stage.model.saved[i], i))
    run = 4  # how many drops in a row to price at once
    while order:
        # The drops next in order, each with those before it, priced at once: one at a time, the
        # search drops each of a leading run that fits (it fits when it is the next one asked).
        ahead = order[:run]
        dropped = [coded]
        for i in ahead:
            dropped.append(dropped[-1].without(i))
        fitting = next((k for k, total in enumerate(stage.totals_of(dropped[1:])) if total > stage.capacity),
                       len(ahead))
        for i in ahead[:fitting]:
            del policies[i]
        coded, order = dropped[fitting], order[fitting:]
        if fitting == len(ahead):
            run = min(2 * run, 64)
            continue
        run = 4
        # the next one does not fit dropped: the first after it that does
        if not (first := _first_drop(stage, coded, order[1:], stage.capacity)):
            break
        i = order[1 + first[0]]
        coded = coded.without(i)
        del policies[i]
        order = order[first[0] + 2 :]
    return stage.priced(policies) if len(policies) < len(found.policies) else found


def _join_swaps(model: CostModel, lo: int, hi: int, i: int, policies: dict[int, Policy]) -> None:
    """Swap the nodes keeping nothing between swapped node ``i`` and the next swapped node
    either side: that costs nothing, and one segment swaps what it passes between its nodes,
    where two keep it on the device as the later one's input."""
    for step in (-1, 1):
        gap, j = [], i + step
        while lo <= j < hi and j not in policies and model.saved[j] == 0:
            gap.append(j)
            j += step
        if lo <= j < hi and policies.get(j) == "swap":
            policies.update(dict.fromkeys(gap, "swap"))


def _steady_order(model: CostModel, lo: int, hi: int) -> tuple[list[float], list[int]]:
    """The ms per byte freed and the nodes of ``[lo, hi)`` saving bytes, cheapest first, where
    costs within :data:`TIME_NOISE` of a run's cheapest count as equal and the node keeping
    more bytes goes first: measured times vary from one profile to the next, bytes do not, so
    the same model gets the same choices. (Sorted by NumPy, each run found by bisection of a
    list: a split search orders thousands of stages, and NumPy's per-call overhead was most of
    bisecting an array.)"""
    nodes, costs, saved = model.recompute_costs(lo, hi)
    order = np.lexsort((nodes, costs))  # by (cost, node)
    ordered = costs[order].tolist()
    new = np.zeros(order.size, dtype=np.int64)  # 1 where a run starts (but the first)
    start = 0
    while start < len(ordered):  # a run: every cost up to its first's times 1 + TIME_NOISE
        start = max(start + 1, bisect.bisect_right(ordered, ordered[start] * (1 + TIME_NOISE), start))
        new[start : start + 1] = 1
    runs = np.cumsum(new)
    order = order[np.lexsort((nodes[order], -saved[order], runs))]  # within a run, by (-bytes, node)
    return costs[order].tolist(), nodes[order].tolist()


def _better(a: StageOptimum, b: StageOptimum) -> bool:
    """Fitting beats not fitting; among fitting, less added time; otherwise the lower peak."""
    if a.fits != b.fits:
        return a.fits
    return a.added_ms < b.added_ms if a.fits else a.peak.total < b.peak.total


@dataclass(frozen=True)
class PricedStage:
    """What :func:`optimize_stage` prices policies for: nodes ``[lo, hi)`` of ``model`` as a
    stage holding ``in_flight`` micro-batches under ``capacity``, what waits at it, and the
    policies of the earlier nodes keeping or making what it reads (priced with its own)."""

    model: CostModel
    lo: int
    hi: int
    in_flight: float
    capacity: float
    weight_versions: int
    host_bandwidth: float | None
    waiting: Waiting
    earlier: Mapping[int, Policy]

    def peak(self, policies: Mapping[int, Policy]) -> StagePeak:
        """The stage's peak under ``policies``: its own, or with ``earlier``'s already
        (:class:`CodedPolicies`)."""
        if self.earlier and not isinstance(policies, CodedPolicies):
            policies = {**self.earlier, **policies}
        return self.model.peak(self.lo, self.hi, self.in_flight, policies, self.weight_versions, self.waiting)

    def totals(self, coded: CodedPolicies, drops: Sequence[int]) -> list[int]:
        """The stage's peak total with each of ``drops`` kept in turn, priced at once."""
        return self.totals_of([coded.without(i) for i in drops])

    def totals_of(self, variants: Sequence[CodedPolicies]) -> list[int]:
        """The stage's peak total under each of ``variants`` (every node's policy), priced at once."""
        peaks = self.model.peaks(self.lo, self.hi, self.in_flight, variants, self.weight_versions, self.waiting)
        return [p.total for p in peaks]

    def kept(self) -> StageOptimum:
        """The stage with no choices."""
        peak = self.peak({})
        return StageOptimum(peak=peak, fits=peak.total <= self.capacity)

    def priced(self, policies: dict[int, Policy], peak: StagePeak | None = None) -> StageOptimum:
        """``policies`` with their times and ``peak`` (priced when not given)."""
        peak = self.peak(policies) if peak is None else peak
        recompute_ms, swap_ms = policy_time(self.model, self.lo, self.hi, policies, self.host_bandwidth)
        return StageOptimum(policies, recompute_ms, swap_ms, peak, peak.total <= self.capacity)

    def priced_all(self, options: Sequence[dict[int, Policy]]) -> list[StageOptimum]:
        """:meth:`priced` of each of ``options``, those choosing a node of the stage priced at
        once (as :meth:`totals` does; the others are the stage kept, priced as such)."""
        ours = [k for k, o in enumerate(options) if any(self.lo <= i < self.hi for i in o)]
        coded = [CodedPolicies.of({**self.earlier, **options[k]}, self.model.n) for k in ours]
        peaks = dict(zip(ours, self.model.peaks(self.lo, self.hi, self.in_flight, coded, self.weight_versions,
                                                 self.waiting)))
        return [self.priced(o, peaks.get(k)) for k, o in enumerate(options)]


def lowest_memory_policies(
    model: CostModel, lo: int, hi: int, host_bandwidth: float | None
) -> list[dict[int, Policy]]:
    """Low-memory policies to try when the greedy runs out of candidates, so a stage fits
    whenever one of them does: recompute in segments of 2, 4, 8, ... nodes with one kept
    node between them (checkpointing; the last is the whole stage as one region), and, with
    a host link, swapping everything."""
    options: list[dict[int, Policy]] = []
    size = 2
    while True:
        options.append({i: "recompute" for i in range(lo, hi) if (i - lo) % size != size - 1})
        if size > hi - lo:
            break
        size *= 2
    if host_bandwidth:
        options.append({i: "swap" for i in range(lo, hi) if model.saved[i] > 0})
    return options

