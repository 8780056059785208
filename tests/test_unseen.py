"""``benchmarks/unseen.py`` on its cheapest families, so the measurement cannot silently break:
every row has its three per-stage numbers, the meter saw bytes, the fake check agrees with the
meter, and the rows reach the JSON."""

import json
import math

import pytest

from benchmarks import unseen

# Measured (benchmarks/unseen_results.json, 2 CPU stages, gpipe, memory to spare): the fake
# check within 0.1% of the meter on every stage of these families.
FAKE_BOUND = 0.02
CHEAP = ("mlp-mixer", "torchmetrics-step")


@pytest.mark.slow
def test_three_numbers_per_stage_and_the_json(tmp_path):
    """Two cheap families (an MLP-Mixer; a step updating a torchmetrics metric) on
    gpipe with memory to spare: each row has predicted, fake and metered bytes for each of the
    two stages, the metered peaks are positive, the errors are those numbers', the fake check is
    within ``FAKE_BOUND`` (2%) of the meter (measured: within 0.1%), and the JSON has the rows."""
    out = tmp_path / "unseen.json"
    rows = unseen.run(CHEAP, schedules=["gpipe"], memopts=["off"], out=out, echo=False)
    assert [(r.family, r.schedule, r.memopt) for r in rows] == [(f, "gpipe", "off") for f in CHEAP]
    for row in rows:
        assert row.error is None, row.error
        assert len(row.predicted) == len(row.fake) == len(row.metered) == unseen.STAGES
        assert all(m > 0 for m in row.metered)
        assert all(p > 0 for p in row.predicted) and all(f > 0 for f in row.fake)
        for p, f, m, pe, fe in zip(row.predicted, row.fake, row.metered, row.predicted_error, row.fake_error):
            assert pe == pytest.approx((p - m) / m) and fe == pytest.approx((f - m) / m)
            assert abs(fe) <= FAKE_BOUND, (row.family, row.fake, row.metered)
        assert sum(row.balance) > 0 and row.recomputed == 0
    written = json.loads(out.read_text())
    assert [(r["family"], r["metered"]) for r in written["rows"]] == [(r.family, r.metered) for r in rows]
    assert written["settings"]["stages"] == unseen.STAGES


def test_errors_and_the_printed_line():
    """A stage a planner left empty is no division by zero; a failed run prints its error."""
    assert unseen.relative(0, 0) == 0.0 and unseen.relative(5, 0) == math.inf
    assert unseen.relative(110, 100) == pytest.approx(0.1)
    failed = unseen.Row("hf-gpt2", "1f1b", "on", 2, error="InfeasiblePlanError: no plan fits")
    assert "InfeasiblePlanError" in unseen.line(failed)
    ok = unseen.Row("hf-gpt2", "1f1b", "off", 2, balance=[3, 2], predicted=[110, 90], fake=[100, 100],
                    metered=[100, 100], predicted_error=[0.1, -0.1], fake_error=[0.0, 0.0])
    assert "| 10.0% | 10.0% | +0.0% |" in unseen.line(ok)
    # a refused run whose every 2-stage cut, kept or recomputed, metered over its limit
    refused = unseen.Row("inplace-views", "gpipe", "on", 2, limit=100, error="InfeasiblePlanError: no plan fits",
                         least_peak=120, least_balance=[3, 2], splits_tried=8)
    assert "no plan exists" in unseen.line(refused) and "120 B at [3, 2]" in unseen.line(refused)
