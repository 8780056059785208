"""Simulated step time against the measured one, per schedule the distributed runtime runs:
``MemoryPipeStrategy(runtime="distributed", schedule=...)`` at pp=2 over gloo, one CPU thread
per process, on the examples' GPT-style LM (tied embeddings) at a width where compute dominates.

    python -m benchmarks.schedule_time [--width 256] [--layers 8] [--context 64] [--batch 16] [--chunks 8]

(about a minute and 85-105 CPU seconds on a 2-core CPU, steps of about 400 ms.)

Each schedule trains in the same two processes: the strategy profiles one micro-batch and
plans (dawnpiper, memory to spare) as it does for a user, then trains; the measured step is
the median, after warm-up, of the time between consecutive batch starts on rank 0 (the
steady period: every process's step, the optimizer's update and Lightning's own work
included). Simulated is the plan's ``step_ms``: the schedule's action order replayed on the
profile's node times. Beside them: the time each process computes in the simulated step
("sim busy"), the CPU time it took per step (median; what the measured step holds beyond it
is waiting, or on a loaded machine time the process did not get a core) and the 1-minute load
average over the timed steps. Wall times on a loaded machine stretch the profile and the
steps, not always alike: the profile's node times then move by 15% from one fit to the next
(sim busy against CPU under the same schedule).

What the simulator leaves out shows in the rows of the schedules that split every backward
(interleaved-zb, zbv; dualpipev splits 2 or 3 of a process's 16): ``pipelining``'s split
backward costs more than the whole on a CPU (torch 2.13, a 4-block stage of this GPT: input
half 0.6, weight half 0.73 of ``stage_backward``), which the even split of the profiled
backward (:data:`~lightning_pipe.plan.simulate.INPUT_SHARE`) does not price: their CPU per
step is above their sim busy, and they come out 10-15% under. The excess is about constant
per stage (some 10 ms a micro-batch for 4 blocks at width 256 or 512: halves 1.38x the whole
backward at 256, 1.08x at 512): ``pipelining``'s own work in the weight half, not compute.
"""

import argparse
import datetime
import itertools
import json
import os
import resource
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from lightning.pytorch import Callback, Trainer

from benchmarks.run import commit, cpu_model
from examples.models import GPT, TokenDataset, loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.plan.schedule import DistributedSchedule

SCHEDULES: tuple[DistributedSchedule, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv",
                                              "dualpipev")
WITHIN = 0.25  # the bound on |simulated / measured - 1|


class _Starts(Callback):
    """When each training batch starts (a clock every process on the machine shares), and the
    load average while the timed steps run."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.load: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.load.append(os.getloadavg()[0])


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """Train each schedule in turn in this process (Lightning's process group, launched here)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows = {}
    for schedule in args.schedules:
        torch.manual_seed(0)
        model = GPT(dim=args.width, heads=args.width // 64, layers=args.layers, context=args.context)
        data = TokenDataset(args.batch * (args.warmup + args.steps + 1), context=args.context)
        strategy = MemoryPipeStrategy(runtime="distributed", stages=world, schedule=schedule, chunks=args.chunks,
                                      planner="dawnpiper")
        starts = _Starts()
        trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.warmup + args.steps + 1,
                          callbacks=[starts], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(model, loader(data, args.batch))
        plan = strategy.plan
        assert plan is not None
        rows[schedule] = {
            "simulated_ms": plan.step_ms, "bubble": plan.bubble,
            "steps_ms": _periods(starts.starts[args.warmup:]), "cpu_ms": _periods(starts.cpu[args.warmup:]),
            "load": statistics.mean(starts.load[args.warmup:]),
            "busy_ms": [plan.chunks * sum(r.forward_ms + r.backward_ms + r.recompute_ms + r.swap_ms
                                          for s, r in enumerate(plan.stages) if plan.process(s) == p)
                        for p in range(world)],
        }
    (Path(out) / f"{rank}.json").write_text(json.dumps(rows))


def _periods(starts: list[float]) -> list[float]:
    """Milliseconds from each step's start to the next's."""
    return [(b - a) * 1e3 for a, b in itertools.pairwise(starts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(2, port, args, out), nprocs=2, join=True)
        rows = json.loads((Path(out) / "0.json").read_text())
        other = json.loads((Path(out) / "1.json").read_text())
    print(f"commit {commit()}, torch {torch.__version__}, {cpu_model()}, {os.cpu_count()} cores, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"gloo, pp=2, 1 thread per process; GPT width {args.width}, "
          f"{args.layers} layers, context {args.context}, batch {args.batch}, {args.chunks} micro-batches; "
          f"median of {args.steps} steps after {args.warmup}")
    print(f"{'schedule':<18} {'simulated ms':>12} {'measured ms':>12} {'sim/meas':>9}  {'within 25%':<10} "
          f"{'sim bubble':>10} {'sim busy ms/rank':>16} {'CPU ms/rank':>12} {'load':>5}")
    within = 0
    for schedule, row in rows.items():
        measured = statistics.median(row["steps_ms"])
        ratio = row["simulated_ms"] / measured
        busy = "/".join(f"{b:.0f}" for b in row["busy_ms"])
        cpu = "/".join(f"{statistics.median(r[schedule]['cpu_ms']):.0f}" for r in (rows, other))
        print(f"{schedule:<18} {row['simulated_ms']:>12.1f} {measured:>12.1f} {ratio:>9.2f}  "
              f"{'yes' if abs(ratio - 1) <= WITHIN else 'no':<10} {row['bubble']:>10.1%} {busy:>16} {cpu:>12} "
              f"{row['load']:>5.2f}")
        within += abs(ratio - 1) <= WITHIN
    used = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{within} of {len(rows)} within {WITHIN:.0%}; load average (1, 5, 15 min) at the end "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; {sum(u.ru_utime + u.ru_stime for u in used):.0f} CPU s "
          f"in all")


if __name__ == "__main__":
    main()
