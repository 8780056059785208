"""The planner gives exactly the answers recorded at a38a97b on a fixed corpus (``corpus/``):
random chains, the example model families at test scale and GPT-2, BERT and T5 profiled on
fake tensors, under every schedule, dawnpiper and capslog, with and without memory
optimisation, at two capacities that make memory bind, and the largest micro-batch of some.
An answer is the plan's balance, non-``keep`` policies, predicted peaks and simulated step
(equal up to float rounding), or the largest micro-batch (with the lowest peak where none fits).

The default run replays :data:`QUICK`, some 8 s: every profile, schedule, partitioner,
memory-optimisation setting and kind of answer at least once. The whole corpus (204 cases,
some 200 s: the largest micro-batch of GPT-2 large by dawnpiper alone takes 90 s) runs with
``LIGHTNING_PIPE_FULL_CORPUS=1``::

    LIGHTNING_PIPE_FULL_CORPUS=1 python -m pytest -q -n0 tests/plan/test_replay.py
"""

import json
import math
import os
from typing import Any

import pytest

from tests.plan.corpus.replay import EXPECTED, answer, name

CASES: list[dict[str, Any]] = json.loads(EXPECTED.read_text())
FULL = bool(os.environ.get("LIGHTNING_PIPE_FULL_CORPUS"))
# per profile a dawnpiper case with memory optimisation and a capslog one without (the
# quickest of each), the largest micro-batch by each partitioner, and seconds on a 2-core CPU
QUICK = {
    "chain60_s1-4x1f1b-dawnpiper-memopt-loose-plan",  # 0.06
    "chain60_s1-4x2bw-capslog-kept-tight-plan",  # 0.03
    "chain150_s2-8x2bw-dawnpiper-memopt-loose-plan",  # 0.14
    "chain150_s2-8x2bw-capslog-kept-tight-plan",  # 0.08
    "chain400_s3-16xgpipe-capslog-kept-loose-plan",  # 0.24
    "chain400_s3-16x1f1b-dawnpiper-memopt-loose-plan",  # 0.53
    "gpt-4x1f1b-dawnpiper-memopt-loose-plan",  # 0.09
    "gpt-4x1f1b-capslog-kept-tight-plan",  # 0.05
    "unet-4x1f1b-capslog-kept-tight-plan",  # 0.03
    "unet-4x2bw-dawnpiper-memopt-loose-plan",  # 0.04
    "unet-4x2bw-dawnpiper-memopt-device-max_microbatch",  # 0.61
    "unet-4x2bw-capslog-memopt-device-max_microbatch",  # 0.26
    "encdec-4xgpipe-capslog-kept-loose-plan",  # 0.05
    "encdec-4x1f1b-dawnpiper-memopt-loose-plan",  # 0.10
    "gpt2_lmhead-8x1f1b-dawnpiper-memopt-loose-plan",  # 0.26
    "gpt2_lmhead-8x1f1b-capslog-kept-tight-plan",  # 0.15
    "gpt2_large-8x1f1b-dawnpiper-memopt-loose-plan",  # 0.51
    "gpt2_large-8x1f1b-capslog-kept-loose-plan",  # 0.26
    "bert_large-8xgpipe-capslog-kept-loose-plan",  # 0.15
    "t5_large-8x2bw-dawnpiper-memopt-loose-plan",  # 1.54
    "t5_large-8x2bw-capslog-kept-tight-plan",  # 0.44
    "gpt2_small-8xgpipe-dawnpiper-memopt-loose-plan",  # 0.84
    "gpt2_small-8xgpipe-capslog-kept-tight-plan",  # 0.28
}


def test_the_quick_cases_cover_every_setting():
    quick = [c for c in CASES if name(c) in QUICK]
    assert len(quick) == len(QUICK)
    for key in ("profile", "schedule", "partitioner", "memopt", "kind"):
        assert {c[key] for c in quick} == {c[key] for c in CASES}, key


def replayed(case: dict[str, Any]) -> None:
    got, expected = answer(case), case["answer"]
    if expected is None or "size" in expected:
        assert got == expected
        return
    assert got is not None, "no plan fits"
    assert {k: v for k, v in got.items() if k != "step_ms"} == {k: v for k, v in expected.items() if k != "step_ms"}
    assert math.isclose(got["step_ms"], expected["step_ms"], rel_tol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if name(c) in QUICK], ids=name)
def test_the_planner_answers_as_recorded(case):
    replayed(case)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the whole corpus takes some 200 s: set LIGHTNING_PIPE_FULL_CORPUS=1")
@pytest.mark.parametrize("case", [c for c in CASES if name(c) not in QUICK], ids=name)
def test_the_planner_answers_the_whole_corpus_as_recorded(case):
    replayed(case)
