"""The planner gives the answers it gave before it was made faster (issue #47), on a fixed
corpus (``corpus/``): random chains, the example model families at test scale and GPT-2,
BERT and T5 profiled on fake tensors, under every schedule, dawnpiper and capslog, with and
without memory optimisation, at two capacities that make memory bind, and the largest
micro-batch of some. An answer may differ only where it is better, as :data:`IMPROVED` says
why: a plan that fits with a simulated step no slower (or, where it idles fewer stages, slower
by less than :data:`~lightning_pipe.plan.partitioners.TIE`), a micro-batch no smaller."""

import json
import math
import os
from typing import Any

import pytest

from lightning_pipe.plan.partitioners import TIE
from tests.plan.corpus.replay import EXPECTED, answer, name

CASES: list[dict[str, Any]] = json.loads(EXPECTED.read_text())
# The largest micro-batch of the GPT-2s by dawnpiper: 72 s (large) and 10-17 s each, more than the
# suite's budget; run with LIGHTNING_PIPE_FULL_CORPUS=1 (all three gave today's answers when the
# planner's tie-break changed).
FULL = bool(os.environ.get("LIGHTNING_PIPE_FULL_CORPUS"))
SLOW = {f"{model}-8x{schedule}-dawnpiper-memopt-device-max_microbatch"
        for model, schedule in (("gpt2_large", "1f1b"), ("gpt2_lmhead", "1f1b"), ("gpt2_small", "gpipe"))}

