import math
from dataclasses import replace

import pytest

from lightning_pipe.plan.headroom import ROUNDS, checked, checked_largest_plan, flat
from lightning_pipe.plan.plan import PLANNING_HEADROOM, PREDICTION_ERROR, InfeasiblePlanError, make_plan, max_microbatch
from lightning_pipe.plan.request import PlanRequest
from tests.plan.test_plan import CAP, cnn_like

STAGES = 3


def _planner(profile):
    """``plan_for`` over ``profile``, recording the targets asked for."""
    asked = []

    def plan_for(targets):
        asked.append(targets)
        return make_plan(profile, PlanRequest(targets, "dawnpiper", "1f1b", 4))

    return plan_for, asked


def _under(error):
    """A check that finds every stage ``error`` over its prediction."""
    return lambda plan: [math.ceil(s.peak.total * (1 + error)) for s in plan.stages]


def _tight(profile):
    """Limits the plan for unbounded memory is predicted to fill to 98%."""
    unbounded = make_plan(profile, PlanRequest([1 << 40] * STAGES, "dawnpiper", "1f1b", 4))
    return [int(max(s.peak.total for s in unbounded.stages) / 0.98)] * STAGES


def test_a_plan_far_below_the_limits_is_not_checked():
    profile = cnn_like()
    plan_for, asked = _planner(profile)

    def never(plan):
        raise AssertionError("checked")

    plan = checked(plan_for, [10 * CAP] * STAGES, never)
    assert asked == [[10 * CAP] * STAGES] and plan.targets == [10 * CAP] * STAGES


def test_always_checks_a_plan_within_the_flat_headroom_and_plans_again_where_it_goes_over():
    profile = cnn_like()
    unbounded = make_plan(profile, PlanRequest([1 << 40] * STAGES, "dawnpiper", "1f1b", 4))
    limits = [int(max(s.peak.total for s in unbounded.stages) / 0.85)] * STAGES  # predicted within the headroom
    plan_for, asked = _planner(profile)
    checks = []

    def over_once(plan):  # the first plan's check finds it 20% over its prediction, over the limits
        checks.append(plan)
        return [math.ceil(s.peak.total * (1.2 if len(checks) == 1 else 1)) for s in plan.stages]

    assert checked(plan_for, limits, over_once) is not None and not checks  # the headroom trusted
    plan = checked(plan_for, limits, over_once, always=True)
    assert len(checks) == 2 and plan is checks[-1]
    over = [math.ceil(s.peak.total * 1.2) > limit for s, limit in zip(checks[0].stages, limits)]
    assert any(over)  # those stages planned below their limits, the others at them
    assert all((t < limit) if o else (t == limit) for t, limit, o in zip(asked[-1], limits, over))


def test_a_plan_within_its_error_is_kept_at_the_limits():
    limits = _tight(cnn_like())
    plan_for, asked = _planner(cnn_like())
    plan = checked(plan_for, limits, _under(0.01))  # 1% under: the 98% plan still fits
    assert asked == [limits] and plan.targets == limits


def test_a_plan_that_goes_over_is_planned_again_below_the_limits_by_the_error_seen():
    limits = _tight(cnn_like())
    plan_for, asked = _planner(cnn_like())
    first = make_plan(cnn_like(), PlanRequest(limits, "dawnpiper", "1f1b", 4))
    over = [math.ceil(s.peak.total * 1.05) > limit for s, limit in zip(first.stages, limits)]
    plan = checked(plan_for, limits, _under(0.05))
    assert len(asked) == 2 and asked[0] == limits and any(over)
    # each stage that went over planned below its limit by its own error, the others at their limits
    assert all((t <= limit / 1.05) if o else (t == limit) for t, limit, o in zip(asked[1], limits, over))
    assert all(t > limit * PLANNING_HEADROOM for t, limit in zip(asked[1], limits))  # less room than the flat 10%
    assert all(math.ceil(s.peak.total * 1.05) <= limit for s, limit in zip(plan.stages, limits))


def test_where_nothing_fits_that_far_below_half_the_error_is_tried():
    profile = cnn_like()
    limits = _tight(profile)
    plan_for, asked = _planner(profile)

    def refusing(targets):
        if min(targets) < min(limits) / 1.5:
            asked.append(targets)
            raise InfeasiblePlanError("nothing that low", 0, 0)
        return plan_for(targets)

    # the first plan goes 90% over; a plan 90% below the limits does not exist
    plan = checked(refusing, limits, lambda p: _under(0.9 if p.targets == limits else 0.0)(p))
    assert asked[0] == limits and min(asked[1]) < min(limits) / 1.5  # planned 90% below: refused
    assert asked[2] == [int(limit / (1 + (0.9 + 1e-4) / 2)) for limit in limits]  # then half as far
    assert plan.targets == asked[2]


def test_plans_that_keep_going_over_end_in_a_clear_error():
    limits = _tight(cnn_like())
    plan_for, _ = _planner(cnn_like())
    checks = []

    def always_over(plan):
        checks.append(plan)
        return [limit + 1 for limit in limits]

    with pytest.raises(InfeasiblePlanError, match=r"no plan fits the memory limits .* when run") as error:
        checked(plan_for, limits, always_over)
    assert len(checks) == ROUNDS and error.value.min_peak == limits[0] + 1
    # never the same plan checked twice
    assert len({(tuple(p.balance), tuple(p.policies)) for p in checks}) == ROUNDS


def test_flat_assumes_the_worst_measured_error():
    plan = make_plan(cnn_like(), PlanRequest([CAP] * STAGES, "dawnpiper", "1f1b", 4))
    assert flat(plan) == [math.ceil(s.peak.total * (1 + PREDICTION_ERROR)) for s in plan.stages]
    # as a check, it plans to the flat headroom: what the strategy falls back to
    limits = _tight(cnn_like())
    plan_for, _ = _planner(cnn_like())
    fallback = checked(plan_for, limits, flat)
    assert all(s.peak.total <= limit * PLANNING_HEADROOM for s, limit in zip(fallback.stages, limits))


@pytest.mark.slow
def test_the_largest_microbatch_is_the_largest_whose_checked_plan_fits():
    profile = cnn_like()
    limits = [CAP] * STAGES
    request = PlanRequest(limits, "dawnpiper", "1f1b", 4)
    exact = checked_largest_plan(profile, request, _under(0.0)).microbatch_size
    assert exact == max_microbatch(profile, request)  # predicted exactly: to the limit
    under = checked_largest_plan(profile, request, _under(0.2)).microbatch_size
    assert under == max_microbatch(profile, replace(request, capacities=[int(c / 1.2001) for c in limits])) < exact
