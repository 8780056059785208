"""Fault injection (runtime="local"): runs whose stage devices lose memory mid-run at random,
none lost (the recovery itself is tested in test_recovery.py)."""

import random
import re

import pytest

from lightning_pipe.lightning.recovery import RecoveryError
from tests.helpers import max_rel_diff
from tests.lightning.test_recovery import _limit, _reference, _survives

# The families at their smallest that still plan with recompute: a case trains in a few seconds.
SMALL = {"gpt": {"layers": 2}, "unet": {"depth": 2}, "encdec": {"layers": 2}}


@pytest.mark.slow
def test_fault_injection_suite_loses_no_run():
    """30 runs of 3 steps under a limit with room (the fuller stage of an unconstrained plan,
    plus half): a random family, schedule, stage and step, at which that stage loses 5-40% of
    the memory it had used so far. Each run finishes with single-device training's parameters,
    or, where the planner finds that no split fits the cut (the U-Net's first stage holds its
    full-size activations wherever the cut goes), ends with the error naming the stage."""
    rnd = random.Random(0)
    limits: dict[tuple[str, str], int] = {}
    references: dict[str, object] = {}
    outcomes = []
    for case in range(30):
        family, schedule = rnd.choice(list(SMALL)), rnd.choice(["gpipe", "1f1b"])
        stage, step, cut = rnd.randrange(2), rnd.randrange(1, 3), rnd.uniform(0.05, 0.4)
        size = SMALL[family]
        limit = limits.setdefault((family, schedule), int(1.5 * _limit(family, schedule, **size)))
        try:
            model, strategy, _, replans = _survives(family, schedule, stage, step, cut, limit, True, 3, **size)
        except RecoveryError as error:
            assert re.match(rf"Stage {stage} is out of memory.*No plan keeps every stage under its limit", str(error))
            outcomes.append("refused")
            continue
        assert replans, case
        assert all(m.peak <= c for m, c in zip(strategy.meter.stages, strategy.meter.capacities)), case
        reference = references.setdefault(family, _reference(family, 3, **size))
        assert max_rel_diff(model, reference) < 1e-5, (case, family, schedule, stage, step, cut)
        outcomes.append("recovered")
    assert outcomes.count("recovered") >= 24, outcomes
