"""Merge what ``training_step`` logs per micro-batch into what a whole-batch step logs.

A single-device step logs one value per name for the whole batch. Run once per micro-batch,
the same ``self.log`` calls would log each micro-batch's value, the last one winning. The
collector holds them back and logs their mean weighted by micro-batch size, which equals the
whole-batch value for per-sample means (losses, accuracies). Metric objects accumulate
across micro-batches by themselves and are logged once.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import Metric

__all__ = ["LogCollector"]


class LogCollector:
    """Collect ``module.log`` calls per micro-batch, then log each name once."""

    def __init__(self, module: LightningModule, sizes: Sequence[int]) -> None:
        self.module = module
        self.sizes = sizes
        self.calls: dict[str, list[tuple[int, Any, dict[str, Any]]]] = {}

    @contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        def log(name: str, value: Any, **kwargs: Any) -> None:
            self.calls.setdefault(name, []).append((index, value, kwargs))

        self.module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log

    def flush(self) -> None:
        """Log the merged values through the real ``self.log``."""
        total = sum(self.sizes)
        for name, calls in self.calls.items():
            _, value, kwargs = calls[-1]
            if not isinstance(value, Metric):
                weights = [self.sizes[i] for i, _, _ in calls]
                values = [torch.as_tensor(v, dtype=torch.float64) for _, v, _ in calls]
                value = (sum(w * v.detach().cpu() for w, v in zip(weights, values)) / sum(weights)).float()
                kwargs = {**kwargs, "batch_size": total}
            self.module.log(name, value, **kwargs)
        self.calls.clear()
