"""Planning at the first training batch: the user's step on one micro-batch, metered.

The profile prices what the captured graph does; what ``training_step`` does around its
``self(...)`` (the loss, what it keeps of the output, the batch) only running it shows. Both
engines run it once, on the first micro-batch of the first training batch, with ``self(...)``
answered by the profiler's run of the graph: nothing logged, metrics untouched, the random
state restored.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from lightning_pipe.internals import tree_flatten
from lightning_pipe.lightning.microlog import silenced
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.plan.profile import Profile

__all__ = ["StepBytes", "probe_step"]


@dataclass
class StepBytes:
    """What one micro-batch's step holds outside the graph, on the last stage: the batch,
    the loss's peak over the output in forward and in backward, the loss itself, and the
    gradients the loss's backward makes for the graph's outputs."""

    batch: int
    loss: int
    loss_backward: int
    loss_kept: int
    loss_grads: int | None

    @classmethod
    def batch_only(cls, sample: Any) -> "StepBytes":
        """A step that stopped at its ``self(...)``: the batch is known, the loss is not."""
        return cls(_bytes(sample), 0, 0, 0, None)

    def record(self, profile: Profile) -> None:
        profile.batch_bytes = self.batch
        profile.loss_bytes, profile.loss_backward_bytes = self.loss, self.loss_backward
        profile.loss_kept_bytes, profile.loss_grad_bytes = self.loss_kept, self.loss_grads


def probe_step(
    module: LightningModule,
    sample: Any,
    batch_idx: int,
    meter: MemoryMeter,
    devices: Sequence[torch.device],
    output: Callable[[], Any],
    precision: Precision,
    grad: bool = True,
) -> StepBytes:
    """Run ``training_step`` on ``sample`` (one micro-batch) under ``meter`` (one stage), and
    its loss's backward down to ``output()``: the graph's output its ``self(...)`` returned, a
    leaf the profiler made. ``devices``: the CUDA devices whose random state to restore;
    ``precision``: the Trainer's, whose step context (autocast under ``bf16-mixed``) the step
    runs in as in training, so that the profile its ``self(...)`` makes sees the activations'
    dtype training makes (half the bytes of fp32 under bf16); ``grad``: whether to build the
    loss's graph at all (else only what runs up to ``self(...)`` matters: an exception raised
    there ends the probe)."""
    cuda = [d for d in devices if d.type == "cuda"]
    with (
        torch.random.fork_rng(cuda), torch.set_grad_enabled(grad), silenced(module), meter,
        meter.saved_tensors_hooks(), precision.train_step_context(),
    ):
        returned = meter.run_as(0, partial(module.training_step, sample, batch_idx))
        loss = returned["loss"] if isinstance(returned, Mapping) else returned
        forward = meter.stages[0].peak
        meter.reset_peaks()
        leaves = [t for t in tree_flatten(output())[0] if isinstance(t, Tensor) and t.requires_grad]
        grads: Sequence[Tensor | None] = []
        if isinstance(loss, Tensor) and loss.requires_grad and leaves:
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    batch = _bytes(sample)
    kept = loss.untyped_storage().nbytes() if isinstance(loss, Tensor) else 0
    made = sum(g.untyped_storage().nbytes() for g in grads if g is not None)
    return StepBytes(batch, forward, meter.stages[0].peak, kept, made)


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, Tensor))
