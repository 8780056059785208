import math

import pytest

from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.schedule import Action, actions
from lightning_pipe.plan.simulate import StageTime, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m,L", [(1, 1), (4, 2), (8, 4), (3, 5)])
def test_equal_stages_take_m_plus_L_minus_1_slots(schedule, m, L):
    f, b = 1.5, 3.0
    sim = simulate([StageTime(f, b)] * L, actions(schedule, m, L))
    assert math.isclose(sim.step_ms, (m + L - 1) * (f + b))
    assert math.isclose(sim.bubble, (L - 1) / (m + L - 1))


def test_transfers_add_two_per_boundary_on_the_critical_path():
    m, L, f, b, c = 4, 3, 1.0, 2.0, 0.25
    sim = simulate([StageTime(f, b, send=c)] * L, actions("gpipe", m, L))
    assert math.isclose(sim.step_ms, (m + L - 1) * (f + b) + 2 * (L - 1) * c)


def test_recompute_and_exposed_swap_lengthen_backward_and_the_slowest_stage_paces():
    m, L = 6, 3
    times = [StageTime(1, 2), StageTime(1, 2, recompute=1, swap=1), StageTime(1, 2)]
    sim = simulate(times, actions("1f1b", m, L))
    # the middle stage runs m forwards of 1 and m backwards of 4 back to back at best
    assert sim.step_ms >= m * 5
    assert sim.step_ms > simulate([StageTime(1, 2)] * L, actions("1f1b", m, L)).step_ms
    assert 0 < sim.bubble < 1


def test_deadlocked_orders_are_rejected():
    bad = [[Action("backward", 0, 0), Action("forward", 0, 0)], [Action("forward", 0, 1), Action("backward", 0, 1)]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate([StageTime(1, 1)] * 2, bad)


def _chain(outputs, forward=1.0):
    """A chain of nodes, each reading the one before, with these output bytes."""
    from lightning_pipe.plan.profile import NodeProfile, Profile

    n = len(outputs)
    nodes = [
        NodeProfile(f"n{i}", forward, 2 * forward, out, 0, 0, 0, 0, 0, users=[i + 1 if i + 1 < n else -1])
        for i, out in enumerate(outputs)
    ]
    return Profile(nodes, "cpu", "torch.float32", 1)


def test_a_slow_link_prices_each_boundary_in_the_simulated_step():
    from lightning_pipe.plan.plan import make_plan

    profile = _chain([1000, 10**6, 1000, 1000])  # the uniform cut sends the 1 MB output of node 1
    plain = make_plan(profile, PlanRequest([10**9] * 2, "uniform", "gpipe", chunks=4))
    linked = make_plan(profile, PlanRequest([10**9] * 2, "uniform", "gpipe", chunks=4, link_bandwidth=1e9))
    assert [s.send_ms for s in linked.stages] == [1.0, 0.0]  # 1 MB at 1 GB/s; the last sends nothing
    assert math.isclose(linked.step_ms - plain.step_ms, 2 * 1.0)  # there, and the gradient back
    assert linked.link_bandwidth == 1e9 and plain.stages[0].send_ms == 0.0


@pytest.mark.parametrize("partitioner", ["dawnpiper", "time"])
def test_the_planner_cuts_where_less_crosses_when_the_link_is_slow(partitioner):
    from lightning_pipe.plan.plan import make_plan

    profile = _chain([10, 10, 10**8, 10, 10, 10])  # the compute-balanced cut sends 100 MB
    assert make_plan(profile, PlanRequest([10**12] * 2, partitioner, "1f1b", chunks=4)).balance == [3, 3]
    plan = make_plan(profile, PlanRequest([10**12] * 2, partitioner, "1f1b", chunks=4, link_bandwidth=1e9))
    assert plan.balance in ([2, 4], [4, 2])
    assert plan.stages[0].send_ms < 1.0
