"""Distributed runtime vs torch.distributed.pipelining's own 1F1B on the same split, and vs
our one-process runtime and our Interleaved 1F1B (two stages per rank, the split by parameter
bytes over twice the stages): step time and peak bytes per rank, on CPU processes over gloo.

    python -m benchmarks.distributed [--stages 2] [--width 256] [--depth 16] [--batch 64] [--chunks 4]

The model is the peers' ``nn.Sequential`` (one graph node per layer, so a balance in nodes is
a balance in layers and both pipelines get the same split). Peaks are every storage live in
the rank's process during one step (:class:`benchmarks.peers.ProcessMeter`), parameters
included; step times are taken unmetered. CPU figures: the ranks share this machine's cores.
"""

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B

from benchmarks.peers import (
    LR,
    ProcessMeter,
    SequentialModule,
    pipelining_stage,
    sequential_data,
    spawn,
    timed_steps,
)
from lightning_pipe.graph.capture import capture
from lightning_pipe.plan.balance import balance_by_weight
from lightning_pipe.runtime.build import Program, build
from lightning_pipe.runtime.distributed import DistributedPipeline, cuts
from lightning_pipe.runtime.gpipe import Pipeline


def _measure(step: Callable[[], None], steps: int, meter: ProcessMeter, sync: bool) -> tuple[list[float], int]:
    """Step times (unmetered; the slowest rank's), then the peak of one metered step."""
    step()  # warm-up
    times = timed_steps(step, steps, sync)
    with meter:
        meter.reset_peaks()
        step()
    return times, meter.peak


def _program(stages: int, args: argparse.Namespace, place: bool) -> tuple[SequentialModule, Tensor, Tensor, Program]:
    """The peers' model split evenly by parameter bytes, and its data."""
    module = SequentialModule(args.width, args.depth)
    x, y = sequential_data(args.batch, args.width).tensors
    captured = capture(module)
    program = build(captured, module, balance_by_weight(captured.param_bytes(), stages),
                    [torch.device("cpu")] * stages, place=place)
    return module, x, y, program


def _ours(rank: int, stages: int, args: argparse.Namespace, virtual: int = 1) -> tuple[list[float], int]:
    """Our distributed runtime; ``virtual`` stages per rank: Interleaved 1F1B."""
    module, x, y, program = _program(stages * virtual, args, place=False)
    mesh = init_device_mesh("cpu", (stages, 1), mesh_dim_names=("pp", "dp"))
    sample = x[: args.batch // args.chunks]
    labels = y.chunk(args.chunks)

    def loss_fn(output: Any, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output, labels[int(target)]) / args.chunks

    meter = ProcessMeter()
    with meter:
        pipe = DistributedPipeline(program, module, cuts(program, module, (sample,), {}), mesh, "1f1b",
                                   args.chunks, loss_fn, torch.device("cpu"))
        meter.own(0, pipe.held)
        optimizer = torch.optim.SGD(module.parameters(), lr=LR)

    def step() -> None:
        optimizer.zero_grad()
        pipe.rank.train_step(program.bind((x,), {}) if rank == 0 else None)
        optimizer.step()

    return _measure(step, args.steps, meter, sync=True)


def _theirs(rank: int, stages: int, args: argparse.Namespace) -> tuple[list[float], int]:
    x, y = sequential_data(args.batch, args.width).tensors
    balance = balance_by_weight(capture(SequentialModule(args.width, args.depth)).param_bytes(), stages)
    meter = ProcessMeter()
    with meter:
        _, part, step = pipelining_stage(rank, stages, balance, args.chunks, args.width, args.depth, x, y,
                                         Schedule1F1B)
        meter.own(0, part.parameters())
    return _measure(step, args.steps, meter, sync=True)


def _rank(rank: int, stages: int, args: argparse.Namespace, out: str) -> None:
    result = {}
    runs = (("lightning_pipe distributed 1F1B", _ours), ("torch pipelining Schedule1F1B", _theirs),
            ("lightning_pipe interleaved 1F1B, v=2", partial(_ours, virtual=2)))
    for name, run in runs:
        times, peak = run(rank, stages, args)
        result[name] = {"step_ms": times, "peak": peak}
    (Path(out) / f"{rank}.json").write_text(json.dumps(result))


def _local(stages: int, args: argparse.Namespace) -> tuple[list[float], int]:
    """Our one-process runtime (GPipe over ``stages`` stages on the CPU): the whole process."""
    module, x, y, program = _program(stages, args, place=True)
    pipeline = Pipeline(program, module, args.chunks, torch.device("cpu"))
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    meter = ProcessMeter()
    meter.own(0, module.parameters())

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(pipeline(x), y).backward()
        optimizer.step()

    return _measure(step, args.steps, meter, sync=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        spawn(_rank, args.stages, args, out)
        ranks = [json.loads((Path(out) / f"{r}.json").read_text()) for r in range(args.stages)]
    print(f"CPU, {os.cpu_count()} cores, gloo; Sequential width {args.width} depth {args.depth}, batch {args.batch}, "
          f"chunks {args.chunks}, {args.stages} stages; median of {args.steps} steps")
    print(f"{'runtime':<36} {'step ms':>9}  peak MiB per rank")
    for name in ranks[0]:
        times = sorted(ranks[0][name]["step_ms"])
        peaks = ", ".join(f"{r[name]['peak'] / 2**20:.2f}" for r in ranks)
        print(f"{name:<36} {times[len(times) // 2]:>9.1f}  {peaks}")
    times, peak = _local(args.stages, args)
    times.sort()
    name = "lightning_pipe local GPipe (1 proc)"
    print(f"{name:<36} {times[len(times) // 2]:>9.1f}  {peak / 2**20:.2f} (whole process)")


if __name__ == "__main__":
    main()
