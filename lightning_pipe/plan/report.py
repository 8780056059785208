"""Report: a plan as a console table, a JSON file and a plot of memory and time per stage."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed

import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.table import Table

from lightning_pipe.plan.plan import Plan
from lightning_pipe.units import mib

__all__ = ["save", "show", "table"]

_KINDS = ("static", "activations", "transient", "boundary")


def table(plan: Plan, devices: list[torch.device]) -> Table:
    """One row per stage: device, nodes, parameters, predicted peak by kind against the
    capacity, time per micro-batch, bytes recomputed and swapped."""
    t = Table(title=f"lightning_pipe plan: {plan.partitioner}, {plan.schedule}, "
                    f"{plan.chunks} micro-batches of {plan.microbatch_size}")
    for name in ("stage", "device", "nodes", "params", *_KINDS, "peak", "capacity", "ms/micro-batch", "recomputed", "swapped"):
        t.add_column(name, justify="right")
    for s, (r, cap) in enumerate(zip(plan.stages, plan.capacities)):
        peak = r.peak
        t.add_row(
            str(s), str(devices[s]), f"{r.start}-{r.stop - 1}", mib(r.param_bytes),
            *(mib(getattr(peak, k)) for k in _KINDS), mib(peak.total), mib(cap),
            f"{r.time_ms:.2f}", mib(r.recomputed_bytes), mib(r.swapped_bytes),
        )
    t.caption = f"simulated step {plan.step_ms:.1f} ms, bubble {plan.bubble:.0%}"
    return t


def show(plan: Plan, devices: list[torch.device]) -> None:
    console = Console()
    console.width = max(console.width, 150)  # the table is wide; do not squeeze it into 80 columns
    console.print(table(plan, devices))


def save(plan: Plan, folder: str | Path) -> None:
    """Write ``plan.json`` and ``plan.png`` (memory by kind against capacity, and time, per stage)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.json").write_text(plan.to_json())
    stages = range(len(plan.stages))
    fig, (memory, time) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0.0] * len(plan.stages)
    for kind in _KINDS:
        values = [getattr(r.peak, kind) / 2**20 for r in plan.stages]
        memory.bar(stages, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    memory.step([s - 0.5 for s in stages] + [len(plan.stages) - 0.5],
                [c / 2**20 for c in plan.capacities] + [plan.capacities[-1] / 2**20],
                where="post", color="black", linestyle="--", label="capacity")
    memory.set(title="predicted peak memory per stage", xlabel="stage", ylabel="MiB", xticks=list(stages))
    memory.legend()
    parts = {"forward": "forward_ms", "backward": "backward_ms", "recompute": "recompute_ms", "exposed swap": "swap_ms"}
    bottom = [0.0] * len(plan.stages)
    for label, attr in parts.items():
        values = [getattr(r, attr) for r in plan.stages]
        time.bar(stages, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    time.set(title="time per micro-batch per stage", xlabel="stage", ylabel="ms", xticks=list(stages))
    time.legend()
    fig.tight_layout()
    fig.savefig(folder / "plan.png", dpi=100)
    plt.close(fig)
