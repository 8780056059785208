import itertools
import math
import random

import pytest

from lightning_pipe.plan.memory import CostModel, stage_ranges
from lightning_pipe.plan.partitioners import bisection, fill_first, partition, split
from lightning_pipe.plan.profile import NodeProfile, Profile
from lightning_pipe.plan.stages import Stages


def letters(i):
    """A node name without digits: the planner pools the times of nodes whose names differ only
    in their numbers (copies of one operation), and these random nodes are not copies."""
    return "n" + "".join("abcdefghij"[int(d)] for d in str(i))


def chain(n, seed, conv_share=0.5):
    """CNN-like chain: "conv" nodes compute long and save little; the others the reverse."""
    rnd = random.Random(seed)
    nodes = []
    for i in range(n):
        conv = rnd.random() < conv_share
        f = rnd.uniform(2, 4) if conv else rnd.uniform(0.2, 0.6)
        saved = rnd.randint(1, 3) * 1000 if conv else rnd.randint(6, 16) * 1000
        params = rnd.randint(1, 5) * 100
        users = [i + 1] if i + 1 < n else [-1]
        nodes.append(NodeProfile(letters(i), f, 2 * f, saved, saved, 100, params, params, 2 * params, users=users))
    return Profile(nodes, "cpu", "f", 1, input_bytes=1000, input_users=[0])


