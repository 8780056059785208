"""A plan request: checked once, naming what is wrong and how to fix it, and planned from as
the values it holds, however it was made."""

from dataclasses import FrozenInstanceError, replace

import pytest

import lightning_pipe
from lightning_pipe.plan.plan import fitting_plan, largest_plan, make_plan, max_microbatch, plan_fits, planning_stages
from lightning_pipe.plan.request import PlanRequest
from tests.plan.test_plan import CAP, cnn_like


@pytest.mark.parametrize(("changes", "problem", "fix"), [
    ({"capacities": []}, "capacities is empty", "give one planning target (bytes) per stage"),
    ({"capacities": [CAP, 0]}, "has a planning target of 0 bytes", "every stage's target must be positive"),
    ({"capacities": [CAP, -5]}, "has a planning target of -5 bytes", "every stage's target must be positive"),
    ({"chunks": 0}, "chunks must be >= 1, got 0", "give the number of micro-batches per batch"),
    ({"replicas": 0}, "replicas must be >= 1, got 0", "give the number of data-parallel copies"),
    ({"partitioner": "fastest"}, "got 'fastest'",
     "partitioner must be one of 'dawnpiper', 'capslog', 'time', 'params', 'uniform'"),
    ({"schedule": "pipedream"}, "got 'pipedream'", "schedule must be one of 'gpipe', '1f1b', '2bw'"),
    ({"host_bandwidth": 0.0}, "host_bandwidth must be positive (bytes per second), got 0.0",
     "give None to plan without swapping"),
    ({"link_bandwidth": -1e9}, "link_bandwidth must be positive (bytes per second), got -1000000000.0",
     "give None to leave sends between stages unpriced"),
])
def test_a_bad_setting_is_refused_naming_the_problem_and_the_fix(changes, problem, fix):
    with pytest.raises(ValueError) as made:
        PlanRequest(**{"capacities": [CAP] * 2, **changes})
    assert problem in str(made.value) and fix in str(made.value)
    with pytest.raises(ValueError) as replaced:  # a request made from another is checked too
        replace(PlanRequest([CAP] * 2), **changes)
    assert str(replaced.value) == str(made.value)


def test_the_defaults_and_the_edges_of_each_range_are_accepted():
    request = PlanRequest([1])
    assert (request.partitioner, request.schedule, request.chunks, request.host_bandwidth, request.link_bandwidth,
            request.optimise_memory, request.carry, request.replicas) == ("dawnpiper", "1f1b", 1, None, None, True,
                                                                          False, 1)
    PlanRequest([1, 1], chunks=1, replicas=1, host_bandwidth=1e-9, link_bandwidth=1e-9)


def test_capacities_are_stored_as_a_tuple_and_a_request_cannot_change():
    targets = [CAP, CAP]
    request = PlanRequest(targets, "time")
    targets.append(1)  # the caller's list is not the request's
    assert request.capacities == (CAP, CAP)
    assert request == PlanRequest((CAP, CAP), "time") and hash(request) == hash(PlanRequest((CAP, CAP), "time"))
    assert replace(request, capacities=[CAP]).capacities == (CAP,)
    with pytest.raises(FrozenInstanceError):
        request.chunks = 2


def test_the_package_exports_the_request():
    assert lightning_pipe.PlanRequest is PlanRequest and "PlanRequest" in lightning_pipe.__all__


def test_a_request_plans_as_the_values_it_holds_however_it_was_made():
    profile = cnn_like().scaled(4)
    request = PlanRequest([CAP] * 4, "dawnpiper", "1f1b", 8, host_bandwidth=1e6, link_bandwidth=1e9)
    other = PlanRequest([CAP // 2] * 3, "time", "gpipe", 2, optimise_memory=False)
    again = replace(other, capacities=[CAP] * 4, partitioner="dawnpiper", schedule="1f1b", chunks=8,
                    host_bandwidth=1e6, link_bandwidth=1e9, optimise_memory=True)
    assert again == request
    plan = make_plan(profile, request)
    assert make_plan(profile, again) == plan
    assert fitting_plan(profile, again) == plan and plan_fits(profile, again)
    # the plan is the request's: its targets and settings, not another request's
    assert (plan.targets, plan.partitioner, plan.schedule, plan.chunks, plan.host_bandwidth, plan.link_bandwidth) == (
        [CAP] * 4, "dawnpiper", "1f1b", 8, 1e6, 1e9)
    assert make_plan(profile, replace(request, chunks=4)).chunks == 4


@pytest.mark.slow
def test_the_largest_microbatch_searches_with_every_setting_of_the_request():
    profile = cnn_like()
    request = PlanRequest([CAP] * 4, "dawnpiper", "1f1b", 8)
    size = max_microbatch(profile, request)
    assert largest_plan(profile, request).microbatch_size == size
    assert max_microbatch(profile, replace(request, optimise_memory=False)) < size
    assert max_microbatch(profile, replace(request, capacities=[CAP // 2] * 4)) < size


def test_carry_and_replicas_reach_the_stages_the_partitioner_prices():
    profile = cnn_like()
    local = planning_stages(profile, PlanRequest([CAP] * 2, schedule="gpipe", chunks=4))
    distributed = planning_stages(profile, PlanRequest([CAP] * 2, schedule="gpipe", chunks=4, carry=True, replicas=3))
    assert (local.model.carry, local.model.replicas) == (0, 1) and local.backward_states
    assert (distributed.model.carry, distributed.model.replicas) == (4, 3) and not distributed.backward_states
