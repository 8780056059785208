"""Merge what ``training_step`` logs per micro-batch into what a whole-batch step logs.

A single-device step logs one value per name for the whole batch. Run once per micro-batch,
the same ``self.log`` calls would log each micro-batch's value, the last one winning. The
collector holds them back and logs each name once:

- a value a torchmetrics ``Metric`` returned (``self.log("acc", self.acc(preds, y))``): the
  metric over the whole batch. A twin of the metric, reset at its first call in the step,
  is updated with every micro-batch's inputs, so this holds for any metric (a macro
  average, an F1), not only for per-sample means;
- a ``Metric`` object: the object, once, with its step value (what Lightning logs for
  ``on_step``) set to the whole batch's as above. Its own state has taken in every
  micro-batch, so its epoch value is single-device training's;
- the returned loss under ``loss_reduction="sum"``: the sum over micro-batches;
- any other value: its mean weighted by micro-batch size, which equals the whole-batch value
  for per-sample means (mean losses, micro-averaged accuracies).
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torchmetrics import Metric

from lightning_pipe.internals import tree_flatten
from lightning_pipe.lightning.internals import copy_metric, set_step_value, set_sync_on_step

__all__ = ["LogCollector", "LossReduction", "silenced"]

LossReduction = Literal["mean", "sum"]


@dataclass
class _Logged:
    """One ``self.log`` call of one micro-batch."""

    microbatch: int
    value: Any  # a detached tensor, a number or a Metric
    kwargs: dict[str, Any]
    source: tuple[int, int] | None = None  # the value is output leaf k of a metric's forward: (id(metric), k)
    is_loss: bool = False


class LogCollector:
    """Collect ``module.log`` calls per micro-batch, then log each name once.

    Use as a context manager around the step: while inside, every ``Metric`` of the module
    reports its forward calls to the collector.
    """

    def __init__(self, module: LightningModule, sizes: Sequence[int], loss_reduction: LossReduction = "mean") -> None:
        self.module = module
        self.sizes = sizes
        self.loss_reduction = loss_reduction
        self.calls: dict[str, list[_Logged]] = {}
        self._twins: dict[int, tuple[Metric, Metric]] = {}  # id(metric): the metric and its whole-batch twin
        self._outputs: list[tuple[Tensor, int, int]] = []  # every forward output leaf: (it, id(metric), k)
        self._hooks: list[RemovableHandle] = []

    def __enter__(self) -> "LogCollector":
        # A function, not a bound method: Metric.clone deep-copies the hooks along with the
        # metric, and a bound method would copy the collector and the module with it.
        def forwarded(metric: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            assert isinstance(metric, Metric)
            self._forwarded(metric, args, kwargs, output)

        for m in self.module.modules():
            if isinstance(m, Metric):
                self._hooks.append(m.register_forward_hook(forwarded, with_kwargs=True))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """Route ``module.log`` into the collector while micro-batch ``index`` runs."""

        def log(name: str, value: Any, **kwargs: Any) -> None:
            source = next(((m, k) for out, m, k in self._outputs if out is value), None)
            if isinstance(value, Tensor):
                value = value.detach()  # an attached loss would keep the micro-batch's graph alive
            self.calls.setdefault(name, []).append(_Logged(index, value, kwargs, source))

        self.module.log = log  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            del self.module.log

    def returned(self, index: int, loss: Tensor) -> None:
        """``training_step`` of micro-batch ``index`` returned ``loss``: values logged that are
        this tensor (or a detached view of it) are combined as the loss is."""
        for calls in self.calls.values():
            for c in calls:
                if c.microbatch == index and isinstance(c.value, Tensor) and _same(c.value, loss):
                    c.is_loss = True

    def flush(self) -> None:
        """Log the merged values through the real ``self.log``."""
        total = sum(self.sizes)
        batch_values = {key: twin.compute() for key, (_, twin) in self._twins.items()}
        for key, (metric, _) in self._twins.items():
            set_step_value(metric, batch_values[key])  # what Lightning logs for a Metric with on_step=True
        for name, calls in self.calls.items():
            value, kwargs = calls[-1].value, calls[-1].kwargs
            if not isinstance(value, Metric):
                sources = {c.source for c in calls}
                source = sources.pop() if len(sources) == 1 else None
                if source is not None:
                    value = tree_flatten(batch_values[source[0]])[0][source[1]]
                else:
                    value = self._combine(calls)
                kwargs = {**kwargs, "batch_size": total}
            self.module.log(name, value, **kwargs)
        self.calls.clear()
        self._twins.clear()
        self._outputs.clear()

    def _combine(self, calls: list[_Logged]) -> Tensor:
        values = torch.stack([torch.as_tensor(c.value, dtype=torch.float64).cpu().reshape(()) for c in calls])
        if self.loss_reduction == "sum" and all(c.is_loss for c in calls):
            return values.sum().float()
        weights = torch.tensor([self.sizes[c.microbatch] for c in calls], dtype=torch.float64)
        return ((weights * values).sum() / weights.sum()).float()

    def _forwarded(self, metric: Metric, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """A metric's forward ran on one micro-batch: feed its twin the same inputs."""
        if id(metric) not in self._twins:
            twin = copy_metric(metric)
            twin.reset()
            set_sync_on_step(twin, metric.dist_sync_on_step)  # a step value syncs only as the metric's own forward does
            self._twins[id(metric)] = metric, twin
        self._twins[id(metric)][1].update(*args, **kwargs)
        # kept (not only their ids) so that a freed output's id cannot be taken by a later value
        leaves = tree_flatten(output)[0]
        self._outputs.extend((t, id(metric), k) for k, t in enumerate(leaves) if isinstance(t, Tensor))


@contextmanager
def silenced(module: LightningModule) -> Iterator[None]:
    """Inside, ``self.log`` does nothing and every ``Metric`` of the module is a copy of
    itself: a probing run of ``training_step`` leaves nothing logged or accumulated."""
    metrics = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if isinstance(child, Metric)]
    for parent, name, child in metrics:
        parent.register_module(name, copy_metric(child))
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log
        for parent, name, child in metrics:
            parent.register_module(name, child)


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is ``b`` or a detached view of all of it."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
