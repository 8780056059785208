"""The planning headroom, measured on the model: plan to the memory limit, check the plan by
running it (on fake tensors: :func:`lightning_pipe.runtime.fake.fake_training`), and where a
stage goes over, plan again below the limit by the error the check saw.

The memory model's error is the model's own: exact on one, some percent under on the next. A
flat margin wastes capacity on the first and may be too thin for the second; measured, it is as
wide as this model needs. A first plan whose every stage is predicted within the flat
:data:`~lightning_pipe.plan.plan.PLANNING_HEADROOM` of its limit is not checked: that margin
covers the worst error measured over four model families. Once a check has measured this
model's error, every plan is checked.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from lightning_pipe.plan.plan import (
    PLANNING_HEADROOM,
    PREDICTION_ERROR,
    InfeasiblePlanError,
    Plan,
    largest_plan,
)
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanRequest

__all__ = ["Check", "checked", "checked_largest_plan", "flat"]

#: Each stage's peak (bytes) when a plan trains, as a fake training step of it meters them.
Check = Callable[[Plan], list[int]]

#: Plans checked before giving up.
ROUNDS = 6
#: Plans made before giving up, checked or not (a plan made again is not checked again).
_ATTEMPTS = 4 * ROUNDS
#: Added to a stage's measured under-prediction when it is planned again: a stage over its limit
#: by less than the rounding of its error still moves below it.
_STEP = 1e-4


def checked(
    plan_for: Callable[[list[int]], Plan], limits: Sequence[int], check: Check, *, always: bool = False
) -> Plan:
    """The plan ``plan_for(targets)`` makes for the first targets whose plan fits ``limits``
    (bytes per stage) when ``check`` runs it: the limits themselves, then each stage that went
    over planned below its limit by its own under-prediction (the largest seen at that stage);
    where no plan fits those, each half as far (the error was one plan's: another split may be
    predicted better). A plan made again that a check already rejected is not checked again:
    its stages over are planned further below. A first plan within the flat headroom is taken
    unchecked, unless ``always``.

    Raises:
        InfeasiblePlanError: ``plan_for`` finds no plan at the limits, or none of
            :data:`ROUNDS` plans checked fits.
    """
    stages = len(limits)
    errors = [0.0] * stages  # each stage's error to plan at
    went_over = [0.0] * stages  # the errors at which a plan last went over
    rejected: dict[tuple[tuple[int, ...], tuple[str, ...]], list[int]] = {}  # a plan's checked peaks
    peaks: list[int] = []
    checks = 0
    for _ in range(_ATTEMPTS):
        try:
            plan = plan_for([int(limit / (1 + e)) for limit, e in zip(limits, errors)])
        except InfeasiblePlanError:
            if not peaks:
                raise
            errors = [(w + e) / 2 for w, e in zip(went_over, errors)]
            continue
        predicted = [s.peak.total for s in plan.stages]
        if not always and not peaks and all(p <= limit * PLANNING_HEADROOM for p, limit in zip(predicted, limits)):
            return plan  # the flat headroom covers it, and no error of this model says otherwise
        key = (tuple(plan.balance), tuple(plan.policies))
        if key not in rejected:
            if checks == ROUNDS:
                break
            checks += 1
            peaks = check(plan)
            if all(p <= limit for p, limit in zip(peaks, limits)):
                return plan
            rejected[key] = peaks
        peaks = rejected[key]
        # a step past the error seen, so that a plan just at it is not made again
        went_over = list(errors)
        errors = [max(e, m / p - 1) + _STEP if m > limit else e
                  for e, m, p, limit in zip(errors, peaks, predicted, limits)]
    stage = max(range(stages), key=lambda s: peaks[s] / limits[s])
    raise InfeasiblePlanError(
        f"no plan fits the memory limits {list(limits)} when run: of {checks} plans checked, each stage planned "
        f"below its limit by the memory model's error measured there (up to {max(errors):.1%}), a fake training "
        f"step of each went over, or none was found that far below; stage {stage} of the last that ran peaked at "
        f"{peaks[stage]} bytes. Lower the micro-batch size, add stages or device memory.",
        peaks[stage], stage,
    )


def checked_largest_plan(profile: Profile, request: PlanRequest, check: Check) -> Plan:
    """The plan at the largest micro-batch size whose plan for ``request`` fits its capacities,
    here the stages' memory limits, as :func:`checked` measures it (its size:
    ``plan.microbatch_size``).

    Raises:
        InfeasiblePlanError: not even a micro-batch of one fits.
    """

    answers: list[int] = []  # each round's: the next round's targets are near the last one's

    def largest(targets: list[int]) -> Plan:
        # made on what the search's probe of the largest size priced, not afresh at that size
        plan = largest_plan(profile, replace(request, capacities=targets), near=answers[-1] if answers else None)
        answers.append(plan.microbatch_size)
        return plan

    return checked(largest, request.capacities, check)


def flat(plan: Plan) -> list[int]:
    """The check of a training step that cannot run on fake tensors: each stage's prediction
    plus the memory model's worst under-prediction measured over the model families
    (:data:`~lightning_pipe.plan.plan.PREDICTION_ERROR`), which plans to the flat headroom."""
    return [math.ceil(s.peak.total * (1 + PREDICTION_ERROR)) for s in plan.stages]
