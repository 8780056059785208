"""Stages: a split priced against its stage devices' capacities.

What every partitioner's search asks: a stage's memory-optimised price on a node range
(:mod:`lightning_pipe.plan.optimize`), whether a whole split fits once what waits at each
stage is known, and its simulated step. Each answer is cached in one :class:`Found`, since
a search asks the same ranges many times (a stage's peak under a whole split's policies, by
only the policies it reads); bounds known from prefix sums alone (a split's step before any
recompute or swap, a stage's peak keeping everything) rule out most candidates before they
are priced. The searches themselves live in :mod:`lightning_pipe.plan.partitioners`.
"""

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from lightning_pipe.plan.memory import CostModel, StagePeak, Waiting, stage_ranges
from lightning_pipe.plan.optimize import Descent, StageOptimum, lowest_peak, optimize_stage, prune_stage
from lightning_pipe.plan.policy import CodedPolicies, Policy
from lightning_pipe.plan.schedule import Action, BackwardState, Pending
from lightning_pipe.plan.simulate import Replay, StageTime

__all__ = ["Found", "Stages"]


@dataclass
class Stages:
    """What a partitioner plans for: a cost model, and per stage its device's capacity (bytes)
    and the micro-batches it holds at once; the schedule's weight copies; the host link; the
    schedule's :func:`~lightning_pipe.plan.schedule.gradient_waits` (none wait when empty) and
    its per-stage :func:`~lightning_pipe.plan.schedule.actions`, which price a whole split by
    its simulated step (without them: by its slowest stage). ``optimise_memory`` false: no
    stage recomputes or swaps. ``backward_states``: what a stage holds and what waits at it
    at each of its backwards (:func:`~lightning_pipe.plan.schedule.backward_states`). ``pending``:
    per stage, its micro-batches between the halves of a split backward
    (:func:`~lightning_pipe.plan.schedule.weights_pending`; none when empty)."""

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
    pending: Sequence[Pending | None] = ()
    cache: "Found" = field(default_factory=lambda: Found(), repr=False)

    @property
    def count(self) -> int:
        return len(self.capacities)

    def held_halves(self, s: int) -> Pending | None:
        """Stage ``s``'s micro-batches between the halves of a split backward (``None``: none splits)."""
        return self.pending[s] if self.pending else None

    def optimum(
        self, lo: int, hi: int, s: int, reserved: int = 0, waiting: Waiting = (0, ()), chosen: Mapping[int, Policy] = {}
    ) -> StageOptimum:
        """Memory optimisation of nodes ``[lo, hi)`` as stage ``s`` with ``reserved`` bytes of
        its capacity taken by something else, ``waiting`` at it and the earlier stages'
        policies ``chosen`` (cached)."""
        earlier = self.earlier(lo, hi, chosen)
        key = (lo, hi, s, reserved, waiting[0], tuple(waiting[1]), tuple(earlier.items()))
        if key not in self.cache.optima:
            found = self.cache.optima[key] = optimize_stage(
                self.model, lo, hi, self.in_flight[s], self.capacities[s] - reserved, self.weight_versions,
                self.host_bandwidth, self.optimise_memory, self.thorough, waiting, earlier, self.held_halves(s),
            )
            if not found.policies:  # its peak is the stage's in any split choosing nothing in it (_peak)
                self.cache.peaks.setdefault(_peak_key(lo, hi, s, waiting, b""), found.peak)
        return self.cache.optima[key]

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
        """These stages with ``changes`` (to how stages are optimised, not to the devices or the
        schedule), and of what was found for these (cached) only what no optimisation changes:
        peaks keeping everything, their bounds, and compute times, which a search for the
        varied stages asks again for the same ranges."""
        cache = self.cache
        return replace(self, **changes, cache=Found(
            compute_times=cache.compute_times, kept_peaks=cache.kept_peaks,
            kept_bounds=cache.kept_bounds,
        ))

    def further(self) -> "Stages":
        """:meth:`searched_further`, made once: the searches for the lowest peaks share its optima."""
        if self.cache.further is None:
            self.cache.further = self.searched_further()
        return self.cache.further


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
        if (lo, hi, s) not in self.cache.descents:
            self.cache.descents[lo, hi, s] = lowest_peak(self.model, lo, hi, self.in_flight[s], self.weight_versions,
                                                    self.host_bandwidth, self.optimise_memory, self.held_halves(s))
        return self.cache.descents[lo, hi, s]

    def placed(self, balance: Sequence[int]) -> list[StageOptimum]:
        """Every stage of ``balance`` optimised under its capacity with what waits at it
        (:meth:`CostModel.waiting`: gradients for earlier stages, and outputs for a stage
        beyond the next), known only for a whole split; what waits depends on the policies
        chosen, so the split is priced again with them, and where that goes over, again
        with every stage pruned (:meth:`pruned`; cached)."""
        if (placed := self.cache.placed.get(tuple(balance))) is None:
            placed = self._place(balance, list(self._optimised(balance)))
        return placed

    def _place(self, balance: Sequence[int], optima: list[StageOptimum]) -> list[StageOptimum]:
        """:meth:`placed` of ``balance`` from its stages' ``optima`` (:meth:`_optimised`), cached."""
        placed = self._priced(balance, optima)
        if all(o.fits for o in optima) and not all(o.fits for o in placed):
            placed = self._pruned(balance, optima)
        self.cache.placed[tuple(balance)] = placed
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
        if key not in self.cache.prunes:
            pruned = prune_stage(self.model, lo, hi, self.in_flight[s], self.capacities[s], found,
                                 self.weight_versions, self.host_bandwidth, waiting, earlier, self.held_halves(s))
            self.cache.prunes[key] = None if pruned is found else pruned  # None: nothing to drop
        return self.cache.prunes[key] or found

    def _priced(self, balance: Sequence[int], optima: Sequence[StageOptimum]) -> list[StageOptimum]:
        """``optima`` with their peaks priced with every stage's policies and what waits."""
        codes = np.zeros(self.model.n, dtype=np.int8)  # every stage's choices
        for o in optima:
            if o.policies:
                nodes, values = o.coded
                codes[nodes] = values
        chosen = CodedPolicies(codes)
        waits = self.model.waiting(balance, self.waits, self.backward_states, chosen)
        peaks = [self._peak(r.start, r.stop, s, chosen, waits[s]) for s, r in enumerate(stage_ranges(balance))]
        # (made directly: dataclasses.replace costs more than pricing a stage from its cache)
        return [StageOptimum(o.policies, o.recompute_ms, o.swap_ms, p, o.fits and p.total <= c)
                for o, p, c in zip(optima, peaks, self.capacities)]

    def _peak(self, lo: int, hi: int, s: int, chosen: CodedPolicies, waiting: Waiting) -> StagePeak:
        """:meth:`CostModel.peak` of stage ``s`` on ``[lo, hi)`` under a whole split's policies
        ``chosen`` (cached by those it reads, :meth:`CostModel.policy_key`: a search moving one
        cut prices the other stages again as they were; a stage choosing nothing, as its
        :meth:`optimum` priced it already)."""
        key = _peak_key(lo, hi, s, waiting, self.model.policy_key(lo, hi, chosen))
        if (peak := self.cache.peaks.get(key)) is None:
            peak = self.cache.peaks[key] = self.model.peak(lo, hi, self.in_flight[s], chosen, self.weight_versions,
                                                           waiting, self.held_halves(s))
        return peak

    def fits(self, balance: Sequence[int]) -> bool:
        """Whether every stage of ``balance``, placed, fits (a stage :meth:`overfull` does not:
        known before any optimisation; nor does one that does not fit optimised, known before
        the later stages are)."""
        if any(self.overfull(r.start, r.stop, s) for s, r in enumerate(stage_ranges(balance))):
            return False
        if (placed := self.cache.placed.get(tuple(balance))) is None:
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
        costs no optimisation (cached: a search moving one cut asks the other stages again)."""
        if (over := self.cache.overfull.get((lo, hi, s))) is None:
            over = self.cache.overfull[lo, hi, s] = (
                self.model.static(lo, hi, self.weight_versions) + self.model.transient(lo, hi) > self.capacities[s])
        return over

    def times(self, balance: Sequence[int]) -> list[StageTime]:
        """Per stage of ``balance``, placed, its times per micro-batch (cached: a search asks
        a split's step and its idle stages)."""
        if (times := self.cache.times.get(tuple(balance))) is None:
            times = [StageTime(t.forward, t.backward, o.recompute_ms, o.swap_ms, t.send)
                     for t, o in zip(self._compute_times(balance), self.placed(balance))]
            self.cache.times[tuple(balance)] = times
        return times

    def _compute_times(self, balance: Sequence[int]) -> list[StageTime]:
        """Per stage of ``balance``, its forward, backward and send milliseconds per micro-batch,
        before any recompute or swap (cached by range: a search moving one cut asks the other
        stages' again)."""
        found, computed, lo = [], self.cache.compute_times, 0
        for count in balance:
            hi = lo + count
            if (times := computed.get((lo, hi))) is None:
                forward = self.model.forward_time(lo, hi)
                times = computed[lo, hi] = StageTime(forward, self.model.compute_ms(lo, hi) - forward,
                                                     send=self.model.send_ms(lo, hi))
            found.append(times)
            lo = hi
        return found

    def step_ms(self, balance: Sequence[int]) -> float:
        """Simulated step time of ``balance``, placed; its slowest stage without an ``order`` (cached)."""
        key = tuple(balance)
        if key not in self.cache.steps:
            self.cache.steps[key] = self._replayed(self.times(balance))
        return self.cache.steps[key]

    def least_step_ms(self, balance: Sequence[int]) -> float:
        """A lower bound of :meth:`step_ms` known before any stage is optimised: the step with
        no recompute or swap (a simulated step never shortens as a stage's time grows; cached)."""
        if (step := self.cache.least_steps.get(key := tuple(balance))) is None:
            step = self.cache.least_steps[key] = self._replayed(self._compute_times(balance))
        return step

    def _replayed(self, times: Sequence[StageTime]) -> float:
        """The simulated step of stages taking ``times``; the slowest stage's time without an ``order``."""
        if self.order and self.cache.replay is None:
            self.cache.replay = Replay(self.order)
        if self.cache.replay:
            return self.cache.replay.run(times).step_ms
        return max(t.forward + t.backward + t.recompute + t.swap + t.send for t in times)

    def kept_peak(self, lo: int, hi: int, s: int) -> int:
        """The peak of stage ``s`` on ``[lo, hi)`` keeping every activation, with nothing
        waiting (capslog's cost; cached: its threshold search prices many ranges again)."""
        if (peak := self.cache.kept_peaks.get((lo, hi, s))) is None:
            peak = self.cache.kept_peaks[lo, hi, s] = self.model.peak(lo, hi, self.in_flight[s], {},
                                                                      self.weight_versions,
                                                                      pending=self.held_halves(s)).total
        return peak

    def kept_peak_at_most(self, lo: int, hi: int, s: int) -> int:
        """An upper bound of :meth:`kept_peak` (:meth:`CostModel.kept_peak_at_most`), exact
        where that is priced already (cached: a threshold search asks a range again at each
        threshold)."""
        if (peak := self.cache.kept_peaks.get((lo, hi, s))) is not None:
            return peak
        if (bound := self.cache.kept_bounds.get((lo, hi, s))) is None:
            bound = self.cache.kept_bounds[lo, hi, s] = self.model.kept_peak_at_most(lo, hi, self.in_flight[s],
                                                                                    self.weight_versions,
                                                                                    self.held_halves(s))
        return bound

    def least_kept_peak(self, lo: int, hi: int, s: int) -> int:
        """A lower bound of :meth:`kept_peak` from prefix sums: the stage's static bytes and,
        before the last stage, the forward of its last micro-batch in flight, which ends
        holding every micro-batch's stash (:meth:`CostModel.peak`). A fill-first search asks
        mostly for ranges far over its limit, each some 500 times cheaper to rule out so than
        to price."""
        model = self.model
        static = model.static(lo, hi, self.weight_versions)
        if hi == model.n or model.carry:
            return static
        stashed = model.stashed(lo, hi)
        return static + round((self.in_flight[s] - 1) * stashed) + stashed

    def stage_time(self, lo: int, hi: int, s: int) -> float:
        """Per micro-batch time of stage ``s`` on ``[lo, hi)`` after memory optimisation,
        sending its outputs included; infinite when it cannot fit."""
        compute = self.model.compute_ms(lo, hi) + self.model.send_ms(lo, hi)
        capacity = self.capacities[s]
        if self.kept_peak_at_most(lo, hi, s) <= capacity or self.kept_peak(lo, hi, s) <= capacity:
            return compute  # it fits keeping everything (most often told by the bound)
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


def _peak_key(lo: int, hi: int, s: int, waiting: Waiting, policies: bytes) -> tuple[object, ...]:
    """What :meth:`Stages._peak` caches a stage's peak by: its range, what waits at it and the
    codes of the policies its peak reads (:meth:`CostModel.policy_key`; none where it chooses
    nothing)."""
    return lo, hi, s, waiting[0], tuple(waiting[1]), policies


@dataclass
class Found:
    """What a :class:`Stages` found, each cached by what it was asked; one object, so that
    stages with a setting changed (:meth:`Stages._varied`) start over from what it changes."""

    optima: dict[tuple[object, ...], StageOptimum] = field(default_factory=dict)
    placed: dict[tuple[int, ...], list[StageOptimum]] = field(default_factory=dict)
    prunes: dict[tuple[object, ...], StageOptimum | None] = field(default_factory=dict)  # None: nothing to drop
    steps: dict[tuple[int, ...], float] = field(default_factory=dict)
    times: dict[tuple[int, ...], list[StageTime]] = field(default_factory=dict)  # Stages.times
    compute_times: dict[tuple[int, int], StageTime] = field(default_factory=dict)  # Stages._compute_times
    least_steps: dict[tuple[int, ...], float] = field(default_factory=dict)  # Stages.least_step_ms
    overfull: dict[tuple[int, int, int], bool] = field(default_factory=dict)  # Stages.overfull
    # a stage's peak under a whole split's policies, by the policies it reads (Stages._peak)
    peaks: dict[tuple[object, ...], StagePeak] = field(default_factory=dict)
    kept_peaks: dict[tuple[int, int, int], int] = field(default_factory=dict)  # Stages.kept_peak
    kept_bounds: dict[tuple[int, int, int], int] = field(default_factory=dict)  # Stages.kept_peak_at_most
    descents: dict[tuple[int, int, int], Descent] = field(default_factory=dict)
    replay: Replay | None = None
    further: Stages | None = None
    # the splits the partitioners' searches found over these stages, by search (None: no split)
    splits: dict[str, list[int] | None] = field(default_factory=dict)

