"""Measure: wall time each stage spends in forward and backward, per training step.

Forward is timed around each stage call. Backward runs inside autograd, so for the
autograd-driven schedule a hook on each stage's output marks when that stage's backward of a
micro-batch starts; it ends when the next one starts (one process runs one task at a time)
or when backward returns. Times are host wall-clock: on CUDA they include waiting for the
kernels only where the host waits.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_flatten

__all__ = ["StageClock"]


class StageClock:
    """Per-stage forward and backward milliseconds accumulated since the last ``reset``."""

    def __init__(self, num_stages: int) -> None:
        self.forward_ms = [0.0] * num_stages
        self.backward_ms = [0.0] * num_stages
        self._started: list[tuple[float, int]] = []

    @contextmanager
    def forward(self, stage: int) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.forward_ms[stage] += (time.perf_counter() - start) * 1e3

    @contextmanager
    def backward(self, stage: int) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.backward_ms[stage] += (time.perf_counter() - start) * 1e3

    def watch_backward(self, outputs: Any, stage: int) -> None:
        """Mark, from inside autograd, when ``stage``'s backward of these outputs starts."""
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(lambda grads: self._mark(stage))
                return

    def _mark(self, stage: int) -> None:
        now = time.perf_counter()
        self._close(now)
        self._started.append((now, stage))

    def end_backward(self) -> None:
        """Backward has returned: the last stage backward ends now."""
        self._close(time.perf_counter())

    def _close(self, now: float) -> None:
        if self._started:
            start, stage = self._started.pop()
            self.backward_ms[stage] += (now - start) * 1e3

    def reset(self) -> None:
        self.forward_ms = [0.0] * len(self.forward_ms)
        self.backward_ms = [0.0] * len(self.backward_ms)
        self._started.clear()
