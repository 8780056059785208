"""Partitioners: split a profile's nodes into contiguous stages (a balance), one interface.

* ``dawnpiper``: memory-centric. Bisects the stage list from the middle stage and searches the
  cut only between the compute-balanced and the memory-balanced positions of each split
  (DawnPiper's theorem: under monotone costs the best cut lies there); candidates are priced
  with per-stage memory optimisation, so a stage may trade recompute or swap time for fitting.
  Objective: the slowest stage's time (compute + recompute + exposed swap + sending its outputs
  over the link between stage devices, when its bandwidth is given), every stage under its
  device's capacity. The transfer at a cut is not monotone in the cut, so with a link the
  compute-balanced cut is searched over every position. The bisection's split (also searched
  without memory optimisation) is one candidate and every baseline's is another, so dawnpiper
  fits whenever a baseline does; when none fits, a fill-first search looks for any split that
  fits. Of the fitting candidates the fastest by simulated step wins, with near-ties settled
  by bytes rather than timing noise (:func:`_steadiest`).
* ``capslog``: CAPSlog's binary search on a memory threshold with fill-first; minimises the
  largest peak relative to the stage's capacity (with equal capacities: the largest peak).
* ``time``: contiguous min-max of forward + backward (+ send) time (torchgpipe's
  balance_by_time; optimal without a link).
* ``params``: min-max of parameter bytes (DeepSpeed's default).
* ``uniform``: equal node counts (the first stages take one more when they do not divide).

Capacities are per stage device and may differ (heterogeneous devices).
"""

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal

from lightning_pipe.plan.balance import balance_by_weight, check_stage_count
from lightning_pipe.plan.memory import CostModel, Waiting, stage_ranges
from lightning_pipe.plan.optimize import NOISE, Descent, StageOptimum, lowest_peak, optimize_stage, prune_stage
from lightning_pipe.plan.policy import Policy
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.schedule import Action, BackwardState
from lightning_pipe.plan.simulate import Replay, StageTime

__all__ = [
    "BASELINES", "NOISE", "PARTITIONERS", "Partitioner", "Stages", "fitting_split", "lowest_peak_balance", "partition",
    "split",
]

# Stages.reachable's margin over the capacities: lowest peaks are not quite monotone in the range,
# so a split fill-first misses at the capacities can still be under them.
REACH = 1.05

Partitioner = Literal["dawnpiper", "capslog", "time", "params", "uniform"]
PARTITIONERS: tuple[Partitioner, ...] = ("dawnpiper", "capslog", "time", "params", "uniform")
BASELINES: tuple[Partitioner, ...] = ("time", "params", "uniform", "capslog")



