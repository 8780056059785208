import math
from dataclasses import replace

import pytest

from lightning_pipe.plan.memory import CostModel
from lightning_pipe.plan.optimize import lowest_peak, optimize_stage, policy_time
from lightning_pipe.plan.profile import NodeProfile, Profile
from tests.plan.test_memory import node, random_profile


def stage(specs):
    """specs: (forward ms, saved bytes) per node of a chain; backward is twice the forward.
    Names a, b, ...: nodes named alike but for numbers would be taken as copies sharing a time.
    A last node of no cost follows, so that the chain is not the last stage (which also holds
    the batch and the loss)."""
    nodes = [
        NodeProfile(chr(ord("a") + i), f, 2 * f, s, s, 0, 0, 0, 0, users=[i + 1])
        for i, (f, s) in enumerate(specs)
    ]
    nodes.append(NodeProfile("z", 0.0, 0.0, 0, 0, 0, 0, 0, 0, users=[-1]))
    return CostModel(Profile(nodes, "cpu", "f", 1))


def test_fitting_stage_is_left_alone():
    model = stage([(1, 100), (1, 100)])
    found = optimize_stage(model, 0, 2, 4, capacity=800)
    assert found.fits and found.policies == {} and found.added_ms == 0


def test_hidden_swaps_first_most_free_time_first():
    # 4 nodes of 1 ms forward; node 0's saved bytes have the longest window (9 ms) before their backward
    model = stage([(1, 1000)] * 4)
    # swapping one node frees 2 x 1000 in-flight bytes but brings 1000 back for its backward
    found = optimize_stage(model, 0, 4, 2, capacity=2 * 3000 + 1000, host_bandwidth=1e6)  # 2 ms round trip
    assert found.fits
    assert found.policies == {0: "swap"}
    assert found.swap_ms == 0 and found.recompute_ms == 0


def test_recompute_highest_memory_saved_per_second_without_a_host_link():
    # nodes 1 and 3 free the same bytes; node 3 costs a tenth of the time to recompute
    model = stage([(1, 10), (5, 1000), (1, 10), (0.5, 1000)])
    found = optimize_stage(model, 0, 4, 3, capacity=3 * 2020 - 2000)
    assert found.fits and found.policies == {3: "recompute"}
    assert found.recompute_ms == 0.5 and found.swap_ms == 0


def test_cheaper_of_exposed_swap_and_recompute():
    # node 3 is last: its swap is fully exposed. A fast link beats recomputing 5 ms; a slow one loses.
    model = stage([(1, 10), (1, 10), (1, 10), (5, 1000)])
    need = 3 * 1030 - 1500
    fast = optimize_stage(model, 0, 4, 3, capacity=need, host_bandwidth=1e9)  # 0.002 ms exposed
    # (the tiny nodes' swaps hide behind compute, so they go first either way)
    assert fast.fits and fast.policies[3] == "swap" and fast.recompute_ms == 0
    assert math.isclose(fast.swap_ms, 2e3 * 1000 / 1e9)
    slow = optimize_stage(model, 0, 4, 3, capacity=need, host_bandwidth=1e5)  # 20 ms exposed
    assert slow.fits and slow.policies[3] == "recompute" and slow.recompute_ms == 5 and slow.swap_ms == 0


def test_exposed_swap_time_formula():
    model = stage([(1, 1000), (1, 1000), (1, 1000)])
    # round trip 4 ms each; windows: node 0 -> 6 ms, node 1 -> 3 ms, node 2 -> 0 ms; stage compute 9 ms
    assert policy_time(model, 0, 3, {0: "swap"}, 5e5) == (0.0, 0.0)
    assert policy_time(model, 0, 3, {1: "swap", 2: "swap"}, 5e5) == (0.0, 1.0 + 4.0)
    assert policy_time(model, 0, 3, {0: "swap", 1: "swap", 2: "swap"}, 5e5) == (0.0, max(5.0, 12.0 - 9.0))
    assert policy_time(model, 0, 3, {1: "recompute"}, None) == (1.0, 0.0)


