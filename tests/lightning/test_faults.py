"""Fault injection (runtime="local"): runs whose stage devices lose memory mid-run at random,
none lost (the recovery itself is tested in test_recovery.py; ``python -m benchmarks.faults``
runs 30 such cases: 30 recovered at this commit)."""

import pytest

from benchmarks.faults import cases, run


@pytest.mark.slow
def test_fault_injection_loses_no_run():
    """The first five of the benchmark's cases: a random family, schedule, stage and step, at
    which that stage loses 5-40% of the memory it used. Each run finishes with single-device
    training's parameters, or, where the planner finds no split that fits the cut, ends with
    the error naming the stage."""
    outcomes = [run(case) for case in cases(5)]
    assert not [detail for outcome, detail in outcomes if outcome == "lost"]
    assert sum(outcome == "recovered" for outcome, _ in outcomes) >= 4, outcomes
