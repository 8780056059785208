"""Run: GPipe over a built :class:`~lightning_pipe.runtime.build.Program`, driven by autograd.

Calling the pipeline splits the inputs into micro-batches, runs every (micro-batch, stage)
task in clock-cycle order and returns the merged output; ``backward`` on anything computed
from that output runs the pipelined backward, micro-batches in reverse order per stage.
"""

from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.node import map_aggregate

from lightning_pipe.graph.microbatch import gather, scatter
from lightning_pipe.measure.clock import StageClock
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.plan.schedule import clock_cycles
from lightning_pipe.runtime.batchnorm import DeferredBatchNorm
from lightning_pipe.runtime.build import Program, Stage
from lightning_pipe.runtime.dependency import fork, join

__all__ = ["Pipeline"]


class Pipeline:
    """The pipelined ``forward`` of ``root``, split into ``chunks`` micro-batches.

    A call is one batch: ``batch_norm``'s layers update their running statistics once, at
    its end.
    """

    def __init__(
        self,
        program: Program,
        root: nn.Module,
        chunks: int,
        output_device: torch.device,
        meter: MemoryMeter | None = None,
        clock: StageClock | None = None,
        batch_norm: DeferredBatchNorm | None = None,
    ) -> None:
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}.")
        self.program = program
        self.root = root
        self.chunks = chunks
        self.output_device = output_device
        self.meter = meter
        self.clock = clock
        self.batch_norm = batch_norm

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self.program.bind(args, kwargs)
        self.program.lender.new_batch()
        attributes = self.program.attribute_values(self.root)
        envs = [{**mb, **attributes} for mb in scatter(inputs, self.chunks)]
        stages = self.program.stages
        previous: list[str | None] = [None] * len(stages)  # forked output name per stage
        for tick in clock_cycles(len(envs), len(stages)):
            for i, j in tick:
                previous[j] = self._run(stages[j], envs, i, previous[j])
        if self.batch_norm is not None:
            self.batch_norm.commit()
        outputs = [map_aggregate(self.program.output, env.__getitem__) for env in envs]
        if self.meter is None:
            return gather(outputs, self.output_device)
        with self.meter.running(len(stages) - 1):  # the output device is the last stage's
            output = gather(outputs, self.output_device)
        self.meter.mark([output], "boundary")
        return output

    def _run(self, stage: Stage, envs: list[dict[str, Any]], i: int, forked: str | None) -> str | None:
        env = envs[i]
        with self.meter.running(stage.index) if self.meter else nullcontext():
            inputs = [self.program.fetch(name, env[name], stage.device) for name in stage.inputs]
            if forked is not None:
                # Stage's backward for micro-batch i-1 waits for micro-batch i's.
                k = _first_grad_tensor(inputs)
                if k is not None:
                    envs[i - 1][forked], phony = fork(envs[i - 1][forked])
                    inputs[k] = join(inputs[k], phony)
            with self.clock.forward(stage.index, stage.device) if self.clock else nullcontext():
                outputs = stage(*inputs)
        if self.clock and torch.is_grad_enabled():
            self.clock.watch_backward(outputs, stage.index)
        if self.meter:
            self.meter.tag_backward(outputs, stage.index)
            self.meter.mark(outputs, "boundary")
        env.update(zip(stage.outputs, outputs))
        for name in [n for n in env if self.program.last_use.get(n, len(self.program.stages)) <= stage.index]:
            del env[name]
        k = _first_grad_tensor([env.get(name) for name in stage.outputs])
        return stage.outputs[k] if k is not None else None


def _first_grad_tensor(values: list[Any]) -> int | None:
    for k, value in enumerate(values):
        if isinstance(value, Tensor) and value.requires_grad:
            return k
    return None
