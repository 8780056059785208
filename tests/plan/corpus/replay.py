"""The replay corpus's cases and how a case is answered (by the recording script and the test).

A case names a profile of this folder and planning settings; its answer is the plan's balance,
non-``keep`` policies, predicted peaks and simulated step (``None`` where no plan fits), or the
largest micro-batch. ``expected.json`` holds each case with the answer the planner gave when it
was recorded.
"""

import gzip
from functools import cache
from pathlib import Path
from typing import Any

from lightning_pipe.plan.plan import InfeasiblePlanError, fitting_plan, max_microbatch
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanRequest

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected.json"


@cache
def profile(name: str) -> Profile:
    with gzip.open(HERE / f"{name}.json.gz", "rt") as f:
        return Profile.from_json(f.read())


def request(case: dict[str, Any]) -> PlanRequest:
    """What ``case`` asks the planner for."""
    return PlanRequest(case["capacities"], case["partitioner"], case["schedule"], case["chunks"],
                       case["host_bandwidth"], case["link_bandwidth"], optimise_memory=case["memopt"])


def answer(case: dict[str, Any]) -> dict[str, Any] | None:
    """What the planner answers for ``case`` (a dict as ``expected.json`` holds it, less ``answer``)."""
    request_ = request(case)
    if case["kind"] == "max_microbatch":
        try:
            return {"size": max_microbatch(profile(case["profile"]), request_)}
        except InfeasiblePlanError as err:
            return {"size": 0, "min_peak": err.min_peak}
    plan = fitting_plan(profile(case["profile"]), request_)
    if plan is None:
        return None
    return {
        "balance": plan.balance,
        "policies": {str(i): p for i, p in enumerate(plan.policies) if p != "keep"},
        "peaks": [s.peak.total for s in plan.stages],
        "step_ms": plan.step_ms,
    }


def name(case: dict[str, Any]) -> str:
    """A case's id in test output."""
    memopt = "memopt" if case["memopt"] else "kept"
    return (f"{case['profile']}-{case['stages']}x{case['schedule']}-{case['partitioner']}-{memopt}-{case['cap']}"
            f"-{case['kind']}")
