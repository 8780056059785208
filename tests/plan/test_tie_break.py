"""Dawnpiper's choice among splits that fit: the faster wins; near-ties (:data:`TIE`) go first
against idle stages, then to fewer bytes crossing the cuts (issue #47). GPT-2 small profiled on
fake tensors for 8 A100-40GB stages, as ``lightning-pipe plan --devices 8xA100-40GB`` does:
with a 128-token vocabulary (``corpus/gpt2_small``) and with GPT-2's 50,257 (``corpus/gpt2_lmhead``),
where the split chosen by bytes within the old 10% band ran stage 0 as a single node (0 ms) and
stepped 5% slower than the ``time`` partitioner's."""

import pytest

from lightning_pipe.plan.devices import DEVICES
from lightning_pipe.plan.partitioners import IDLE, TIE, split
from lightning_pipe.plan.plan import PLANNING_HEADROOM, planning_stages
from lightning_pipe.plan.request import PlanRequest
from tests.plan.corpus.replay import profile

A100 = DEVICES["A100-40GB"]
TARGETS = [int(A100.memory * PLANNING_HEADROOM)] * 8


def stage_times(stages, balance):
    return [t.forward + t.backward + t.recompute + t.swap + t.send for t in stages.times(balance)]


def request(schedule: str, chunks: int) -> PlanRequest:
    return PlanRequest(TARGETS, "dawnpiper", schedule, chunks, A100.host_bandwidth, A100.link_bandwidth)


@pytest.mark.parametrize(("schedule", "chunks", "microbatch"), [("gpipe", 4, 4), ("gpipe", 4, 96), ("1f1b", 8, 4)])
def test_gpt2_small_as_fast_as_time_with_no_idle_stage(schedule, chunks, microbatch):
    stages = planning_stages(profile("gpt2_small").scaled(microbatch), request(schedule, chunks))
    ours, theirs = split("dawnpiper", stages), split("time", stages)
    assert stages.fits(ours) and stages.fits(theirs)
    assert stages.step_ms(ours) <= stages.step_ms(theirs)
    times = stage_times(stages, ours)
    assert min(times) >= IDLE * max(times), ours


def test_gpt2_full_vocabulary_runs_no_stage_idle_for_bytes():
    """The head and the loss over 50,257 tokens are single nodes slower than a fair share, so
    every fast split idles some late stages; the first is no longer one of them, and the step
    is the time partitioner's up to a tie."""
    stages = planning_stages(profile("gpt2_lmhead"), request("1f1b", 8))
    ours, theirs = split("dawnpiper", stages), split("time", stages)
    assert stages.fits(ours)
    assert stages.step_ms(ours) <= (1 + TIE) * stages.step_ms(theirs)
    times = stage_times(stages, ours)
    assert times[0] >= IDLE * max(times), ours
