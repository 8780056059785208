"""The schedule-driven training step (1F1B, 2BW) inside Lightning's loop.

Lightning's loop calls ``training_step`` once per batch and then runs backward. Under 1F1B
and 2BW each micro-batch's backward must run at its place in the schedule, so the strategy
calls the user's ``training_step`` once per micro-batch, runs the backwards itself in the
schedule's order, fires the hooks Lightning would have fired, in Lightning's order, and
returns the batch loss.
"""

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from lightning_pipe.graph.microbatch import batch_size, scatter
from lightning_pipe.lightning.internals import call_callback_hooks, call_module_hook
from lightning_pipe.lightning.microlog import LogCollector, LossReduction
from lightning_pipe.plan.schedule import Schedule, actions, global_order
from lightning_pipe.runtime.scheduled import ScheduledPipeline
from lightning_pipe.runtime.versions import WeightVersions

__all__ = ["NO_FORWARD", "ScheduledStep"]

#: A user step that never ran the module's forward, under any schedule and either engine.
NO_FORWARD = (
    "{hook} never called the module's forward, which the pipeline runs: call self(...) in {hook} "
    "(self(**batch), not self.model(**batch) or its submodules directly)."
)


@dataclass
class ScheduledStep:
    """Runs one batch of ``training_step`` under a schedule-driven pipeline."""

    pipeline: ScheduledPipeline
    schedule: Schedule
    chunks: int
    precision: Precision
    versions: WeightVersions | None = None
    loss_reduction: LossReduction = "mean"

    def __call__(
        self, module: LightningModule, optimizer: Optimizer, stepping: bool, batch: Any, batch_idx: int,
        *args: Any, **kwargs: Any,
    ) -> Tensor:
        """``training_step`` per micro-batch, each backward at its place in the schedule,
        gradients scaled and zeroed as Lightning would. ``stepping``: the optimizer steps
        after this batch (2BW then makes the current weights the stale version).

        Each micro-batch's loss is weighted by its share of the batch (``loss_reduction=
        "mean"``) or taken as it is (``"sum"``), and divided by ``accumulate_grad_batches``.
        Lightning's order of hooks holds: ``training_step`` (of the first micro-batch), zero
        grad, ``on_before_backward``, the backwards, ``on_after_backward``. The batch loss is
        only known after the last forward, when earlier backwards have run, so
        ``on_before_backward`` receives the first micro-batch's loss as Lightning scales a
        batch loss (divided by ``accumulate_grad_batches``)."""
        trainer = module.trainer
        microbatches = scatter(batch, self.chunks)
        sizes = [batch_size(mb) for mb in microbatches]
        accumulate = trainer.accumulate_grad_batches
        stages = len(self.pipeline.program.stages)
        order = global_order(actions(self.schedule, len(microbatches), stages))  # fewer for a short batch
        losses: dict[int, Tensor] = {}
        scaler = getattr(self.precision, "scaler", None)
        weights = [n / sum(sizes) if self.loss_reduction == "mean" else 1.0 for n in sizes]
        backward_started = False
        stale = self.versions.stale_weights() if self.versions else nullcontext()
        with LogCollector(module, sizes, self.loss_reduction) as logs, stale:
            for step in order:
                if step.kind == "forward":
                    self.pipeline.microbatch = step.microbatch
                    with logs.microbatch(step.microbatch), self.precision.train_step_context():
                        self.pipeline.active = True
                        try:
                            microbatch = microbatches[step.microbatch]
                            run = partial(module.training_step, microbatch, batch_idx, *args, **kwargs)
                            meter = self.pipeline.meter  # the loss lives on the last stage's device
                            output = meter.run_as(stages - 1, run) if meter else run()
                        finally:
                            self.pipeline.active = False
                    if not self.pipeline.ran(step.microbatch):
                        raise RuntimeError(NO_FORWARD.format(hook="training_step"))
                    losses[step.microbatch] = _loss_of(output)
                    logs.returned(step.microbatch, losses[step.microbatch])
                    del output  # its graph would keep the outputs alive through the next forward, past their backward
                    continue
                if not backward_started:
                    backward_started = True
                    _before_backward(module, optimizer, batch_idx, losses[step.microbatch] / accumulate)
                assert step.stage is not None  # a backward runs on one stage
                loss = None
                if step.stage == stages - 1:
                    loss = losses[step.microbatch] * (weights[step.microbatch] / accumulate)
                    if scaler is not None:
                        loss = scaler.scale(loss)
                self.pipeline.backward(step.microbatch, step.stage, loss)
                if loss is not None:  # its graph would keep the output leaf and its gradient alive
                    losses[step.microbatch] = losses[step.microbatch].detach()
                del loss  # and so would the weighted loss's, through the next forward
        batch_loss = torch.stack([losses[i] * w for i, w in enumerate(weights)]).sum()  # each detached already
        call_callback_hooks(trainer, "on_after_backward")
        call_module_hook(trainer, "on_after_backward")
        logs.flush()
        if self.versions is not None and stepping:
            self.versions.advance()  # the optimizer is about to step: W(t) becomes the stale one
        return batch_loss


def _before_backward(module: LightningModule, optimizer: Optimizer, batch_idx: int, loss: Tensor) -> None:
    """What Lightning runs between ``training_step`` and backward: zero grad at the start of
    an accumulation window, then ``on_before_backward``."""
    trainer = module.trainer
    if batch_idx % trainer.accumulate_grad_batches == 0:
        call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
        call_module_hook(trainer, "on_before_zero_grad", optimizer)
        call_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer)
    call_callback_hooks(trainer, "on_before_backward", loss)
    call_module_hook(trainer, "on_before_backward", loss)


def _loss_of(output: Any) -> Tensor:
    loss = output["loss"] if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise ValueError(
            "Under a schedule-driven pipeline, training_step must return the loss (a tensor or a "
            "dict with 'loss') for every micro-batch; skipping a batch by returning None is not "
            "supported."
        )
    return loss
