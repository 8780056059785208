"""Training that survives a plan that does not hold.

A plan is checked before it runs, yet a model the memory model misjudges, or memory another
process takes, can still put a stage over. Instead of ending the run, the strategy runs the
step again on a new plan: the failed attempt is undone (:class:`UndoPoint`: the random state,
metric and logged states, buffers the step writes; gradients are zeroed by the step itself),
the stages are planned again below their limits by the error the failure showed
(:class:`Corrections`), rebuilt with parameters and optimizer state moved, and the batch runs
again. The optimizer steps once, after an attempt that succeeded. Both engines use these
pieces; under ``runtime="distributed"`` every rank learns of a failure after the schedule,
and all plan again and rebuild together (:mod:`.distributed`), a stage there being a
pipeline rank.
"""

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

from lightning_pipe.lightning.internals import attached_trainer, forget_computed, logged_results, set_update_count
from lightning_pipe.measure.meter import StageOutOfMemoryError
from lightning_pipe.plan.plan import InfeasiblePlanError, Plan

__all__ = ["DRIFT", "Corrections", "Failure", "RecoveryError", "UndoPoint", "failure_of", "mid_window", "replanned"]

#: A stage whose metered peak exceeds its prediction by more than this share, and its planning
#: target, is planned again before the next batch: the plan's margin there is gone.
DRIFT = 0.05

#: What a stage that ran out of memory is taken to need beyond what it was checked at, when the
#: error does not say how much it asked for (a CUDA error whose text changed).
_UNSAID = 0.05

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


class RecoveryError(RuntimeError):
    """A stage ran out of memory and no new plan could keep it under its limit."""


@dataclass
class Failure:
    """A step that ran out of memory: the stage (``None``: unknown), the bytes it held (the
    meter counts them; ``None``: unknown) and asked for more (``None``: unknown), and the
    error's text."""

    stage: int | None
    held: int | None
    asked: int | None
    message: str


def failure_of(error: BaseException, devices: Sequence[torch.device]) -> Failure:
    """What ``error`` says about the stage that ran out: the meter names it; a CUDA error names
    the device (the first stage on it is taken) and what it tried to allocate."""
    if isinstance(error, StageOutOfMemoryError):
        return Failure(error.stage, error.in_use, error.request, str(error))
    message = str(error)
    device = re.search(r"GPU (\d+)", message)
    stage = next((s for s, d in enumerate(devices) if device and d.type == "cuda" and (d.index or 0) == int(
        device.group(1))), None)
    asked = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", message)
    size = round(float(asked.group(1)) * _UNITS[asked.group(2)]) if asked else None
    return Failure(stage, None, size, message.splitlines()[0] if message else type(error).__name__)


@dataclass
class Corrections:
    """Per stage, how much more memory training took than the plan's check said (a factor
    >= 1): the limits a new plan is checked against are the stage limits divided by it."""

    factors: list[float]
    replans: int = 0

    @classmethod
    def none(cls, stages: int) -> "Corrections":
        return cls([1.0] * stages)

    def learn(self, stage: int, measured: int, checked: int) -> None:
        """Stage ``stage`` reached ``measured`` bytes where its plan was checked at ``checked``."""
        if checked > 0:
            self.factors[stage] = max(self.factors[stage], measured / checked)

    def learn_failure(self, failure: Failure, checked: Sequence[int]) -> None:
        """What a failure shows: its stage needed at least what it held and asked for (the
        meter's count; no more than it was checked at where its limit shrank), or, where only
        the request is known (CUDA's), that much on top of what it was checked at."""
        stages = range(len(checked)) if failure.stage is None else [failure.stage]
        for s in stages:
            if failure.held is not None and failure.asked is not None:
                self.learn(s, failure.held + failure.asked, checked[s])
            else:
                self.learn(s, checked[s] + (failure.asked or round(checked[s] * _UNSAID)), checked[s])

    def limits(self, limits: Sequence[int]) -> list[int]:
        """The limits a new plan's check must keep each stage under."""
        return [int(limit / f) for limit, f in zip(limits, self.factors)]

    def count(self, why: str, max_replans: int) -> None:
        """One more re-plan, for the reason ``why``.

        Raises:
            RecoveryError: ``max_replans`` were made already.
        """
        if self.replans >= max_replans:
            raise RecoveryError(
                f"{why} The stages were planned again {self.replans} times already (max_replans={max_replans}). "
                f"Lower the micro-batch size, raise memory_limit or add stages; or raise max_replans."
            )
        self.replans += 1