def test_impossible_capacity_reports_the_lowest_peak_found():
    model = stage([(1, 1000)] * 4)
    base = model.peak(0, 4, 4).total
    found = optimize_stage(model, 0, 4, 4, capacity=10)
    assert not found.fits
    assert 10 < found.peak.total < base  # optimisation still lowered it


def test_a_stage_is_optimised_with_what_earlier_stages_drop():
    # the profile of test_a_recomputed_region_keeps_what_an_earlier_stage_drops: stage [2, 4)
    # fits one byte under its kept peak by recomputing node 2, unless stage 0 recomputes node 1
    nodes = [replace(node(0, 0, held=100, until=2, users=[1, 2], out=100), held_by=1),
             replace(node(1, 100, made=10, held=10, until=2, users=[2]), saved_inputs_bytes=100, saved_inputs_from=0),
             node(2, 50, users=[3]), node(3, 20, users=[-1])]
    model = CostModel(Profile(nodes, "cpu", "f", 1), schedule="1f1b", chunks=2)
    capacity = model.peak(2, 4, 2).total - 1
    alone = optimize_stage(model, 2, 4, 2, capacity)
    assert alone.fits and alone.policies == {2: "recompute"}
    after = optimize_stage(model, 2, 4, 2, capacity, earlier={1: "recompute"})
    assert not after.fits
    assert after.peak.total == model.peak(2, 4, 2, {1: "recompute", **after.policies}).total


@pytest.mark.parametrize("seed", range(6))
def test_a_stage_searched_for_its_lowest_peak_ends_where_no_single_drop_lowers_it(seed):
    # the descent tries the runs where the backward peaks first; it stops only once no choice
    # anywhere lowers the peak when dropped
    model = CostModel(random_profile(40, seed), schedule="gpipe", chunks=3)
    found = optimize_stage(model, 0, 40, 3, capacity=0, thorough=True)
    assert found.policies
    for i in found.policies:
        dropped = {j: p for j, p in found.policies.items() if j != i}
        assert model.peak(0, 40, 3, dropped).total >= found.peak.total


@pytest.mark.parametrize("seed", [1, 4, 6, 9, 10, 15])  # the greedy's lowest descends a few steps
def test_a_lowest_peak_descent_stopped_at_limits_goes_on_as_one_run_through(seed):
    # a search asking whether a stage gets under a limit stops the descent there; asked a lower
    # limit later, it must end with the choices and peak of the descent run in one go
    model = CostModel(random_profile(40, seed), schedule="gpipe", chunks=3)
    whole = optimize_stage(model, 0, 40, 3, capacity=0, thorough=True)
    descent = lowest_peak(model, 0, 40, 3)
    start = descent.found.peak.total
    assert start > whole.peak.total  # the greedy's lowest is descended from
    for limit in (start - 1, (start + whole.peak.total) // 2, whole.peak.total, whole.peak.total - 1, 0):
        found = descent.down_to(limit)
        assert found.peak.total <= limit or descent.ended
        assert found.peak.total >= whole.peak.total
    assert descent.found.policies == whole.policies
    assert descent.found.peak == whole.peak


def test_a_lowest_peak_without_memory_optimisation_is_the_stage_kept():
    model = CostModel(random_profile(40, 1), schedule="gpipe", chunks=3)
    descent = lowest_peak(model, 0, 40, 3, optimise=False)
    assert descent.down_to(0).policies == {}
    assert descent.found.peak == model.peak(0, 40, 3, {})


def test_options_priced_at_once_are_priced_as_one_at_a_time():
    # the greedy's fallbacks are priced in one pass; an option choosing no node of the stage
    # (an earlier stage's choices only) is the stage kept
    from lightning_pipe.plan.optimize import PricedStage, lowest_memory_policies

    model = CostModel(random_profile(40, 3), schedule="gpipe", chunks=3)
    stage = PricedStage(model, 10, 30, 3, 10**5, 1, 1e6, (0, ()), {4: "recompute", 7: "swap"})
    options = [{}, {2: "recompute"}, *lowest_memory_policies(model, 10, 30, 1e6)]
    assert [stage.priced(o) for o in options] == stage.priced_all(options)
