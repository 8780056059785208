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
  fits. Of the fitting candidates the fastest by simulated step wins; near-ties (within
  :data:`TIE`) go first against idle stages (:data:`IDLE`), then to fewer bytes crossing the
  cuts, which timing noise does not move (:func:`_steadiest`).
* ``capslog``: CAPSlog's binary search on a memory threshold with fill-first; minimises the
  largest peak relative to the stage's capacity (with equal capacities: the largest peak).
* ``time``: contiguous min-max of forward + backward (+ send) time (torchgpipe's
  balance_by_time; optimal without a link).
* ``params``: min-max of parameter bytes (DeepSpeed's default).
* ``uniform``: equal node counts (the first stages take one more when they do not divide).

Capacities are per stage device and may differ (heterogeneous devices).
"""

import bisect
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from lightning_pipe.plan.balance import balance_by_weight, check_stage_count
from lightning_pipe.plan.memory import CostModel, Waiting, stage_ranges
from lightning_pipe.plan.optimize import StageOptimum
from lightning_pipe.plan.policy import Policy
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.stages import Stages

__all__ = [
    "BASELINES", "IDLE", "PARTITIONERS", "REACH_MARGIN", "TIE", "Partitioner", "bisected", "bisection", "fill_first",
    "fill_fitting", "fitting_split", "floor", "lowest_peak_balance", "partition", "reachable", "reaching", "split",
]

# How far over the capacities :func:`reachable` looks: lowest peaks are not quite monotone in
# the range, so a split fill-first misses at the capacities can still be under them.
REACH_MARGIN = 1.05
# Predicted steps closer than this (relative) count as equal when dawnpiper chooses among the
# splits that fit: re-profiling moves a plan's predicted step by 1-2%, so ties within it are
# settled by what does not vary (idle stages, bytes), while a split faster by more wins.
TIE = 0.02
# A stage taking under this share of the slowest stage's time is idle: its device mostly waits
# while another bounds the step, so a tie-break never trades a split for one idling more.
IDLE = 0.25

Partitioner = Literal["dawnpiper", "capslog", "time", "params", "uniform"]
PARTITIONERS: tuple[Partitioner, ...] = ("dawnpiper", "capslog", "time", "params", "uniform")
BASELINES: tuple[Partitioner, ...] = ("time", "params", "uniform", "capslog")


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
    if name == "capslog":  # most ranges asked are far over or under the limit: told by bounds
        return _min_max(model.n, stages.capacities, stages.kept_peak, bound=stages.least_kept_peak,
                        upper=stages.kept_peak_at_most)
    if name == "time":
        prefix = model.compute_prefix
        growing = not model.link_bandwidth and all(a <= b for a, b in itertools.pairwise(prefix))
        return _min_max(model.n, [1.0] * count, lambda lo, hi, s: model.compute_ms(lo, hi) + model.send_ms(lo, hi),
                        prefix=prefix if growing else None)
    if name == "params":
        return balance_by_weight([model.params(i, i + 1) for i in range(model.n)], count)
    if name == "uniform":
        return [model.n // count + (s < model.n % count) for s in range(count)]
    raise ValueError(f"unknown partitioner {name!r}; use one of {', '.join(PARTITIONERS)}.")


def floor(stages: Stages) -> list[int]:
    """:func:`lowest_peak_balance` of ``stages`` searched further: the split any plan comes
    closest to fitting with (cached: the search and the error that reports it ask)."""
    split = _cached(stages, "floor", lambda: lowest_peak_balance(stages.further(), reachable(stages)))
    assert split is not None, "a lowest-peak split always exists"
    return split


def bisected(stages: Stages) -> list[int]:
    """:func:`bisection` of ``stages`` (cached: dawnpiper's first candidate, and its split when
    none fits)."""
    split = _cached(stages, "bisection", lambda: bisection(stages))
    assert split is not None, "bisection always splits"
    return split


def reachable(stages: Stages) -> list[int] | None:
    """A split whose every stage, searched further, gets within :data:`REACH_MARGIN` of its
    capacity: fill-first on the lowest peaks, one step of :func:`floor`'s search, in a
    fraction of its time, and where that finds none, fill-first from the last stage (lowest
    peaks are not monotone in the range: a stage's stash holds what crosses its first cut,
    so the first stage's greedy ends can leave a rest that fits nowhere, and the last
    stage's not). The peaks searched further are asked for only where the stages' own
    lowest peaks (never lower, and some fifty times cheaper) reach nowhere. ``None``: no
    split comes that close either way, so :func:`floor`'s, found by fill-first too, has a
    stage over its capacity (cached)."""
    limits, n = [REACH_MARGIN * c for c in stages.capacities], stages.model.n

    def search() -> list[int] | None:
        return reaching(n, limits, stages.reaches) or reaching(n, limits, stages.further().reaches)

    return _cached(stages, "reachable", search)


def _cached(stages: Stages, search: str, find: Callable[[], list[int] | None]) -> list[int] | None:
    """``find()``, kept in ``stages``' cache under ``search``."""
    if search not in stages.cache.splits:
        stages.cache.splits[search] = find()
    return stages.cache.splits[search]


def lowest_peak_balance(stages: Stages, start: Sequence[int] | None = None) -> list[int]:
    """The balance whose stages, memory-optimised as far as they go, have the lowest peak
    relative to capacity: the most memory any plan can save (CAPSlog's search on the
    optimised peaks; ``start``: a balance near it, where the search begins)."""
    return _min_max(stages.model.n, stages.capacities, stages.lowest, precision=1e-2, start=start,
                    within=stages.reaches)


Cost = Callable[[int, int, int], float]
Within = Callable[[int, int, int, float], bool]  # whether stage s on [lo, hi) costs at most a limit


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
    within: Within | None = None, bound: Cost | None = None, upper: Cost | None = None,
    prefix: Sequence[float] | None = None,
) -> list[int]:
    """Balance minimising ``max_s cost(stage s) / scales[s]``: binary search on the threshold,
    fill-first at each, until the threshold is known to ``precision`` (relative). Given a
    balance to ``start`` from, the search brackets the threshold just under that balance's
    (within a twentieth, then a tenth, ...): a search near the answer prices fewer ranges.
    ``within``: whether a stage's cost is at most a limit, where that is cheaper to know than
    the cost (then every threshold is searched); else the cost compared, after ``bound`` and
    ``upper`` (a lower and an upper bound of it, cheaper), and a threshold at which the search
    at the last threshold under or over it would compare every range alike gets that search's
    answer unsearched (:class:`_Trace`): most of the bisection's thresholds, so it prices fewer
    ranges. ``prefix``: the cost is ``prefix[hi] - prefix[lo]``, ``prefix`` never falling
    (then each fill-first is a bisection per stage, :func:`_fill_prefix`)."""
    count = len(scales)
    traces: dict[bool, _Trace | None] = {True: None, False: None}  # at high and at low

    def tried(threshold: float) -> list[int] | None:
        """Fill-first at ``threshold``, or the answer of a search that would compare alike."""
        for trace in traces.values():
            if trace is not None and trace.holds(threshold):
                return trace.found
        limits = [threshold * c for c in scales]
        if within is not None:
            return fill_first(n, limits, within)
        trace = _Trace(scales, cost, bound, upper)
        trace.found = fill_first(n, limits, trace.within) if prefix is None else _fill_prefix(prefix, limits, trace)
        traces[trace.found is not None] = trace
        return trace.found

    if start is None:
        high = max(cost(0, n, s) / scales[s] for s in range(count)) or 1.0
        while (found := tried(high)) is None:
            high *= 2
        low = 0.0
    else:
        found = list(start)
        high = max(cost(r.start, r.stop, s) / scales[s] for s, r in enumerate(stage_ranges(found)))
        step = 0.05
        while (attempt := tried(high * (1 - step))) is not None and step < 0.5:
            high, found, step = high * (1 - step), attempt, 2 * step
        low = high * (1 - step) if attempt is None else 0.0
    while high - low > precision * high:
        mid = (low + high) / 2
        attempt = tried(mid)
        if attempt is None:
            low = mid
        else:
            high, found = mid, attempt
    return found


def _fill_prefix(prefix: Sequence[float], limits: Sequence[float], trace: "_Trace") -> list[int] | None:
    """:func:`fill_first` with ``trace.within`` on costs ``prefix[hi] - prefix[lo]`` (``prefix``
    never falling): each stage's longest fitting run found by one bisection of ``prefix``, and
    ``trace`` told the two comparisons that decide what fill-first's own bisection records, as
    costs grow with the run: its longest run's cost (within) and, when it could have been
    longer, the cost of one node more (over). Some forty times fewer calls for the time
    partitioner, which searches some forty thresholds."""
    n, count = len(prefix) - 1, len(limits)
    balance, lo = [], 0
    for s in range(count - 1):
        base, last = prefix[lo], n - (count - 1 - s)  # every later stage keeps a node
        end = bisect.bisect_right(prefix, limits[s], lo + 1, last + 1, key=lambda p: p - base) - 1
        if end == lo:
            trace.within(lo, lo + 1, s, limits[s])
            return None
        trace.within(lo, end, s, limits[s])
        if end < last:
            trace.within(lo, end + 1, s, limits[s])
        balance.append(end - lo)
        lo = end
    if not trace.within(lo, n, count - 1, limits[-1]):
        return None
    return balance + [n - lo]


class _Trace:
    """One fill-first search at a threshold, kept with every comparison it made: per stage
    range asked, its stage and the value that decided it (its cost, or a bound that told
    already: an upper one under the limit, a lower one over it). At another threshold where
    each value compares as before, the search would ask the same ranges and answer alike:
    fill-first is a function of its comparisons. Kept per stage as the largest value within
    its limit and the smallest over it, which decide whether all compare alike."""

    def __init__(self, scales: Sequence[float], cost: Cost, bound: Cost | None, upper: Cost | None) -> None:
        self.scales, self.cost, self.bound, self.upper = scales, cost, bound, upper
        self.within_at_most: dict[int, float] = {}  # per stage, the largest value found within its limit
        self.over_at_least: dict[int, float] = {}  # per stage, the smallest value found over it
        self.found: list[int] | None = None

    def within(self, lo: int, hi: int, s: int, limit: float) -> bool:
        value = self.bound(lo, hi, s) if self.bound else -math.inf
        if value <= limit:
            upper = self.upper(lo, hi, s) if self.upper else math.inf
            value = upper if upper <= limit else max(value, self.cost(lo, hi, s))
        if value <= limit:
            self.within_at_most[s] = max(value, self.within_at_most.get(s, -math.inf))
        else:
            self.over_at_least[s] = min(value, self.over_at_least.get(s, math.inf))
        return value <= limit

    def holds(self, threshold: float) -> bool:
        """Whether fill-first at ``threshold`` compares every range asked as this search did
        (limits computed as :func:`_min_max` computes them, so exactly alike)."""
        return (all(value <= threshold * self.scales[s] for s, value in self.within_at_most.items())
                and all(value > threshold * self.scales[s] for s, value in self.over_at_least.items()))


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
    over sizes needs to know, at a fraction of the cost; ``None`` at once where no split's last
    stage fits (:meth:`~lightning_pipe.plan.memory.CostModel.last_stage_least_peak`)."""
    if stages.model.last_stage_least_peak(stages.in_flight[-1]) > stages.capacities[-1]:
        return None
    if name == "dawnpiper":
        return next(_dawnpiper_fitting(stages), None)
    balance = split(name, stages)
    return balance if stages.fits(balance) else None


def _dawnpiper(stages: Stages) -> list[int]:
    """The fastest split that fits (up to :data:`TIE`: :func:`_steadiest`) of
    :func:`_dawnpiper_fitting`'s; when none fits, the bisection's split. A candidate whose
    step before any recompute or swap (:meth:`~lightning_pipe.plan.stages.Stages.least_step_ms`)
    is over :data:`TIE` slower than a fitting one's is not priced: :func:`_steadiest` would
    leave it out whether it fits or not."""
    fitting: list[list[int]] = []

    def chosen_if_fits(balance: Sequence[int]) -> bool:
        return not fitting or stages.least_step_ms(balance) <= min(map(stages.step_ms, fitting)) * (1 + TIE)

    fitting.extend(_dawnpiper_fitting(stages, chosen_if_fits))
    return _steadiest(stages, fitting) if fitting else bisected(stages)


def _dawnpiper_fitting(stages: Stages, priced: Callable[[Sequence[int]], bool] = lambda _: True
                       ) -> Iterator[list[int]]:
    """Dawnpiper's candidates that fit, each priced only when the one before is taken: the
    bisection's split and every baseline's, so dawnpiper is never worse than another
    partitioner; the bisection also runs without memory optimisation, so optimising never
    loses a split that fits without it. When none fits, unless no split comes near fitting
    (:func:`reachable`), a search for any split that fits, then the split with the
    lowest peak (:func:`floor`, the split
    :class:`~lightning_pipe.plan.plan.InfeasiblePlanError` reports: so a plan is refused only
    when that split does not fit either). ``priced``: whether a candidate is worth pricing
    (one that is not is passed over)."""
    searches = [stages, stages.kept()] if stages.optimise_memory else [stages]
    # each split made only once the ones before are priced: a search over sizes stops at the first that fits
    candidates = itertools.chain((bisected(m) for m in searches), (split(name, stages) for name in BASELINES))
    found, seen = False, set()
    for balance in map(tuple, candidates):
        if balance not in seen and priced(balance) and stages.fits(balance):
            found = True
            yield list(balance)
        seen.add(balance)
    if found or reachable(stages) is None:  # else no split comes near fitting
        return
    for m in searches:
        if fill := fill_fitting(m):
            yield fill
            return
    if stages.fits(floor(stages)):
        yield floor(stages)


def _steadiest(stages: Stages, fitting: list[list[int]]) -> list[int]:
    """Of the ``fitting`` splits and their neighbours, the fastest, with near-ties settled by
    what timing noise does not move. Splits predicted within :data:`TIE` of the fastest count
    as equally fast; each cut of those moves, one at a time, to where the fewest bytes cross it
    (what the devices send each other) while the split stays that fast, fits and idles no more
    stages (:func:`_idle`); then the split idling the fewest stages wins, then the one sending
    the fewest bytes (then the one recomputing and swapping the fewest, then the faster, then
    the earlier cuts). Byte counts do not vary between runs."""
    limit = min(map(stages.step_ms, fitting)) * (1 + TIE)
    settled = [_settled(stages, b, limit) for b in fitting if stages.step_ms(b) <= limit]
    return min(settled, key=lambda b: (_idle(stages, b), _crossing_bytes(stages.model, b), *_cheapest(stages, b)))


def _idle(stages: Stages, balance: Sequence[int]) -> int:
    """How many stages of ``balance``, placed, take under :data:`IDLE` of the slowest one's
    time: their devices wait while another bounds the step."""
    times = [t.forward + t.backward + t.recompute + t.swap + t.send for t in stages.times(balance)]
    return sum(t < IDLE * max(times) for t in times)


def _crossing_bytes(model: CostModel, balance: Sequence[int]) -> int:
    """Bytes crossing the cuts of ``balance``: what its devices send each other."""
    return sum(model.crossing[c] for c in _cuts(balance))


def _cheapest(stages: Stages, balance: list[int]) -> tuple[int, float, list[int]]:
    """How splits that send as many bytes rank: fewest bytes recomputed or swapped (a byte
    count, which timing noise does not move), then fastest, then earliest cuts."""
    moved = sum(stages.model.saved[i] for o in stages.placed(balance) for i in o.policies)
    return moved, stages.step_ms(balance), balance


def _settled(stages: Stages, balance: list[int], limit: float) -> list[int]:
    """``balance`` with its cuts moved one at a time, over and over, to where fewer bytes cross:
    to the fewest that keep the split fitting, its step within ``limit`` and its idle stages
    as few (:func:`_idle`), the cheapest such position (:func:`_cheapest`). A cut looks only as
    far as the compute of its two stages stays within :data:`TIE` of the slowest stage's, and
    a position whose step is over ``limit`` before any recompute or swap
    (:meth:`~lightning_pipe.plan.stages.Stages.least_step_ms`) is priced no further; each move
    lowers the bytes crossing, so this ends."""
    model, n = stages.model, stages.model.n
    cuts, settling, idle = _cuts(balance), True, _idle(stages, balance)
    reach = (1 + TIE) * max(_compute(model, r.start, r.stop) for r in stage_ranges(balance))

    def steady(moved: list[int]) -> bool:
        return (stages.least_step_ms(moved) <= limit and stages.fits(moved) and stages.step_ms(moved) <= limit
                and _idle(stages, moved) <= idle)

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
                taken = [c for c in fewer[level] if steady(moved(c))]
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


def fill_fitting(stages: Stages, slack: int = 8, tries: int = 3) -> list[int] | None:
    """Fill-first on fitting: each stage in turn takes the longest run of nodes that fits it,
    memory-optimised and with the gradients that will wait at it (known once the earlier cuts
    are), leaving a node for every later stage; the last stage takes the rest. What crosses a
    cut (outputs kept for sending, gradients waiting on later stages) is not monotone in it, so
    when the rest does not fit, a stage ends up to ``slack`` nodes later or earlier instead, or
    earlier still at a cut as thin as the thinnest of its longest run (few bytes cross there,
    typically a layer boundary, so a later stage can take over); the search gives up after
    ``tries`` times the stage count such starts (with 2, BERT-large on 8 A100s under 1F1B found
    no split at 158 to 194 micro-batches, where one fits every size up to 208: a largest
    micro-batch search stopped at 156). Ends past the longest run come only after it: most of
    them do not fit, and each costs a stage's search. ``None``: nothing found."""
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