def replanned(corrections: Corrections, max_replans: int, why: str, before: Plan, after: Plan) -> str:
    """The warning of a re-plan: why, and the split before and after."""
    return (f"Planned again ({corrections.replans} of at most {max_replans}): {why.rstrip('.')}. Balance "
            f"{before.balance} -> {after.balance}; recomputed or swapped nodes {_optimised(before)} -> "
            f"{_optimised(after)}.")


def limit_unmet(limits: Sequence[int] | None, error: InfeasiblePlanError) -> RecoveryError:
    """A ``memory_limit`` assigned while training that no plan keeps every stage under."""
    return RecoveryError(f"No plan keeps every stage under memory_limit={limits}: {error} Raise memory_limit, lower "
                         f"the micro-batch size or add stages.")


def mid_window(failure: Failure) -> RecoveryError:
    """A failure inside a window of ``accumulate_grad_batches`` after its first batch: earlier
    batches' gradients were added to, so the step cannot run again."""
    return RecoveryError(
        f"{failure.message} It ran out within a window of accumulate_grad_batches, after earlier batches' "
        f"gradients were added: the failed step changed them, so it cannot run again. Lower the micro-batch "
        f"size or memory_limit (the planner then leaves more room)."
    )


def _optimised(plan: Plan) -> int:
    return sum(p != "keep" for p in plan.policies)


class UndoPoint:
    """What a training step changes besides gradients and parameters, as it was before the
    step: so a step that fails can run again as if for the first time. Taken before every
    step: a few small copies (metric states, written buffers, the random state)."""

    def __init__(self, module: LightningModule, devices: Sequence[torch.device], buffers: Iterable[Tensor]) -> None:
        self._cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self._rng = torch.get_rng_state()
        self._cuda_rng = [torch.cuda.get_rng_state(i) for i in self._cuda]
        self._buffers = [(b, b.clone()) for b in buffers]
        metrics = [m for m in module.modules() if isinstance(m, Metric)]
        results = _results(module)
        self._keys: set[str] = set()
        if results is not None:
            self._keys = set(results.keys())
            metrics += [m for m in results.values() if isinstance(m, Metric)]
        self._metrics = [(m, _metric_state(m)) for m in metrics]
        self._module = module

    def restore(self) -> None:
        torch.set_rng_state(self._rng)
        for i, rng in zip(self._cuda, self._cuda_rng):
            torch.cuda.set_rng_state(rng, i)
        with torch.no_grad():
            for buffer, copy in self._buffers:
                buffer.copy_(copy)
        for metric, state in self._metrics:
            _set_metric_state(metric, state)
        results = _results(self._module)
        if results is not None:
            for key in set(results.keys()) - self._keys:  # logged first by the failed attempt
                del results[key]


def _results(module: LightningModule) -> dict[str, object] | None:
    """The training loop's logged values (Lightning's ``ResultCollection``, a dict of metrics
    per logged name; private: ``Trainer._results``). A failed attempt's ``self.log`` calls
    are taken back from it."""
    return logged_results(attached_trainer(module))


def _metric_state(metric: Metric) -> dict[str, object]:
    """A metric's states (its ``add_state`` names: tensors copied, lists of them shallowly, as
    updates replace or append but never change an appended tensor) and its update count."""
    state: dict[str, object] = {
        name: value.clone() if isinstance(value, Tensor) else list(value) for name, value in metric.metric_state.items()
    }
    state[_UPDATES] = metric.update_count
    return state


def _set_metric_state(metric: Metric, state: dict[str, object]) -> None:
    for name, value in state.items():
        if name == _UPDATES:
            set_update_count(metric, cast(int, value))
        else:
            setattr(metric, name, value.clone() if isinstance(value, Tensor) else list(value) if isinstance(value, list)
                    else value)
    forget_computed(metric)  # a value computed from the failed attempt's updates


_UPDATES = "update count"  # (no state's name: not an identifier)
