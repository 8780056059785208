import random
from dataclasses import replace

import pytest

from lightning_pipe.plan.memory import stage_ranges
from lightning_pipe.plan.plan import InfeasiblePlanError, Plan, fitting_plan, largest_plan, make_plan, max_microbatch
from lightning_pipe.plan.profile import NodeProfile, Profile
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.schedule import actions
from lightning_pipe.plan.simulate import StageTime, simulate


def cnn_like(n=36, seed=0):
    """Conv nodes (every third): long compute, little memory; the others the reverse; earlier
    nodes hold more (higher resolution)."""
    rnd = random.Random(seed)
    nodes = []
    for i in range(n):
        conv = i % 3 == 0
        scale = 2 - i / n
        f = rnd.uniform(0.8, 1.2) * (2 if conv else 0.1)
        saved = int(rnd.uniform(0.8, 1.2) * scale * (250 if conv else 2000))
        params = 2000 if conv else 0
        users = [i + 1] if i + 1 < n else [-1]
        nodes.append(NodeProfile(f"n{i}", f, 2 * f, saved, saved, 100, params, params, 2 * params, users=users))
    return Profile(nodes, "cpu", "f", 1, input_bytes=1000, input_users=[0])


CAP = 120_000
#: What most tests here ask: four stages of CAP bytes, dawnpiper, 1F1B, 8 micro-batches.
REQUEST = PlanRequest([CAP] * 4, "dawnpiper", "1f1b", 8)


def test_plan_round_trips_through_json_and_matches_its_parts():
    plan = make_plan(cnn_like().scaled(4), replace(REQUEST, host_bandwidth=1e6))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert sum(plan.balance) == 36 and len(plan.policies) == 36
    assert all(s.peak.total <= c for s, c in zip(plan.stages, plan.targets))
    times = [StageTime(s.forward_ms, s.backward_ms, s.recompute_ms, s.swap_ms) for s in plan.stages]
    sim = simulate(times, actions("1f1b", 8, 4))
    assert (plan.step_ms, plan.bubble) == (sim.step_ms, sim.bubble)
    for s, r in zip(plan.stages, stage_ranges(plan.balance)):
        assert (s.start, s.stop) == (r.start, r.stop)
        chosen = [plan.policies[i] for i in r]
        assert (s.recomputed_bytes > 0) == ("recompute" in chosen)
        assert (s.swapped_bytes > 0) == ("swap" in chosen)


def test_table_has_a_line_per_stage():
    plan = make_plan(cnn_like(), PlanRequest([CAP] * 3, "capslog", "gpipe", 3))
    lines = plan.table().splitlines()
    assert lines[0].split()[:3] == ["stage", "nodes", "params"]
    for s, r in enumerate(stage_ranges(plan.balance)):
        assert lines[1 + s].split()[:2] == [str(s), f"{r.start}-{r.stop - 1}"]
    assert "capslog, gpipe" in lines[-1]


def test_infeasible_capacity_names_the_smallest_reachable_peak():
    with pytest.raises(InfeasiblePlanError) as err:
        make_plan(cnn_like(), replace(REQUEST, capacities=[5_000] * 4))
    e = err.value
    assert isinstance(e, ValueError)
    assert e.min_peak > 5_000 and str(e.min_peak) in str(e)
    assert "micro-batch size" in str(e)


@pytest.mark.slow
def test_a_bad_balance_is_told_apart_from_no_plan_at_all():
    profile = cnn_like().scaled(max_microbatch(cnn_like(), REQUEST))
    with pytest.raises(InfeasiblePlanError, match="Other balances fit") as err:
        make_plan(profile, replace(REQUEST, partitioner="time"))
    assert str(err.value.min_peak) in str(err.value)
    offered = make_plan(profile, REQUEST).balance  # dawnpiper fits
    assert "use partitioner 'dawnpiper'" in str(err.value) and f"balance={offered}" in str(err.value)


@pytest.mark.slow
def test_when_dawnpiper_fails_no_plan_fits_and_no_partitioner_is_recommended():
    profile = cnn_like().scaled(max_microbatch(cnn_like(), REQUEST) + 1)
    for name in ("dawnpiper", "capslog", "time"):
        with pytest.raises(InfeasiblePlanError, match="no plan fits") as err:
            make_plan(profile, replace(REQUEST, partitioner=name))
        assert "use partitioner" not in str(err.value)


@pytest.mark.slow
def test_the_largest_microbatch_searched_from_a_size_that_fits_is_the_same():
    largest = max_microbatch(cnn_like(), REQUEST)
    for start in (1, 2, largest // 3, largest):
        assert max_microbatch(cnn_like(), REQUEST, at_least=start) == largest
    with pytest.raises(ValueError, match="at_least=0 is not a micro-batch size"):
        max_microbatch(cnn_like(), REQUEST, at_least=0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "2bw"])
def test_the_largest_plan_is_the_plan_made_afresh_at_the_largest_microbatch(schedule):
    # largest_plan chooses among splits on the stages its search's last fitting probe priced
    for name in ("dawnpiper", "capslog", "time"):
        for start in (1, 3):
            request = PlanRequest([CAP] * 4, name, schedule, 4, 1e6)
            plan = largest_plan(cnn_like(), request, at_least=start)
            size = max_microbatch(cnn_like(), request)
            afresh = fitting_plan(cnn_like().scaled(size), request)
            assert plan.microbatch_size == size and plan == afresh, (name, start)
    with pytest.raises(InfeasiblePlanError, match="no plan fits"):
        largest_plan(cnn_like(), PlanRequest([5_000] * 4, "dawnpiper", schedule, 4))


@pytest.mark.slow
def test_without_memory_optimisation_nothing_is_recomputed_and_less_fits():
    on = max_microbatch(cnn_like(), REQUEST)
    kept = replace(REQUEST, optimise_memory=False)
    off = max_microbatch(cnn_like(), kept)
    assert off < on
    plan = make_plan(cnn_like().scaled(off), kept)
    assert set(plan.policies) == {"keep"}
    with pytest.raises(InfeasiblePlanError, match="optimise_memory=True"):
        make_plan(cnn_like().scaled(off + 1), kept)


@pytest.mark.slow
def test_2bw_keeps_a_second_weight_copy_and_fits_no_more_than_1f1b():
    a = max_microbatch(cnn_like(), REQUEST)
    b = max_microbatch(cnn_like(), replace(REQUEST, schedule="2bw"))
    assert b <= a
    lowest = []
    for schedule in ("1f1b", "2bw"):
        with pytest.raises(InfeasiblePlanError) as err:
            make_plan(cnn_like().scaled(a + 1), replace(REQUEST, schedule=schedule))
        lowest.append(err.value.min_peak)
    assert lowest[1] > lowest[0]


@pytest.mark.slow
@pytest.mark.parametrize("count", [4, 6])
def test_cnn_like_dawnpiper_fits_larger_microbatches_than_time_balance(count):
    profile = cnn_like()
    request = PlanRequest([CAP] * count, "dawnpiper", "1f1b", 2 * count)
    ours = max_microbatch(profile, request)
    theirs = max_microbatch(profile, replace(request, partitioner="time"))
    assert ours >= theirs
    make_plan(profile.scaled(ours), request)
    with pytest.raises(InfeasiblePlanError):
        make_plan(profile.scaled(ours + 1), request)
