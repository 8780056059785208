"""The largest micro-batch search probes exactly the sizes doubling and bisection does, the last
:data:`~lightning_pipe.plan.plan.UPWARD` sizes from below (a size that does not fit costs several
times one that fits), and answers as recorded.

Whether a size fits is not monotone in the size: on BERT-large's profile for 8 A100s with
PyTorch's math attention (``data/``, made by ``benchmarks.paper`` before fake execution ran the
fused kernel) dawnpiper fits 179 micro-batches, not 180 to 182, and 183 again. A search probing
other sizes (a model of where the limit lies, a start from another partitioner's answer, a
bound from an earlier round) may stop at another edge, so its answer would not be today's; the
tests here pin the probes themselves. A search told a size ``near`` the answer (a checked
plan's next round, whose targets are near the last round's) starts there.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_pipe.plan.plan import UPWARD, largest_plan, max_microbatch, plan_fits, planning_stages
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.stages import Stages
from tests.plan.corpus.replay import EXPECTED, name, request
from tests.plan.corpus.replay import profile as corpus_profile
from tests.plan.test_complete import on_8_a100s
from tests.plan.test_plan import REQUEST, cnn_like

BERT_MATH = Path(__file__).parent / "data" / "bert_large_a100_math.json.gz"


def reference(profile: Profile, request: PlanRequest, at_least: int = 1) -> tuple[int, list[int]]:
    """Doubling from ``at_least``, then bisection, on :func:`plan_fits`, up from the size that
    fits once :data:`UPWARD` sizes are left: the largest size and the sizes probed, in order."""
    probed: list[int] = []

    def fits(size: int) -> bool:
        probed.append(size)
        return plan_fits(profile.scaled(size), request)

    low, high = at_least, 2 * at_least
    if at_least == 1:
        assert fits(1)
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = low + 1 if high - low <= UPWARD else (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low, probed


def searched(monkeypatch, profile: Profile, request: PlanRequest, at_least: int = 1) -> tuple[int, list[int]]:
    """:func:`max_microbatch` and the sizes it probed, in order."""
    probed: list[int] = []
    scale = Profile.scaled

    def recorded(self: Profile, size: int) -> Profile:  # each probe prices the profile at its size once
        probed.append(size)
        return scale(self, size)

    monkeypatch.setattr(Profile, "scaled", recorded)
    size = max_microbatch(profile, request, at_least=at_least)
    monkeypatch.undo()
    return size, probed


@pytest.mark.slow
# dawnpiper under one schedule (its probes take 7 s a schedule), the quick ones under each
@pytest.mark.parametrize(("partitioner", "schedule"), [("dawnpiper", "1f1b"), *((p, s) for p in ("capslog", "time")
                                                                               for s in ("gpipe", "1f1b", "2bw"))])
def test_the_search_probes_what_doubling_and_bisection_probe(monkeypatch, partitioner, schedule):
    request = replace(REQUEST, partitioner=partitioner, schedule=schedule, host_bandwidth=1e6)
    for at_least in (1, 3):
        assert searched(monkeypatch, cnn_like(), request, at_least) == reference(cnn_like(), request, at_least)


@pytest.mark.parametrize("partitioner", ["capslog", "dawnpiper"])
def test_a_search_near_the_answer_probes_it_and_the_size_above(monkeypatch, partitioner):
    profile, request = cnn_like(), replace(REQUEST, partitioner=partitioner, host_bandwidth=1e6)
    largest = max_microbatch(profile, request)
    probed: list[int] = []
    scale = Profile.scaled
    monkeypatch.setattr(Profile, "scaled", lambda self, size: probed.append(size) or scale(self, size))
    for near in (largest, largest - 3, largest + 5):
        probed.clear()
        assert largest_plan(profile, request, near=near).microbatch_size == largest
        assert probed[0] == near
        assert near <= largest or max(probed[1:]) < near  # where near does not fit, the doubling below it
    probed.clear()
    largest_plan(profile, request, near=largest)
    assert probed == [largest, largest + 1]  # not the doubling's dozen


#: The replay corpus's largest micro-batch cases of the smaller profiles (some 3 s on a 2-core CPU).
CORPUS = [c for c in json.loads(EXPECTED.read_text())
          if c["kind"] == "max_microbatch" and c["profile"] in ("unet", "gpt")
          and (c["profile"], c["partitioner"]) != ("gpt", "dawnpiper")]


@pytest.mark.slow
@pytest.mark.parametrize("case", CORPUS, ids=name)
def test_the_search_probes_what_doubling_and_bisection_probe_on_profiled_models(monkeypatch, case):
    profile, request_ = corpus_profile(case["profile"]), request(case)
    size, probed = searched(monkeypatch, profile, request_)
    assert (size, probed) == reference(profile, request_) and size == case["answer"]["size"]


@pytest.mark.slow
def test_whether_a_size_fits_is_not_monotone_on_bert_large():
    # (the GPT example's witness, 1347 fitting and 1348 not, went when dawnpiper's fallback
    # search got a third start per stage: it fits every size up to 1393 now)
    profile, request = on_8_a100s(BERT_MATH)
    assert [plan_fits(profile.scaled(size), request) for size in (179, 180, 183)] == [True, False, True]


def test_no_last_stage_peaks_under_its_bound_and_a_size_over_it_is_refused_unsearched(monkeypatch):
    """Under GPipe the last stage holds the batch and every micro-batch's outputs or losses
    whatever it holds and drops: :meth:`CostModel.last_stage_least_peak` is under every last
    stage's peak (kept, recomputed, swapped, placed in a split), and a size whose bound is over
    the last stage's target is refused without a search."""
    profile = corpus_profile("gpt").scaled(8)
    request = PlanRequest([10**9] * 4, "dawnpiper", "gpipe", 4, 1e9, None)
    stages = planning_stages(profile, request)
    model, held = stages.model, stages.in_flight[-1]
    bound = model.last_stage_least_peak(held)
    assert bound > model.batch
    n = model.n
    for lo in range(n - 1, 0, -max(1, n // 12)):
        for policy in ("recompute", "swap"):
            dropped = {i: policy for i in range(lo, n) if model.saved[i]}
            for policies in ({}, dropped):
                assert model.peak(lo, n, held, policies).total >= bound
    for balance in ([n - 3, 1, 1, 1], [n // 4, n // 4, n // 4, n - 3 * (n // 4)]):
        assert stages.placed(balance)[-1].peak.total >= bound
    tight = replace(request, capacities=[10**12] * 3 + [bound - 1])
    monkeypatch.setattr(Stages, "fits", lambda *_: pytest.fail("priced a split"))
    assert not plan_fits(profile, tight)
