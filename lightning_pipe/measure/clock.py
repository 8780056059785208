"""Measure: time each stage spends in forward and backward, per training step.

Forward is timed around each stage call, the schedule-driven backward around each stage's
backward call. The autograd-driven backward runs inside autograd, so a hook on each stage's
output marks when that stage's backward of a micro-batch starts; it ends when the next one
starts (in the order the host reaches them) or when backward returns. Every mark is an event
on the stage device's stream (:mod:`lightning_pipe.stream`): on CUDA the times are the
device's, not the host's launch times, read at the end of the step (reading waits for the
events); on the CPU they are wall-clock times.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.internals import tree_flatten
from lightning_pipe.stream import AbstractEvent, current_stream, elapsed_ms, record_event

__all__ = ["StageClock"]


class StageClock:
    """Per-stage forward and backward milliseconds accumulated since the last ``reset``."""

    def __init__(self, num_stages: int) -> None:
        self._ms = {"forward": [0.0] * num_stages, "backward": [0.0] * num_stages}
        self._spans: list[tuple[str, int, AbstractEvent, AbstractEvent]] = []  # not read yet
        self._started: list[tuple[int, torch.device, AbstractEvent]] = []
        self._lock = threading.Lock()  # CUDA autograd runs hooks on one thread per device

    @property
    def forward_ms(self) -> list[float]:
        return self._read("forward")

    @property
    def backward_ms(self) -> list[float]:
        return self._read("backward")

    @contextmanager
    def forward(self, stage: int, device: torch.device) -> Iterator[None]:
        start = _mark(device)
        yield
        self._spans.append(("forward", stage, start, _mark(device)))

    @contextmanager
    def backward(self, stage: int, device: torch.device) -> Iterator[None]:
        start = _mark(device)
        yield
        self._spans.append(("backward", stage, start, _mark(device)))

    def watch_backward(self, outputs: Any, stage: int) -> None:
        """Mark, from inside autograd, when ``stage``'s backward of these outputs starts."""
        first = next((t for t in tree_flatten(outputs)[0] if isinstance(t, Tensor) and t.grad_fn is not None), None)
        if first is not None and first.grad_fn is not None:
            device = first.device
            first.grad_fn.register_prehook(lambda grads: self._start(stage, device))

    def _start(self, stage: int, device: torch.device) -> None:
        with self._lock:
            self._close()
            self._started.append((stage, device, _mark(device)))

    def end_backward(self) -> None:
        """Backward has returned: the last stage backward ends now."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._started:
            stage, device, start = self._started.pop()
            self._spans.append(("backward", stage, start, _mark(device)))

    def _read(self, kind: str) -> list[float]:
        with self._lock:
            for k, stage, start, end in self._spans:
                self._ms[k][stage] += elapsed_ms(start, end)
            self._spans.clear()
        return list(self._ms[kind])

    def reset(self) -> None:
        with self._lock:
            self._ms = {kind: [0.0] * len(ms) for kind, ms in self._ms.items()}
            self._spans.clear()
            self._started.clear()


def _mark(device: torch.device) -> AbstractEvent:
    return record_event(current_stream(device), timing=True)
