import math

import pytest

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
