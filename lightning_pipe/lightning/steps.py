"""The schedule-driven training step (1F1B, 2BW) inside Lightning's loop.

Lightning's loop calls ``training_step`` once per batch and then runs backward. Under 1F1B
and 2BW each micro-batch's backward must run at its place in the schedule, so the strategy
calls the user's ``training_step`` once per micro-batch, runs the backwards itself in the
schedule's order, fires the hooks Lightning would have fired, and returns the batch loss.
"""

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call
from torch import Tensor
from torch.optim import Optimizer

from lightning_pipe.graph.microbatch import batch_size, scatter
from lightning_pipe.lightning.microlog import LogCollector
from lightning_pipe.plan.schedule import Schedule, actions, global_order
from lightning_pipe.runtime.scheduled import ScheduledPipeline
from lightning_pipe.runtime.versions import WeightVersions

__all__ = ["ScheduledStep"]


@dataclass
class ScheduledStep:
    """Runs one batch of ``training_step`` under a schedule-driven pipeline."""

    pipeline: ScheduledPipeline
    schedule: Schedule
    chunks: int
    precision: Precision
    versions: WeightVersions | None = None

    def __call__(
        self, module: LightningModule, optimizer: Optimizer, stepping: bool, batch: Any, batch_idx: int,
        *args: Any, **kwargs: Any,
    ) -> Tensor:
        """``training_step`` per micro-batch, each backward at its place in the schedule,
        gradients scaled and zeroed as Lightning would. ``stepping``: the optimizer steps
        after this batch (2BW then makes the current weights the stale version)."""
        trainer = module.trainer
        microbatches = scatter(batch, self.chunks)
        sizes = [batch_size(mb) for mb in microbatches]
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            call._call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer)
            call._call_lightning_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer)
        stages = len(self.pipeline.program.stages)
        order = global_order(actions(self.schedule, self.chunks, stages))
        logs = LogCollector(module, sizes)
        losses: dict[int, Tensor] = {}
        scaler = getattr(self.precision, "scaler", None)
        with self.versions.stale_weights() if self.versions else nullcontext():
            for step in order:
                if step.kind == "forward":
                    self.pipeline.microbatch = step.microbatch
                    with logs.microbatch(step.microbatch), self.precision.train_step_context():
                        self.pipeline.active = True
                        try:
                            output = module.training_step(microbatches[step.microbatch], batch_idx, *args, **kwargs)
                        finally:
                            self.pipeline.active = False
                    losses[step.microbatch] = _loss_of(output)
                    continue
                loss = None
                if step.stage == stages - 1:
                    loss = losses[step.microbatch] * (sizes[step.microbatch] / sum(sizes) / accumulate)
                    if scaler is not None:
                        loss = scaler.scale(loss)
                self.pipeline.backward(step.microbatch, step.stage, loss)
                if loss is not None:  # its graph would keep the output leaf and its gradient alive
                    losses[step.microbatch] = losses[step.microbatch].detach()
        batch_loss = sum(losses[i] * (n / sum(sizes)) for i, n in enumerate(sizes))  # each detached after its backward
        call._call_callback_hooks(trainer, "on_before_backward", batch_loss)
        call._call_lightning_module_hook(trainer, "on_before_backward", batch_loss)
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
        logs.flush()
        if self.versions is not None and stepping:
            self.versions.advance()  # the optimizer is about to step: W(t) becomes the stale one
        return batch_loss


def _loss_of(output: Any) -> Tensor:
    loss = output["loss"] if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise ValueError(
            "Under a schedule-driven pipeline, training_step must return the loss (a tensor or a "
            "dict with 'loss') for every micro-batch; skipping a batch by returning None is not "
            "supported."
        )
    return loss
