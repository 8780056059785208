"""The configuration search: every layout of a global batch over a cluster, planned and ranked
by simulated samples per second, on the example GPT's profile (``corpus/gpt.json.gz``: six
blocks at test scale, fake-profiled with A100-40GB times)."""

import pytest

from lightning_pipe.plan.plan import PLANNING_HEADROOM, make_plan
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.search import (
    BOUND_ROUNDING,
    Cluster,
    allreduce_ms,
    bound,
    candidates,
    search,
)
from tests.plan.corpus.replay import profile

GPUS, BATCH, LIMIT = 4, 8, 64 << 20
FAST, SLOW = 300e9, 1e6  # bytes/s: NVLink, and a link on which the all-reduce dominates


@pytest.fixture(scope="module")
def gpt():
    return profile("gpt")


@pytest.fixture(scope="module")
def searched(gpt):
    """Every candidate planned, on a fast and on a slow link."""
    return {bw: search(gpt, Cluster(GPUS, LIMIT, bw), BATCH, top=None) for bw in (FAST, SLOW)}


def test_candidates_lay_the_global_batch_over_every_gpu():
    found = candidates(GPUS, BATCH, max_depth=100)
    layouts = {(c.depth, c.width, c.chunks, c.microbatch_size) for c in found}
    # depth 1: replicas of 2 samples; 2: of 4; 4: one pipeline of 8; chunks divide it, at most 4 per stage
    assert layouts == {(1, 4, 1, 2), (1, 4, 2, 1), (2, 2, 1, 4), (2, 2, 2, 2), (2, 2, 4, 1),
                       (4, 1, 1, 8), (4, 1, 2, 4), (4, 1, 4, 2), (4, 1, 8, 1)}
    # GPipe at every one; 1F1B where each stage has a micro-batch (torch refuses fewer)
    assert {(c.depth, c.width, c.chunks, c.microbatch_size) for c in found if c.schedule == "gpipe"} == layouts
    assert {(c.depth, c.chunks) for c in found if c.schedule == "1f1b"} == {
        (1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (4, 8)}
    assert all(c.depth * c.width == GPUS and c.batch == BATCH for c in found)
    # no deeper than the graph has nodes; a prime count: one stage or all; a fixed chunks
    assert {c.depth for c in candidates(GPUS, BATCH, max_depth=2)} == {1, 2}
    assert {(c.depth, c.width) for c in candidates(5, 10, max_depth=100)} == {(1, 5), (5, 1)}
    assert {(c.depth, c.chunks) for c in candidates(GPUS, BATCH, 100, ("1f1b",), chunks=4)} == {(2, 4), (4, 4)}


@pytest.mark.parametrize("args, message", [
    ((8, 7, 4), "a global batch of 7 splits evenly over no data-parallel width: 8 GPUs with a pipeline depth of "
                "at most 4 (the graph's nodes) make widths 2, 4, 8; give a global batch divisible by one of them, "
                "e.g. 8."),
    ((4, 8, 100, ("gpipe",), 3), "chunks=3 divides no replica's batch (8, 4, 2 samples for widths 1, 2, 4)"),
    ((4, 8, 100, ("2bw",)), "schedule '2bw' cannot be searched: it runs only with runtime='local'"),
    ((4, 0, 100), "the global batch is 0 samples"),
])
def test_no_candidate_says_why(args, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        candidates(*args)


def test_a_cluster_without_gpus_is_refused():
    with pytest.raises(ValueError, match="the cluster has 0 GPUs"):
        Cluster(0, LIMIT)


def test_configurations_fit_and_rank_by_simulated_samples_per_second(gpt, searched):
    found = searched[FAST]
    assert found.planned == len(candidates(GPUS, BATCH, len(gpt.nodes))) and found.skipped == 0
    assert len(found.configurations) == found.planned - found.infeasible > 10
    rates = [f.samples_per_second for f in found.configurations]
    assert rates == sorted(rates, reverse=True)
    for f in found.configurations:
        c = f.candidate
        assert c.depth * c.width == GPUS and c.width * c.chunks * c.microbatch_size == BATCH
        assert f.samples_per_second == pytest.approx(1e3 * BATCH / (f.plan.step_ms + f.allreduce_ms))
        assert max(f.peaks) <= LIMIT * PLANNING_HEADROOM
        assert f.samples_per_second <= bound(gpt, Cluster(GPUS, LIMIT, FAST), c) * (1 + BOUND_ROUNDING)
    # the best is the plan the planner makes for it, as distributed training plans it
    best = found.configurations[0]
    c = best.candidate
    again = make_plan(gpt.scaled(c.microbatch_size), PlanRequest(
        [int(LIMIT * PLANNING_HEADROOM)] * c.depth, "dawnpiper", c.schedule, c.chunks, None, FAST, carry=True,
        replicas=c.width))
    assert (again.balance, [s.peak.total for s in again.stages]) == (best.plan.balance, best.peaks)


def test_the_allreduce_is_a_ring_over_the_stage_with_most_parameters(searched):
    plan = next(f.plan for f in searched[FAST].configurations if f.candidate.depth == 2)
    most = max(s.param_bytes for s in plan.stages)
    assert allreduce_ms(plan, 4, 1e9) == pytest.approx(1e3 * 2 * 3 / 4 * most / 1e9)
    assert allreduce_ms(plan, 1, 1e9) == 0.0 and allreduce_ms(plan, 4, None) == 0.0


def test_a_slow_link_makes_one_deep_pipeline_win(searched):
    """On a fast link replicas win (no bubble); on a slow one their all-reduce costs more than
    the bubble and the sends of one pipeline over all GPUs."""
    assert searched[FAST].configurations[0].candidate.width > 1
    assert searched[SLOW].configurations[0].candidate.width == 1
    assert searched[SLOW].configurations[0].allreduce_ms == 0.0


def test_configurations_that_cannot_reach_the_top_are_not_planned(gpt, searched):
    top = search(gpt, Cluster(GPUS, LIMIT, FAST), BATCH, top=3)
    assert top.skipped > 0 and top.planned + top.skipped == searched[FAST].planned
    assert [f.candidate for f in top.configurations[:3]] == [f.candidate for f in searched[FAST].configurations[:3]]


def test_nothing_fits_in_too_little_memory(gpt):
    found = search(gpt, Cluster(GPUS, 1 << 20, FAST), BATCH, chunks=1)
    # GPipe at depths 1, 2 and 4, 1F1B at depth 1 (one micro-batch: torch runs it over one stage only)
    assert found.configurations == [] and found.infeasible == found.planned == 4


def test_json_entries_have_the_documented_keys(searched):
    entry = searched[FAST].configurations[0].to_dict()
    assert {"depth", "width", "schedule", "chunks", "micro_batch", "samples_per_second", "step_ms",
            "stage_peaks"} <= set(entry)
    assert len(entry["stage_peaks"]) == entry["depth"] and entry["memory_limit"] == LIMIT
