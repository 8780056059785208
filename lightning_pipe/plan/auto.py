"""``schedule="auto"``: the schedule the planner picks, with its virtual stages, split and
per-node choices.

No schedule is best everywhere: zero-bubble schedules fill 1F1B's bubble with the weight
halves of the backward but hold a micro-batch's stash until then, interleaving shrinks the
bubble by ``v`` at the cost of more micro-batches in flight, V-shapes fold the pipeline so
that a process's two stages hold few together. Which wins depends on the model, the cap and
the batch, so each is planned (dawnpiper under the same per-process targets) and the fastest
simulated step wins: the micro-batches and their size are the request's, so the fastest step
is the highest throughput. A schedule whose micro-batch rule torch.distributed.pipelining
refuses for the request's ``chunks`` (:func:`~lightning_pipe.plan.schedule.check_schedule`, as
the distributed runtime enforces it) is never planned. The plan lists every schedule weighed,
with its step and peaks or why it has none (:attr:`~lightning_pipe.plan.plan.Plan.considered`).
"""

from dataclasses import replace

from lightning_pipe.plan.plan import Considered, InfeasiblePlanError, Plan, make_plan
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.schedule import Schedule, check_schedule

__all__ = ["CANDIDATES", "auto_plan"]

#: What ``"auto"`` weighs: each schedule the distributed runtime runs, with the stages per
#: process it is tried at (interleaved 1F1B with one is 1F1B).
CANDIDATES: tuple[tuple[Schedule, int], ...] = (
    ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 1), ("interleaved-zb", 2),
    ("zbv", 2), ("dualpipev", 2),
)


def auto_plan(profile: Profile, request: PlanRequest) -> Plan:
    """The plan with the fastest simulated step among :data:`CANDIDATES` planned for
    ``request`` (its schedule ``"auto"``), its :attr:`~lightning_pipe.plan.plan.Plan.considered`
    listing them all, the pick first, then the others by step, then those without a plan.

    Raises:
        ValueError: ``request`` is not for processes (``carry``): only the distributed engine
            runs every schedule.
        InfeasiblePlanError: none fits; the message says why for each.
    """
    if not request.carry:
        raise ValueError("schedule='auto' weighs the distributed engine's schedules (several stages per process "
                         "among them): plan it with carry=True (runtime='distributed'), or give a schedule.")
    plans: list[Plan] = []
    refused: list[Considered] = []
    lowest: InfeasiblePlanError | None = None
    processes = len(request.capacities)
    for schedule, virtual in CANDIDATES:
        try:
            check_schedule(schedule, request.chunks, processes * virtual, virtual, distributed=True)
            plan = make_plan(profile, replace(request, schedule=schedule, virtual_stages=virtual))
        except InfeasiblePlanError as error:
            refused.append(Considered(schedule, virtual, None, why=f"does not fit: {error}"))
            lowest = error if lowest is None or error.min_peak < lowest.min_peak else lowest
        except ValueError as error:  # settings the schedule cannot run (on torch: distributed=True)
            refused.append(Considered(schedule, virtual, None, why=str(error)))
        else:
            plans.append(plan)
    if not plans:
        reasons = "; ".join(f"{c.schedule} x{c.virtual_stages}: {c.why}" for c in refused)
        raise InfeasiblePlanError(f"no schedule has a plan under the targets: {reasons}",
                                  lowest.min_peak if lowest else 0, lowest.stage if lowest else 0)
    plans.sort(key=lambda p: p.step_ms)
    best = plans[0]
    best.considered = [Considered(p.schedule, p.virtual_stages, p.step_ms, p.device_peaks) for p in plans] + refused
    return best