# Dawnpiper's choice among the splits that fit: splits within 10% of the fastest counted as
# equally fast, and the one sending the fewest bytes won; now only those within TIE (2%) do.
FASTER = "dawnpiper picks a faster split: the old 10% tie band let bytes pick a slower one"
# Within TIE, a split idling fewer stages now wins before bytes count: these no longer run a
# stage of a single node (GPT-2: the first, 0 ms) for a step at most 0.02% faster.
UNIDLED = "dawnpiper's split idles fewer stages, its step within TIE of the old one's"
IMPROVED: dict[str, str] = {
    "chain60_s1-4x1f1b-dawnpiper-memopt-loose-plan": FASTER,
    "chain60_s1-4x1f1b-dawnpiper-kept-loose-plan": FASTER,
    "chain60_s1-4x1f1b-dawnpiper-kept-tight-plan": FASTER,
    "chain60_s1-4x2bw-dawnpiper-memopt-loose-plan": FASTER,
    "chain60_s1-4x2bw-dawnpiper-kept-loose-plan": FASTER,
    "chain150_s2-8xgpipe-dawnpiper-memopt-loose-plan": FASTER,
    "chain150_s2-8xgpipe-dawnpiper-memopt-tight-plan": FASTER,
    "chain150_s2-8x1f1b-dawnpiper-memopt-loose-plan": FASTER,
    "chain150_s2-8x1f1b-dawnpiper-kept-loose-plan": FASTER,
    "chain150_s2-8x1f1b-dawnpiper-memopt-tight-plan": FASTER,
    "chain150_s2-8x1f1b-dawnpiper-kept-tight-plan": FASTER,
    "chain150_s2-8x2bw-dawnpiper-memopt-loose-plan": FASTER,
    "chain150_s2-8x2bw-dawnpiper-memopt-tight-plan": FASTER,
    "chain400_s3-16xgpipe-dawnpiper-memopt-loose-plan": FASTER,
    "chain400_s3-16xgpipe-dawnpiper-memopt-tight-plan": FASTER,
    "chain400_s3-16x1f1b-dawnpiper-memopt-loose-plan": FASTER,
    "chain400_s3-16x1f1b-dawnpiper-memopt-tight-plan": FASTER,
    "chain400_s3-16x2bw-dawnpiper-memopt-loose-plan": FASTER,
    "chain400_s3-16x2bw-dawnpiper-memopt-tight-plan": FASTER,
    "gpt-4xgpipe-dawnpiper-memopt-loose-plan": FASTER,
    "gpt-4x1f1b-dawnpiper-memopt-loose-plan": FASTER,
    "gpt-4x1f1b-dawnpiper-memopt-tight-plan": FASTER,
    "gpt-4x2bw-dawnpiper-memopt-loose-plan": FASTER,
    "gpt-4x2bw-dawnpiper-memopt-tight-plan": FASTER,
    "unet-4x1f1b-dawnpiper-memopt-loose-plan": FASTER,
    "unet-4x1f1b-dawnpiper-kept-loose-plan": FASTER,
    "unet-4x1f1b-dawnpiper-memopt-tight-plan": FASTER,
    "unet-4x2bw-dawnpiper-memopt-loose-plan": FASTER,
    "unet-4x2bw-dawnpiper-kept-loose-plan": FASTER,
    "unet-4x2bw-dawnpiper-memopt-tight-plan": FASTER,
    "encdec-4xgpipe-dawnpiper-memopt-loose-plan": FASTER,
    "encdec-4xgpipe-dawnpiper-kept-loose-plan": FASTER,
    "encdec-4xgpipe-dawnpiper-memopt-tight-plan": FASTER,
    "encdec-4x1f1b-dawnpiper-memopt-loose-plan": FASTER,
    "encdec-4x1f1b-dawnpiper-memopt-tight-plan": FASTER,
    "encdec-4x2bw-dawnpiper-memopt-loose-plan": FASTER,
    "gpt2_lmhead-8xgpipe-dawnpiper-memopt-tight-plan": FASTER,
    "gpt2_lmhead-8x1f1b-dawnpiper-memopt-loose-plan": FASTER,
    "gpt2_lmhead-8x1f1b-dawnpiper-memopt-tight-plan": FASTER,
    "gpt2_large-8x1f1b-dawnpiper-memopt-loose-plan": FASTER,
    "gpt2_large-8x1f1b-dawnpiper-memopt-tight-plan": FASTER,
    "bert_large-8xgpipe-dawnpiper-memopt-loose-plan": FASTER,
    "bert_large-8xgpipe-dawnpiper-memopt-tight-plan": FASTER,
    "t5_large-8x2bw-dawnpiper-memopt-loose-plan": FASTER,
    "t5_large-8x2bw-dawnpiper-memopt-tight-plan": FASTER,
    "gpt2_small-8xgpipe-dawnpiper-memopt-tight-plan": FASTER,
    "encdec-4x2bw-dawnpiper-memopt-tight-plan": UNIDLED,
    "gpt2_lmhead-8xgpipe-dawnpiper-memopt-loose-plan": UNIDLED,
    "gpt2_lmhead-8x1f1b-dawnpiper-kept-loose-plan": UNIDLED,
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=name(c), marks=[
        pytest.mark.slow, pytest.mark.skipif(not FULL, reason="LIGHTNING_PIPE_FULL_CORPUS=1 replays it")
    ] if name(c) in SLOW else []) for c in CASES]
)
def test_same_answers(case):
    expected, found = case["answer"], answer(case)
    if name(case) in IMPROVED and found != expected:
        assert_better(case, found, expected)
        return
    assert_same(found, expected)


def assert_same(found: dict[str, Any] | None, expected: dict[str, Any] | None) -> None:
    if expected is None or "size" in expected:
        assert found == expected
        return
    assert found is not None
    assert (found["balance"], found["policies"], found["peaks"]) == (
        expected["balance"], expected["policies"], expected["peaks"])
    assert math.isclose(found["step_ms"], expected["step_ms"], rel_tol=1e-9)


def assert_better(case: dict[str, Any], found: dict[str, Any] | None, expected: dict[str, Any] | None) -> None:
    if case["kind"] == "max_microbatch":
        assert found is not None and expected is not None and found["size"] >= expected["size"]
        return
    assert found is not None  # fitting_plan's: every stage fits
    if expected is not None:
        slack = TIE if IMPROVED[name(case)] == UNIDLED else 1e-9
        assert found["step_ms"] <= expected["step_ms"] * (1 + slack)
