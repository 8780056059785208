"""Memory-centric pipeline-parallel training for PyTorch Lightning.

Data flow: :mod:`~lightning_pipe.graph.capture` -> :mod:`~lightning_pipe.plan.balance` ->
:mod:`~lightning_pipe.runtime.build` -> :mod:`~lightning_pipe.runtime.gpipe`, driven from Lightning by
:class:`~lightning_pipe.lightning.strategy.MemoryPipeStrategy` (registered as ``"memory_pipe"`` when
it is first imported).

The names below load on first use, so that ``import lightning_pipe.plan`` (the planner, which needs
neither torch nor Lightning) does not pay for importing the strategy, Lightning and torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_pipe.graph.capture import CaptureError
    from lightning_pipe.lightning.recovery import RecoveryError
    from lightning_pipe.lightning.strategy import MemoryPipeStrategy
    from lightning_pipe.measure.meter import StageOutOfMemoryError
    from lightning_pipe.plan.memory import StagePeak
    from lightning_pipe.plan.plan import InfeasiblePlanError, Plan, StageReport
    from lightning_pipe.plan.request import PlanRequest

_HOMES = {
    "CaptureError": "lightning_pipe.graph.capture",
    "InfeasiblePlanError": "lightning_pipe.plan.plan",
    "MemoryPipeStrategy": "lightning_pipe.lightning.strategy",
    "Plan": "lightning_pipe.plan.plan",
    "PlanRequest": "lightning_pipe.plan.request",
    "RecoveryError": "lightning_pipe.lightning.recovery",
    "StageOutOfMemoryError": "lightning_pipe.measure.meter",
    "StagePeak": "lightning_pipe.plan.memory",
    "StageReport": "lightning_pipe.plan.plan",
}
__all__ = [
    "CaptureError", "InfeasiblePlanError", "MemoryPipeStrategy", "Plan", "PlanRequest", "RecoveryError",
    "StageOutOfMemoryError", "StagePeak", "StageReport",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'lightning_pipe' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
