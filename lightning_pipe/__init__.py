"""Memory-centric pipeline-parallel training for PyTorch Lightning.

Data flow: :mod:`~lightning_pipe.capture` -> :mod:`~lightning_pipe.partition` ->
:mod:`~lightning_pipe.build` -> :mod:`~lightning_pipe.pipeline`, driven from Lightning by
:class:`~lightning_pipe.strategy.MemoryPipeStrategy` (registered as ``"memory_pipe"``).
"""

from lightning_pipe.capture import CaptureError
from lightning_pipe.strategy import MemoryPipeStrategy

__all__ = ["CaptureError", "MemoryPipeStrategy"]
__version__ = "0.1.0"
