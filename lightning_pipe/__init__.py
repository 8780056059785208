"""Memory-centric pipeline-parallel training for PyTorch Lightning.

Data flow: :mod:`~lightning_pipe.graph.capture` -> :mod:`~lightning_pipe.plan.balance` ->
:mod:`~lightning_pipe.runtime.build` -> :mod:`~lightning_pipe.runtime.gpipe`, driven from Lightning by
:class:`~lightning_pipe.lightning.strategy.MemoryPipeStrategy` (registered as ``"memory_pipe"``).
"""

from lightning_pipe.graph.capture import CaptureError
from lightning_pipe.lightning.strategy import MemoryPipeStrategy

__all__ = ["CaptureError", "MemoryPipeStrategy"]
__version__ = "0.1.0"