def balances(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [b - a for a, b in zip((0,) + cuts, cuts + (n,))]


def worst(stages, balance, cost):
    return max(cost(r.start, r.stop, s) for s, r in enumerate(stage_ranges(balance)))


def peak_ratio(stages):
    return lambda lo, hi, s: stages.model.peak(lo, hi, stages.in_flight[s]).total / stages.capacities[s]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("capacities", [[1000] * 3, [1000] * 4, [800, 1600, 1200, 1000]])
def test_capslog_reaches_the_brute_force_minimum_peak(seed, capacities):
    profile = chain(11, seed)
    stages = Stages(CostModel(profile), capacities, list(range(len(capacities), 0, -1)))
    ratio = peak_ratio(stages)
    best = min(worst(stages, b, ratio) for b in balances(11, len(capacities)))
    assert worst(stages, split("capslog", stages), ratio) == pytest.approx(best, rel=1e-12)


def searched_at_every_threshold(n, scales, cost):
    """CAPSlog's threshold bisection to 1e-12 with a fill-first search at every threshold: what
    capslog answered before its search skipped thresholds (traces) and ranges (bounds)."""
    def within(lo, hi, s, limit):
        return cost(lo, hi, s) <= limit

    high = max(cost(0, n, s) / scales[s] for s in range(len(scales))) or 1.0
    while (found := fill_first(n, [high * c for c in scales], within)) is None:
        high *= 2
    low = 0.0
    while high - low > 1e-12 * high:
        mid = (low + high) / 2
        attempt = fill_first(n, [mid * c for c in scales], within)
        low, high, found = (mid, high, found) if attempt is None else (low, mid, attempt)
    return found


def residual_chain(n, seed):
    """A chain whose every fourth node's output is also read four nodes on (a residual): what
    crosses a cut, and so a stage's peak, is not monotone in the range."""
    rnd = random.Random(seed)
    nodes = []
    for i in range(n):
        users = [i + 1] + ([i + 5] if i % 4 == 0 and i + 5 < n else []) if i + 1 < n else [-1]
        output, saved, workspace = (rnd.randint(1, k) << 20 for k in (8, 40, 4))
        nodes.append(NodeProfile(letters(i), 1.0, 2.0, output, saved, workspace, 1 << 20, 1 << 20, 2 << 20,
                                 users=users, held_bytes=rnd.randint(0, 4) << 20, held_until=max(users[-1], i)))
    return Profile(nodes, "cpu", "f", 1, input_bytes=1 << 20, input_users=[0])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacities", [[1 << 30] * 4, [3 << 28, 1 << 30, 5 << 28, 1 << 30]])
def test_capslog_answers_as_the_search_at_every_threshold(seed, capacities):
    # fill-first's answers depend on every comparison it makes: skipping a threshold or the
    # pricing of a range must change none of them
    stages = Stages(CostModel(residual_chain(200, seed)), capacities, [4, 3, 2, 1])
    assert split("capslog", stages) == searched_at_every_threshold(200, capacities, stages.kept_peak)


@pytest.mark.parametrize("seed", range(6))
def test_time_partitioner_is_the_optimal_min_max(seed):
    profile = chain(12, seed)
    stages = Stages(CostModel(profile), [1] * 4, [1] * 4)

    def compute(lo, hi, s):
        return stages.model.compute_ms(lo, hi)

    best = min(worst(stages, b, compute) for b in balances(12, 4))
    assert worst(stages, split("time", stages), compute) == pytest.approx(best, rel=1e-12)


def brute_force_time(stages):
    return min(worst(stages, b, stages.stage_time) for b in balances(stages.model.n, stages.count))


def fitting_capacity(profile, flight, slack):
    """A capacity between the lowest and the highest peak of the compute-balanced split."""
    model = CostModel(profile)
    timed = partition("time", profile, [1 << 40] * len(flight), flight)
    peaks = [model.peak(r.start, r.stop, flight[s]).total for s, r in enumerate(stage_ranges(timed))]
    return int(min(peaks) + slack * (max(peaks) - min(peaks)))


@pytest.mark.parametrize("seed", range(8))
def test_bisection_two_stages_reaches_the_brute_force_best_time(seed):
    profile = chain(14, seed)
    flight = [2, 1]
    stages = Stages(CostModel(profile), [fitting_capacity(profile, flight, 0.5)] * 2, flight)
    got = worst(stages, bisection(stages), stages.stage_time)
    assert got == pytest.approx(brute_force_time(stages), rel=1e-12)


def test_bisection_deeper_pipelines_stay_near_the_brute_force_best_time():
    ratios = []
    for seed in range(10):
        for count in (3, 4):
            profile = chain(12, seed)
            flight = list(range(count, 0, -1))
            stages = Stages(CostModel(profile), [fitting_capacity(profile, flight, 0.6)] * count, flight)
            best = brute_force_time(stages)
            got = worst(stages, bisection(stages), stages.stage_time)
            assert math.isfinite(got) or math.isinf(best)
            if math.isfinite(best):
                ratios.append(got / best)
    assert min(ratios) >= 1 - 1e-12
    assert max(ratios) <= 1.05  # explicit bound (observed: 1.014): groups of stages are priced by estimate
    assert sum(r <= 1 + 1e-9 for r in ratios) >= 3 * len(ratios) // 4  # observed: 17 of 20 exact


def test_heterogeneous_capacities_are_respected():
    profile = chain(16, 3)
    flight = [4, 3, 2, 1]
    model = CostModel(profile)
    uniform = [4, 4, 4, 4]
    peaks = [model.peak(r.start, r.stop, flight[s]).total for s, r in enumerate(stage_ranges(uniform))]
    capacities = [int(peaks[0] * 0.8), int(peaks[1] * 1.6), int(peaks[2] * 1.4), int(peaks[3] * 0.9)]
    stages = Stages(model, capacities, flight)
    for name in ("dawnpiper", "capslog"):
        balance = split(name, stages)
        for s, r in enumerate(stage_ranges(balance)):
            found = stages.optimum(r.start, r.stop, s)
            assert found.fits and found.peak.total <= capacities[s], name
        if name == "capslog":  # memory alone: fits without any optimisation
            ranges = stage_ranges(balance)
            assert all(model.peak(r.start, r.stop, flight[s]).total <= capacities[s] for s, r in enumerate(ranges))


def test_params_and_uniform_partitioners():
    profile = chain(10, 1)
    params = [n.param_bytes for n in profile.nodes]
    got = partition("params", profile, [1] * 3, [1] * 3)
    best = min(max(sum(params[r.start : r.stop]) for r in stage_ranges(b)) for b in balances(10, 3))
    assert max(sum(params[r.start : r.stop]) for r in stage_ranges(got)) == best
    assert partition("uniform", profile, [1] * 3, [1] * 3) == [4, 3, 3]
    with pytest.raises(ValueError, match="unknown partitioner"):
        partition("random", profile, [1] * 3, [1] * 3)  # type: ignore[arg-type]
