"""Peers on one nn.Sequential: torchgpipe 0.0.7 and ``torch.distributed.pipelining``.

Memory is observed the way our meter observes it (live tensor storages, through a dispatch
mode), with the whole process as one stage: peers give us no hook to tell their stages apart
inside one process, but ``torch.distributed.pipelining`` runs one process per stage.
"""

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from lightning_pipe.measure.meter import MemoryMeter

LR = 0.01


def sequential(width: int = 256, depth: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class SequentialModule(LightningModule):
    """The peers' nn.Sequential as a LightningModule, for our strategy: one fx node per layer."""

    def __init__(self, width: int = 256, depth: int = 16) -> None:
        super().__init__()
        self.net = sequential(width, depth)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def sequential_data(size: int, width: int = 256) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(size, width, generator=g), torch.randint(10, (size,), generator=g)
    return torch.utils.data.TensorDataset(inputs, labels)


class ProcessMeter(MemoryMeter):
    """Our meter with everything allocated while it is active charged to one stage."""

    def __init__(self) -> None:
        super().__init__(1)

    def _stage_now(self) -> tuple[int, str] | None:
        return 0, "transient"

    @property
    def peak(self) -> int:
        return self.stages[0].peak


# --- torchgpipe ------------------------------------------------------------------------------


@contextmanager
def _metered_workers(meter: ProcessMeter) -> Iterator[None]:
    """torchgpipe computes in worker threads, which do not inherit a dispatch mode: enter the
    meter in each worker too."""
    import torchgpipe.worker

    loop = torchgpipe.worker.worker

    def metered(*args: Any) -> None:
        with meter:
            loop(*args)

    torchgpipe.worker.worker = metered
    try:
        yield
    finally:
        torchgpipe.worker.worker = loop


def torchgpipe_steps(batch: int, chunks: int, stages: int, steps: int, warmup: int,
                     width: int = 256, depth: int = 16) -> dict[str, Any]:
    """torchgpipe's GPipe with its own balance_by_time over CPU partitions, no checkpointing:
    step times, and the process's peak bytes over the steps after ``warmup``."""
    from torchgpipe import GPipe
    from torchgpipe.balance import balance_by_time

    model = sequential(width, depth)
    x, y = sequential_data(batch, width).tensors
    balance = balance_by_time(stages, model, x[: batch // chunks], device=torch.device("cpu"))
    pipe = GPipe(model, balance, devices=["cpu"] * stages, chunks=chunks, checkpoint="never")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(pipe(x), y).backward()
        optimizer.step()

    times = timed_steps(step, steps)
    meter = ProcessMeter()
    meter.own(0, pipe.parameters())
    with _metered_workers(meter), meter:
        for _ in range(warmup):
            step()
        meter.reset_peaks()
        step()
    return {"step_ms": times, "balance": list(balance), "process_peak": meter.peak}


def timed_steps(step: Callable[[], None], steps: int, sync: bool = False) -> list[float]:
    """Each step's time in ms; ``sync``: the ranks start each step together and each time is
    the slowest rank's."""
    times = []
    for _ in range(steps):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor((time.perf_counter() - start) * 1e3)
        if sync:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return times


def spawn(rank_fn: Callable[..., None], world: int, *args: Any) -> None:
    """``rank_fn(rank, world, *args)`` in ``world`` processes joined in a gloo process group on
    this machine, each with its share of the cores."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_rank, args=(world, port, rank_fn, args), nprocs=world, join=True)


def _gloo_rank(rank: int, world: int, port: int, rank_fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rank_fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


# --- torch.distributed.pipelining ------------------------------------------------------------


def pipelining_steps(balance: list[int], batch: int, chunks: int, steps: int, warmup: int,
                     width: int = 256, depth: int = 16) -> dict[str, Any]:
    """``ScheduleGPipe`` over one gloo process per stage, each holding the layers ``balance``
    gives it: step times (slowest rank per step), each rank's peak bytes over the steps after
    ``warmup``, and the parameters after all steps."""
    with tempfile.TemporaryDirectory() as out:
        spawn(_pipelining_rank, len(balance), balance, batch, chunks, steps, warmup, width, depth, out)
        ranks = [json.loads((Path(out) / f"{r}.json").read_text()) for r in range(len(balance))]
        state = {}
        for r in range(len(balance)):
            state.update(torch.load(Path(out) / f"{r}.pt"))
    return {"step_ms": ranks[0]["step_ms"], "peaks": [r["peak"] for r in ranks], "threads": threads(len(balance)),
            "state_dict": state}


def _pipelining_rank(rank: int, world: int, balance: list[int], batch: int, chunks: int,
                     steps: int, warmup: int, width: int, depth: int, out: str) -> None:
    x, y = sequential_data(batch, width).tensors
    names, part, step = pipelining_stage(rank, world, balance, chunks, width, depth, x, y)
    times = timed_steps(step, steps, sync=True)
    torch.save({f"{name}.{k}": v for name, layer in zip(names, part) for k, v in layer.state_dict().items()},
               Path(out) / f"{rank}.pt")

    meter = ProcessMeter()  # a fresh stage, metered from its start: receive buffers included
    with meter:
        _, part, step = pipelining_stage(rank, world, balance, chunks, width, depth, x, y)
        meter.own(0, part.parameters())
        for _ in range(warmup):
            step()
        meter.reset_peaks()
        step()
    (Path(out) / f"{rank}.json").write_text(json.dumps({"step_ms": times, "peak": meter.peak}))


def pipelining_stage(rank: int, world: int, balance: list[int], chunks: int, width: int, depth: int,
                     x: Tensor, y: Tensor, schedule: type[PipelineScheduleSingle] = ScheduleGPipe,
                     ) -> tuple[list[str], nn.Sequential, Callable[[], None]]:
    """This rank's layers of :func:`sequential` as a ``PipelineStage`` on ``schedule``, and one
    training step."""
    first = sum(balance[:rank])
    names = [str(i) for i in range(first, first + balance[rank])]
    model = sequential(width, depth)
    part = nn.Sequential(*(model[i] for i in range(first, first + balance[rank])))
    scheduled = schedule(PipelineStage(part, rank, world, torch.device("cpu")), n_microbatches=chunks,
                         loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(part.parameters(), lr=LR)

    def step() -> None:
        optimizer.zero_grad()
        if rank == 0:
            scheduled.step(x)
        elif rank == world - 1:
            scheduled.step(target=y)
        else:
            scheduled.step()
        optimizer.step()

    return names, part, step