@dataclass
class Stages:
    """What a partitioner plans for: a cost model, and per stage its device's capacity (bytes)
    and the micro-batches it holds at once; the schedule's weight copies; the host link; the
    schedule's :func:`~lightning_pipe.plan.schedule.gradient_waits` (none wait when empty) and
    its per-stage :func:`~lightning_pipe.plan.schedule.actions`, which price a whole split by
    its simulated step (without them: by its slowest stage). ``optimise_memory`` false: no
    stage recomputes or swaps. ``backward_states``: what a stage holds and what waits at it
    at each of its backwards (:func:`~lightning_pipe.plan.schedule.backward_states`)."""

    model: CostModel
    capacities: Sequence[int]
    in_flight: Sequence[int]
    weight_versions: int = 1
    host_bandwidth: float | None = None
    waits: Sequence[Sequence[int]] = ()
    order: Sequence[Sequence[Action]] = ()
    optimise_memory: bool = True
    backward_states: Sequence[Sequence[BackwardState]] = ()
    thorough: bool = False  # search stages asked for their lowest peak further (optimize_stage)
    _found: "_Found" = field(default_factory=lambda: _Found(), repr=False)

    @property
    def count(self) -> int:
        return len(self.capacities)

    def optimum(
        self, lo: int, hi: int, s: int, reserved: int = 0, waiting: Waiting = (0, ()), chosen: Mapping[int, Policy] = {}
    ) -> StageOptimum:
        """Memory optimisation of nodes ``[lo, hi)`` as stage ``s`` with ``reserved`` bytes of
        its capacity taken by something else, ``waiting`` at it and the earlier stages'
        policies ``chosen`` (cached)."""
        earlier = self.earlier(lo, hi, chosen)
        key = (lo, hi, s, reserved, waiting[0], tuple(waiting[1]), tuple(earlier.items()))
        if key not in self._found.optima:
            self._found.optima[key] = optimize_stage(
                self.model, lo, hi, self.in_flight[s], self.capacities[s] - reserved, self.weight_versions,
                self.host_bandwidth, self.optimise_memory, self.thorough, waiting, earlier,
            )
        return self._found.optima[key]

    def earlier(self, lo: int, hi: int, chosen: Mapping[int, Policy]) -> dict[int, Policy]:
        """Of the policies ``chosen`` for earlier stages, those a stage on ``[lo, hi)`` is
        priced with (:meth:`CostModel.depends_on`)."""
        if not chosen:
            return {}
        return {i: chosen[i] for i in self.model.depends_on(lo, hi) if i in chosen}

    def kept(self) -> "Stages":
        """These stages with no memory optimisation."""
        return self._varied(optimise_memory=False)

    def searched_further(self) -> "Stages":
        """These stages with each asked for its lowest peak searched further (``thorough``)."""
        return self._varied(thorough=True)

    def _varied(self, **changes: Any) -> "Stages":
        """These stages with ``changes``, and none of what was found for these (cached) kept."""
        return replace(self, **changes, _found=_Found())

    def floor(self) -> list[int]:
        """:func:`lowest_peak_balance` of these stages searched further: the split any plan
        comes closest to fitting with (cached: the search and the error that reports it ask)."""
        if self._found.floor is None:
            self._found.floor = lowest_peak_balance(self._searched(), self.reachable)
        return self._found.floor

    @cached_property
    def bisected(self) -> list[int]:
        """DawnPiper's binary partition of these stages (:func:`bisection`; cached: dawnpiper's
        first candidate, and its split when none fits)."""
        return bisection(self)

    @cached_property
    def reachable(self) -> list[int] | None:
        """A split whose every stage, searched further, gets within :data:`REACH` of its
        capacity: fill-first on the lowest peaks, one step of :meth:`floor`'s search, in a
        fraction of its time, and where that finds none, fill-first from the last stage (lowest
        peaks are not monotone in the range: a stage's stash holds what crosses its first cut,
        so the first stage's greedy ends can leave a rest that fits nowhere, and the last
        stage's not). The peaks searched further are asked for only where the stages' own
        lowest peaks (never lower, and some fifty times cheaper) reach nowhere. ``None``: no
        split comes that close either way, so :meth:`floor`'s, found by fill-first too, has a
        stage over its capacity."""
        limits, n = [REACH * c for c in self.capacities], self.model.n
        return reaching(n, limits, self.reaches) or reaching(n, limits, self._searched().reaches)

    def _searched(self) -> "Stages":
        """:meth:`searched_further`, kept: :meth:`reachable` and :meth:`floor` share its optima."""
        if self._found.further is None:
            self._found.further = self.searched_further()
        return self._found.further

    def lowest(self, lo: int, hi: int, s: int) -> int:
        """The lowest peak memory optimisation reaches for nodes ``[lo, hi)`` as stage ``s``: its
        optimum with the whole capacity reserved (so cached like the others); searched
        further, its whole descent (:meth:`reaches`)."""
        if self.thorough:
            return self._descent(lo, hi, s).down_to(0).peak.total
        return self.optimum(lo, hi, s, self.capacities[s]).peak.total

    def reaches(self, lo: int, hi: int, s: int, limit: float) -> bool:
        """Whether :meth:`lowest` of nodes ``[lo, hi)`` as stage ``s`` is at most ``limit``:
        searched further, known once the stage's descent gets under it (cached, to go on from
        there when asked a lower limit)."""
        if self.thorough:
            return self._descent(lo, hi, s).down_to(limit).peak.total <= limit
        return self.lowest(lo, hi, s) <= limit

    def _descent(self, lo: int, hi: int, s: int) -> Descent:
        if (lo, hi, s) not in self._found.descents:
            self._found.descents[lo, hi, s] = lowest_peak(self.model, lo, hi, self.in_flight[s], self.weight_versions,
                                                    self.host_bandwidth, self.optimise_memory)
        return self._found.descents[lo, hi, s]

    def placed(self, balance: Sequence[int]) -> list[StageOptimum]:
        """Every stage of ``balance`` optimised under its capacity with what waits at it
        (:meth:`CostModel.waiting`: gradients for earlier stages, and outputs for a stage
        beyond the next), known only for a whole split; what waits depends on the policies
        chosen, so the split is priced again with them, and where that goes over, again
        with every stage pruned (:meth:`pruned`; cached)."""
        if (placed := self._found.placed.get(tuple(balance))) is None:
            placed = self._place(balance, list(self._optimised(balance)))
        return placed

    def _place(self, balance: Sequence[int], optima: list[StageOptimum]) -> list[StageOptimum]:
        """:meth:`placed` of ``balance`` from its stages' ``optima`` (:meth:`_optimised`), cached."""
        placed = self._priced(balance, optima)
        if all(o.fits for o in optima) and not all(o.fits for o in placed):
            placed = self._pruned(balance, optima)
        self._found.placed[tuple(balance)] = placed
        return placed

    def _optimised(self, balance: Sequence[int]) -> Iterator[StageOptimum]:
        """Each stage of ``balance`` optimised under its capacity with what waits at it, in order:
        a stage is priced with the earlier ones' choices (so :meth:`fits` can stop at one over)."""
        waits = self.model.waiting(balance, self.waits, self.backward_states)
        chosen: dict[int, Policy] = {}
        for s, r in enumerate(stage_ranges(balance)):
            found = self.optimum(r.start, r.stop, s, waiting=waits[s], chosen=chosen)
            chosen.update(found.policies)
            yield found

    def pruned(self, balance: Sequence[int]) -> list[StageOptimum]:
        """:meth:`placed`, each stage without the choices it fits without. The search leaves
        them (a choice seldom turns out to free nothing once its neighbours are chosen, and
        finding one costs a pricing per choice), so only a chosen split is pruned."""
        placed = self.placed(balance)
        if not all(o.fits for o in placed):
            return placed
        pruned = self._pruned(balance, placed)
        return pruned if all(o.fits for o in pruned) else placed

    def _pruned(self, balance: Sequence[int], optima: Sequence[StageOptimum]) -> list[StageOptimum]:
        """``optima`` without the choices each stage fits without, with what waits at it."""
        chosen = {i: p for o in optima for i, p in o.policies.items()}
        waits = self.model.waiting(balance, self.waits, self.backward_states, chosen)
        return self._priced(balance, [
            self._pruned_stage(r.start, r.stop, s, o, waits[s], chosen)
            for s, (r, o) in enumerate(zip(stage_ranges(balance), optima))
        ])

    def _pruned_stage(
        self, lo: int, hi: int, s: int, found: StageOptimum, waiting: Waiting, chosen: Mapping[int, Policy]
    ) -> StageOptimum:
        """:func:`~lightning_pipe.plan.optimize.prune_stage` of stage ``s`` on ``[lo, hi)`` (cached: a
        search moving one cut prunes the whole split again, its other stages as before)."""
        earlier = self.earlier(lo, hi, chosen)
        key = (lo, hi, s, tuple(found.policies.items()), waiting[0], tuple(waiting[1]), tuple(earlier.items()))
        if key not in self._found.prunes:
            pruned = prune_stage(self.model, lo, hi, self.in_flight[s], self.capacities[s], found,
                                 self.weight_versions, self.host_bandwidth, waiting, earlier)
            self._found.prunes[key] = None if pruned is found else pruned  # None: nothing to drop
        return self._found.prunes[key] or found

    def _priced(self, balance: Sequence[int], optima: Sequence[StageOptimum]) -> list[StageOptimum]:
        """``optima`` with their peaks priced with every stage's policies and what waits."""
        chosen = {i: p for o in optima for i, p in o.policies.items()}
        waits = self.model.waiting(balance, self.waits, self.backward_states, chosen)
        peaks = [self.model.peak(r.start, r.stop, self.in_flight[s], chosen, self.weight_versions, waits[s])
                 for s, r in enumerate(stage_ranges(balance))]
        return [replace(o, peak=p, fits=o.fits and p.total <= c) for o, p, c in zip(optima, peaks, self.capacities)]

    def fits(self, balance: Sequence[int]) -> bool:
        """Whether every stage of ``balance``, placed, fits (a stage :meth:`overfull` does not:
        known before any optimisation; nor does one that does not fit optimised, known before
        the later stages are)."""
        if any(self.overfull(r.start, r.stop, s) for s, r in enumerate(stage_ranges(balance))):
            return False
        if (placed := self._found.placed.get(tuple(balance))) is None:
            optima = []
            for found in self._optimised(balance):
                if not found.fits:
                    return False
                optima.append(found)
            placed = self._place(balance, optima)
        return all(o.fits for o in placed)

    def overfull(self, lo: int, hi: int, s: int) -> bool:
        """Whether stage ``s`` on ``[lo, hi)`` goes over its capacity with what no memory
        optimisation takes off (parameters, their state, the largest workspace): a bound that
        costs no optimisation."""
        return self.model.static(lo, hi, self.weight_versions) + self.model.transient(lo, hi) > self.capacities[s]

    def times(self, balance: Sequence[int]) -> list[StageTime]:
        """Per stage of ``balance``, placed, its times per micro-batch."""
        model, times = self.model, []
        for r, o in zip(stage_ranges(balance), self.placed(balance)):
            forward = model.forward_time(r.start, r.stop)
            backward = model.compute_ms(r.start, r.stop) - forward
            times.append(StageTime(forward, backward, o.recompute_ms, o.swap_ms, model.send_ms(r.start, r.stop)))
        return times

    def step_ms(self, balance: Sequence[int]) -> float:
        """Simulated step time of ``balance``, placed; its slowest stage without an ``order`` (cached)."""
        key = tuple(balance)
        if key not in self._found.steps:
            times = self.times(balance)
            if self.order and self._found.replay is None:
                self._found.replay = Replay(self.order)
            self._found.steps[key] = (
                self._found.replay.run(times).step_ms if self._found.replay
                else max(t.forward + t.backward + t.recompute + t.swap + t.send for t in times)
            )
        return self._found.steps[key]

    def stage_time(self, lo: int, hi: int, s: int) -> float:
        """Per micro-batch time of stage ``s`` on ``[lo, hi)`` after memory optimisation,
        sending its outputs included; infinite when it cannot fit."""
        base = self.model.peak(lo, hi, self.in_flight[s], {}, self.weight_versions)
        compute = self.model.compute_ms(lo, hi) + self.model.send_ms(lo, hi)
        if base.total <= self.capacities[s]:
            return compute
        found = self.optimum(lo, hi, s)
        return compute + found.added_ms if found.fits else math.inf

    def group_time(self, lo: int, hi: int, first: int, stop: int) -> float:
        """Estimated slowest-stage time of stages ``[first, stop)`` sharing ``[lo, hi)``:
        exact for one stage; for several, the group is priced as one stage of their summed
        capacity and mean in-flight count whose work is spread evenly, with the bytes over
        capacity recomputed at the range's mean forward time per saved byte; its last stage
        also sends what leaves the range."""
        k = stop - first
        if k == 1:
            return self.stage_time(lo, hi, first)
        model = self.model
        held = sum(self.in_flight[first:stop]) / k
        demand = model.static(lo, hi, self.weight_versions) + held * model.stashed(lo, hi) + model.transient(lo, hi)
        excess = demand - sum(self.capacities[first:stop])
        compute = model.compute_ms(lo, hi)
        if excess <= 0:
            return compute / k + model.send_ms(lo, hi)
        stashed = model.stashed(lo, hi)
        if excess > held * stashed or not self.optimise_memory:
            return math.inf
        return (compute + model.forward_time(lo, hi) * excess / (held * stashed)) / k + model.send_ms(lo, hi)

    def group_memory(self, lo: int, hi: int, first: int, stop: int) -> float:
        """Memory demand of stages ``[first, stop)`` on ``[lo, hi)`` relative to their capacity."""
        model = self.model
        held = sum(self.in_flight[first:stop]) / (stop - first)
        demand = model.static(lo, hi, self.weight_versions) + held * model.stashed(lo, hi)
        return demand / sum(self.capacities[first:stop])


