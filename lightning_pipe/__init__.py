"""Memory-centric pipeline-parallel training for PyTorch Lightning.

Data flow: :mod:`~lightning_pipe.graph.capture` -> :mod:`~lightning_pipe.plan.balance` ->
:mod:`~lightning_pipe.runtime.build` -> :mod:`~lightning_pipe.runtime.gpipe`, driven from Lightning by
:class:`~lightning_pipe.lightning.strategy.MemoryPipeStrategy` (registered as ``"memory_pipe"``).
"""

from lightning_pipe.graph.capture import CaptureError
from lightning_pipe.lightning.strategy import MemoryPipeStrategy
from lightning_pipe.measure.meter import StageOutOfMemoryError
from lightning_pipe.plan.memory import StagePeak
from lightning_pipe.plan.plan import InfeasiblePlanError, Plan, StageReport

__all__ = [
    "CaptureError", "InfeasiblePlanError", "MemoryPipeStrategy", "Plan", "StageOutOfMemoryError", "StagePeak",
    "StageReport",
]
__version__ = "0.1.0"