@dataclass
class _Found:
    """What a :class:`Stages` found, each cached by what it was asked; one object, so that
    stages with a setting changed (:meth:`Stages._varied`) start over from none of it."""

    optima: dict[tuple[object, ...], StageOptimum] = field(default_factory=dict)
    placed: dict[tuple[int, ...], list[StageOptimum]] = field(default_factory=dict)
    prunes: dict[tuple[object, ...], StageOptimum | None] = field(default_factory=dict)  # None: nothing to drop
    steps: dict[tuple[int, ...], float] = field(default_factory=dict)
    descents: dict[tuple[int, int, int], Descent] = field(default_factory=dict)
    replay: Replay | None = None
    floor: list[int] | None = None
    further: Stages | None = None


def partition(
    name: Partitioner,
    profile: Profile,
    capacities: Sequence[int],
    in_flight: Sequence[int],
    *,
    weight_versions: int = 1,
    host_bandwidth: float | None = None,
    link_bandwidth: float | None = None,
) -> list[int]:
    """Balance for ``len(capacities)`` stages by the partitioner ``name``; ``link_bandwidth``
    (bytes/s between stage devices) prices what crosses each cut."""
    if len(in_flight) != len(capacities):
        raise ValueError(f"{len(capacities)} capacities but {len(in_flight)} in-flight counts; give one per stage.")
    model = CostModel(profile, link_bandwidth)
    stages = Stages(model, list(capacities), list(in_flight), weight_versions, host_bandwidth)
    return split(name, stages)


def split(name: Partitioner, stages: Stages) -> list[int]:
    """:func:`partition` on a prepared :class:`Stages`."""
    model, count = stages.model, stages.count
    check_stage_count(model.n, count)
    if name == "dawnpiper":
        return _dawnpiper(stages)
    if name == "capslog":
        def peak(lo: int, hi: int, s: int) -> float:
            return model.peak(lo, hi, stages.in_flight[s], {}, stages.weight_versions).total

        return _min_max(model.n, stages.capacities, peak)
    if name == "time":
        return _min_max(model.n, [1.0] * count, lambda lo, hi, s: model.compute_ms(lo, hi) + model.send_ms(lo, hi))
    if name == "params":
        return balance_by_weight([model.params(i, i + 1) for i in range(model.n)], count)
    if name == "uniform":
        return [model.n // count + (s < model.n % count) for s in range(count)]
    raise ValueError(f"unknown partitioner {name!r}; use one of {', '.join(PARTITIONERS)}.")


def lowest_peak_balance(stages: Stages, start: Sequence[int] | None = None) -> list[int]:
    """The balance whose stages, memory-optimised as far as they go, have the lowest peak
    relative to capacity: the most memory any plan can save (CAPSlog's search on the
    optimised peaks; ``start``: a balance near it, where the search begins)."""
    return _min_max(stages.model.n, stages.capacities, stages.lowest, precision=1e-2, start=start,
                    within=stages.reaches)


Cost = Callable[[int, int, int], float]
Within = Callable[[int, int, int, float], bool]  # whether stage s on [lo, hi) costs at most a limit


def _within(cost: Cost) -> Within:
    return lambda lo, hi, s, limit: cost(lo, hi, s) <= limit


def fill_first(n: int, limits: Sequence[float], within: Within) -> list[int] | None:
    """CAPSlog's fill-first: each stage in turn takes the longest run of nodes whose cost stays
    ``within`` its limit (keeping a node for every later stage); the last takes the rest. Exact
    for costs that grow with the node range. ``None`` when the rest does not fit the last stage."""
    balance, lo, count = [], 0, len(limits)
    for s in range(count - 1):
        if not within(lo, lo + 1, s, limits[s]):
            return None
        a, b = lo + 1, n - (count - 1 - s)  # the longest fitting end lies in [a, b]
        while a < b:
            mid = (a + b + 1) // 2
            if within(lo, mid, s, limits[s]):
                a = mid
            else:
                b = mid - 1
        balance.append(a - lo)
        lo = a
    if not within(lo, n, count - 1, limits[-1]):
        return None
    return balance + [n - lo]


def _fill_last(n: int, limits: Sequence[float], within: Within) -> list[int] | None:
    """:func:`fill_first` from the last stage back: each stage in turn, the last first, takes
    the longest run of nodes ending where the next one begins whose cost stays within its limit."""
    count = len(limits)
    found = fill_first(n, limits[::-1], lambda lo, hi, s, limit: within(n - hi, n - lo, count - 1 - s, limit))
    return found[::-1] if found is not None else None


def reaching(n: int, limits: Sequence[float], within: Within) -> list[int] | None:
    """:func:`fill_first`, or where that finds nothing, :func:`_fill_last`."""
    return fill_first(n, limits, within) or _fill_last(n, limits, within)


def _min_max(
    n: int, scales: Sequence[float], cost: Cost, precision: float = 1e-12, start: Sequence[int] | None = None,
    within: Within | None = None,
) -> list[int]:
    """Balance minimising ``max_s cost(stage s) / scales[s]``: binary search on the threshold,
    fill-first at each, until the threshold is known to ``precision`` (relative). Given a
    balance to ``start`` from, the search brackets the threshold just under that balance's
    (within a twentieth, then a tenth, ...): a search near the answer prices fewer ranges.
    ``within``: whether a stage's cost is at most a limit, where that is cheaper to know than
    the cost (default: the cost compared)."""
    count = len(scales)
    cost_within = within or _within(cost)
    if start is None:
        high = max(cost(0, n, s) / scales[s] for s in range(count)) or 1.0
        while (found := fill_first(n, [high * c for c in scales], cost_within)) is None:
            high *= 2
        low = 0.0
    else:
        found = list(start)
        high = max(cost(r.start, r.stop, s) / scales[s] for s, r in enumerate(stage_ranges(found)))
        step = 0.05
        while (attempt := fill_first(n, [high * (1 - step) * c for c in scales], cost_within)) is not None \
                and step < 0.5:
            high, found, step = high * (1 - step), attempt, 2 * step
        low = high * (1 - step) if attempt is None else 0.0
    while high - low > precision * high:
        mid = (low + high) / 2
        attempt = fill_first(n, [mid * c for c in scales], cost_within)
        if attempt is None:
            low = mid
        else:
            high, found = mid, attempt
    return found


def _crossing(left: Callable[[int], float], right: Callable[[int], float], a: int, b: int) -> int:
    """The cut ``p`` in ``[a, b]`` minimising ``max(left(p), right(p))`` for ``left`` growing
    and ``right`` shrinking with ``p``: binary search for where they cross."""
    lo, hi = a, b
    while lo < hi:
        mid = (lo + hi) // 2
        if left(mid) >= right(mid):
            hi = mid
        else:
            lo = mid + 1
    return min((p for p in (lo - 1, lo) if a <= p <= b), key=lambda p: (max(left(p), right(p)), p))


def fitting_split(name: Partitioner, stages: Stages) -> list[int] | None:
    """A split of ``name``'s that fits, or ``None`` where its plan would not: :func:`split`
    without choosing among fitting splits (dawnpiper's first that fits), which is all a search
    over sizes needs to know, at a fraction of the cost."""
    if name == "dawnpiper":
        return next(_dawnpiper_fitting(stages), None)
    balance = split(name, stages)
    return balance if stages.fits(balance) else None


def _dawnpiper(stages: Stages) -> list[int]:
    """The fastest split that fits (up to timing noise: :func:`_steadiest`) of
    :func:`_dawnpiper_fitting`'s; when none fits, the bisection's split."""
    fitting = list(_dawnpiper_fitting(stages))
    return _steadiest(stages, fitting) if fitting else stages.bisected


def _dawnpiper_fitting(stages: Stages) -> Iterator[list[int]]:
    """Dawnpiper's candidates that fit, each priced only when the one before is taken: the
    bisection's split and every baseline's, so dawnpiper is never worse than another
    partitioner; the bisection also runs without memory optimisation, so optimising never
    loses a split that fits without it. When none fits, unless no split comes near fitting
    (:meth:`Stages.reachable`), a search for any split that fits, then the split with the
    lowest peak (:meth:`Stages.floor`, the split
    :class:`~lightning_pipe.plan.plan.InfeasiblePlanError` reports: so a plan is refused only
    when that split does not fit either)."""
    searches = [stages, stages.kept()] if stages.optimise_memory else [stages]
    candidates = [m.bisected for m in searches] + [split(name, stages) for name in BASELINES]
    found = False
    for balance in dict.fromkeys(map(tuple, candidates)):
        if stages.fits(balance):
            found = True
            yield list(balance)
    if found or stages.reachable is None:  # else no split comes near fitting
        return
    for m in searches:
        if fill := fill_fitting(m):
            yield fill
            return
    if stages.fits(stages.floor()):
        yield stages.floor()


def _steadiest(stages: Stages, fitting: list[list[int]]) -> list[int]:
    """Of the ``fitting`` splits and their neighbours, the one timing noise moves least. Splits
    predicted within :data:`NOISE` of the fastest count as equally fast; each cut of those moves,
    one at a time, to where the fewest bytes cross it (what the devices send each other) while
    the split stays that fast and fits; then the split sending the fewest bytes wins (then the
    one recomputing and swapping the fewest, then the faster, then the earlier cuts). Byte
    counts do not vary between runs."""
    limit = min(map(stages.step_ms, fitting)) * (1 + NOISE)
    settled = [_settled(stages, b, limit) for b in fitting if stages.step_ms(b) <= limit]
    return min(settled, key=lambda b: (sum(stages.model.crossing[c] for c in _cuts(b)), *_cheapest(stages, b)))


def _cheapest(stages: Stages, balance: list[int]) -> tuple[int, float, list[int]]:
    """How splits that send as many bytes rank: fewest bytes recomputed or swapped (a byte
    count, which timing noise does not move), then fastest, then earliest cuts."""
    moved = sum(stages.model.saved[i] for o in stages.placed(balance) for i in o.policies)
    return moved, stages.step_ms(balance), balance


def _settled(stages: Stages, balance: list[int], limit: float) -> list[int]:
    """``balance`` with its cuts moved one at a time, over and over, to where fewer bytes cross:
    to the fewest that keep the split fitting and its step within ``limit``, the cheapest such
    position (:func:`_cheapest`). A cut looks only as far as the compute of its two stages
    stays within :data:`NOISE` of the slowest stage's; each move lowers the bytes crossing, so
    this ends."""
    model, n = stages.model, stages.model.n
    cuts, settling = _cuts(balance), True
    reach = (1 + NOISE) * max(_compute(model, r.start, r.stop) for r in stage_ranges(balance))
    while settling:
        settling = False
        for k, start in enumerate(cuts):
            lo, hi = cuts[k - 1] if k else 0, cuts[k + 1] if k + 1 < len(cuts) else n

            def moved(c: int) -> list[int]:
                return _balance(cuts[:k] + [c] + cuts[k + 1 :], n)  # noqa: B023 (used at once)

            fewer: dict[int, list[int]] = {}  # bytes crossing -> positions within reach
            for step in (-1, 1):
                c = start + step
                while lo < c < hi and max(_compute(model, lo, c), _compute(model, c, hi)) <= reach:
                    if model.crossing[c] < model.crossing[start]:
                        fewer.setdefault(model.crossing[c], []).append(c)
                    c += step
            for level in sorted(fewer):
                taken = [c for c in fewer[level] if stages.fits(moved(c)) and stages.step_ms(moved(c)) <= limit]
                if taken:
                    cuts[k] = min(taken, key=lambda c: _cheapest(stages, moved(c)))
                    settling = True
                    break
    return _balance(cuts, n)


def _compute(model: CostModel, lo: int, hi: int) -> float:
    return model.compute_ms(lo, hi) + model.send_ms(lo, hi)


def _cuts(balance: Sequence[int]) -> list[int]:
    return list(itertools.accumulate(balance))[:-1]


def _balance(cuts: Sequence[int], n: int) -> list[int]:
    return [b - a for a, b in zip([0, *cuts], [*cuts, n])]


def fill_fitting(stages: Stages, slack: int = 8, tries: int = 2) -> list[int] | None:
    """Fill-first on fitting: each stage in turn takes the longest run of nodes that fits it,
    memory-optimised and with the gradients that will wait at it (known once the earlier cuts
    are), leaving a node for every later stage; the last stage takes the rest. What crosses a
    cut (outputs kept for sending, gradients waiting on later stages) is not monotone in it, so
    when the rest does not fit, a stage ends up to ``slack`` nodes later or earlier instead, or
    earlier still at a cut as thin as the thinnest of its longest run (few bytes cross there,
    typically a layer boundary, so a later stage can take over); the search gives up after
    ``tries`` times the stage count such starts. Ends past the longest run come only after it:
    most of them do not fit, and each costs a stage's search. ``None``: nothing found."""
    model, count, n = stages.model, stages.count, stages.model.n
    cuts: list[int] = []
    chosen: dict[int, Policy] = {}  # the placed stages' policies (their nodes' ranges do not overlap)
    failed: set[tuple[int, ...]] = set()  # (stage, its start, the previous stage's start)
    budget = [tries * count]

    def waiting(hi: int, s: int) -> Waiting:
        """What waits at stage ``s`` ending at ``hi``, the nodes after it taken as one stage."""
        known = _balance(cuts + [hi] if hi < n else cuts, n)
        return model.waiting(known, stages.waits, stages.backward_states)[s]

    def placed(lo: int, hi: int, s: int) -> StageOptimum | None:
        """Stage ``s`` on ``[lo, hi)`` optimised after the stages placed so far; ``None``: it does not fit."""
        if stages.overfull(lo, hi, s):
            return None
        found = stages.optimum(lo, hi, s, waiting=waiting(hi, s), chosen=chosen)
        return found if found.fits else None

    def fits(lo: int, hi: int, s: int) -> bool:
        return placed(lo, hi, s) is not None

    def rest_fits(hi: int) -> bool:
        """Whether the last stage fits from ``hi`` on, priced before the stage ending at ``hi``
        chooses: its choices can only add to the last stage's price (what it drops, the last
        stage keeps), and they cost a stage search each."""
        cuts.append(hi)
        try:
            return fits(hi, n, count - 1)
        finally:
            cuts.pop()

    def fill(lo: int, s: int) -> bool:
        if s == count - 1:  # what waits at each stage while it runs its backwards: the whole split's
            return fits(lo, n, s) and stages.fits(_balance(cuts, n))
        state = (s, *cuts[-2:])
        if state in failed or budget[0] == 0:
            return False
        budget[0] -= 1
        last = n - (count - 1 - s)  # every later stage keeps a node
        a, b = lo + 1, last
        while a < b:  # the longest fitting end, were fitting monotone
            mid = (a + b + 1) // 2
            a, b = (mid, b) if fits(lo, mid, s) else (a, mid - 1)
        window = [a, *range(min(a + slack, last), a, -1), *range(a - 1, max(lo, a - slack - 1), -1)]
        thinnest = min((model.crossing[c] for c in range(lo + 1, a + 1)), default=0)
        narrow = [c for c in range(a - slack - 1, lo, -1) if model.crossing[c] <= thinnest]
        for hi in [*window, *narrow]:
            if s == count - 2 and not rest_fits(hi):
                continue
            if found := placed(lo, hi, s):
                cuts.append(hi)
                chosen.update(found.policies)
                if fill(hi, s + 1):
                    return True
                cuts.pop()
                for i in found.policies:
                    del chosen[i]
        failed.add(state)
        return False

    return [b - a for a, b in zip([0] + cuts, cuts + [n])] if fill(0, 0) else None

def bisection(stages: Stages) -> list[int]:
    """DawnPiper's binary partition (module docstring)."""
    cuts: list[int] = []

    def bisect(lo: int, hi: int, first: int, stop: int) -> None:
        if stop - first == 1:
            return
        middle = (first + stop) // 2
        a, b = lo + (middle - first), hi - (stop - middle)  # every stage keeps a node
        model = stages.model

        def compute_left(p: int) -> float:
            return model.compute_ms(lo, p) / (middle - first) + model.send_ms(lo, p)

        def compute_right(p: int) -> float:
            return model.compute_ms(p, hi) / (stop - middle)

        if model.link_bandwidth:  # what crosses the cut is not monotone in it: try every cut
            compute = min(range(a, b + 1), key=lambda p: (max(compute_left(p), compute_right(p)), p))
        else:
            compute = _crossing(compute_left, compute_right, a, b)
        memory = _crossing(
            lambda p: stages.group_memory(lo, p, first, middle),
            lambda p: stages.group_memory(p, hi, middle, stop),
            a,
            b,
        )

        def left(p: int) -> float:
            return stages.group_time(lo, p, first, middle)

        def right(p: int) -> float:
            return stages.group_time(p, hi, middle, stop)

        window = (min(compute, memory), max(compute, memory))
        cut = _crossing(left, right, *window)
        if model.link_bandwidth:  # nor are the stage times then; the compute cut may be better
            cut = min((cut, compute), key=lambda p: max(left(p), right(p)))
        if math.isinf(max(left(cut), right(cut))):
            cut = memory
        bisect(lo, cut, first, middle)
        cuts.append(cut)
        bisect(cut, hi, middle, stop)

    bisect(0, stages.model.n, 0, stages.count)
    return [b - a for a, b in zip([0] + cuts, cuts + [stages.model.n])]
