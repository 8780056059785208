"""Report: a plan as a console table, a JSON file and a plot of memory and time per stage.

The plot draws on a bare :class:`matplotlib.figure.Figure`, imported only when a plot is
saved: pyplot would register the figure with the process's plotting state and choosing a
backend would override the user's (a notebook's inline display).
"""

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.table import Table

from lightning_pipe.plan.plan import Plan
from lightning_pipe.units import format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.container import BarContainer
    from matplotlib.figure import Figure

__all__ = ["figure", "save", "show", "table"]

_KINDS = ("static", "activations", "transient", "boundary")
# A planning target above this multiple of the tallest bar is written as text, not drawn:
# drawn, it would squash the bars into the bottom of the axis.
_OFF_SCALE = 2.0


def table(plan: Plan, devices: list[torch.device]) -> Table:
    """One row per stage, within 100 columns: device, nodes, parameters, one micro-batch's
    activations and the predicted peak against the planning target, time per micro-batch,
    bytes recomputed and swapped (every term of the peak: ``plan.json`` and :func:`figure`)."""
    t = Table(title=f"lightning_pipe plan: {plan.partitioner}, {plan.schedule}, "
                    f"{plan.chunks} micro-batches of {plan.microbatch_size}")
    for name in ("stage", "device", "nodes", "params", "activations", "peak", "target", "ms", "recomputed",
                 "swapped"):
        t.add_column(name, justify="right")
    for s, (r, target) in enumerate(zip(plan.stages, _targets(plan))):
        t.add_row(
            str(s), str(devices[s]), f"{r.start}-{r.stop - 1}",
            *(format_bytes(v) for v in (r.param_bytes, r.peak.activations, r.peak.total, target)),
            f"{r.time_ms:.2f}", format_bytes(r.recomputed_bytes), format_bytes(r.swapped_bytes),
        )
    t.caption = (f"simulated step {plan.step_ms:.1f} ms, bubble {plan.bubble:.0%}; ms per micro-batch; target: the "
                 f"memory limit, less the memory model's error where a fake training step measured one")
    return t


def _targets(plan: Plan) -> list[int]:
    """Each stage's planning target: its process's, which several stages of one process share."""
    return [plan.targets[plan.process(s)] for s in range(len(plan.stages))]


def show(plan: Plan, devices: list[torch.device]) -> None:
    console = Console()
    console.width = max(console.width, 100)  # whole columns where output is not a terminal (80 wide)
    console.print(table(plan, devices))


def save(plan: Plan, folder: str | Path, metered: Sequence[int] = ()) -> None:
    """Write ``plan.json`` and ``plan.png`` (:func:`figure`, with the ``metered`` peaks)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.json").write_text(plan.to_json())
    figure(plan, metered).savefig(folder / "plan.png", dpi=100)


def figure(plan: Plan, metered: Sequence[int] = ()) -> "Figure":
    """Per stage, the predicted peak memory by kind against the planning target (and, after
    training, each stage's ``metered`` peak beside it: how the plan held), and the time per
    micro-batch. The figure is not registered with pyplot: it neither shows up in a
    notebook's ``plt.show()`` nor stays open, unless you display or keep it."""
    from matplotlib.figure import Figure

    if metered and len(metered) != len(plan.stages):
        raise ValueError(f"{len(metered)} metered peaks given for a plan of {len(plan.stages)} stages.")
    fig = Figure(figsize=(11, 5), layout="constrained")
    memory, time = fig.subplots(1, 2)
    fig.suptitle(f"{plan.partitioner}, {plan.schedule}, {plan.chunks} micro-batches of {plan.microbatch_size}: "
                 f"simulated step {plan.step_ms:.1f} ms, bubble {plan.bubble:.0%}")
    _memory_axes(memory, plan, metered)
    parts = {"forward": "forward_ms", "backward": "backward_ms", "recompute": "recompute_ms", "exposed swap": "swap_ms"}
    _stacked(time, {label: [getattr(r, attr) for r in plan.stages] for label, attr in parts.items()})
    time.set_ylim(0, max(r.time_ms for r in plan.stages) * 1.1 or 1)  # stacked bars pin no top margin
    time.set(title="time per micro-batch per stage", ylabel="ms")
    time.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    return fig


def _stacked(ax: "Axes", parts: dict[str, list[float]]) -> "BarContainer":
    """One bar per stage stacking ``parts`` in order; returns the top part's bars."""
    stages = range(len(next(iter(parts.values()))))
    bottom = [0.0] * len(stages)
    for label, values in parts.items():
        bars = ax.bar(stages, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="stage", xticks=list(stages))
    return bars


def _memory_axes(ax: "Axes", plan: Plan, metered: Sequence[int]) -> None:
    """Stacked peak bars, with their totals under the stage numbers, in a unit that suits them, against each
    stage's planning target as a dashed step, and each ``metered`` peak as a mark across its
    bar. A target far above the bars would squash them: the axis stops above the bars, a
    triangle on its top edge marks the stage and the legend gives the size."""
    peaks, targets = [r.peak.total for r in plan.stages], _targets(plan)
    off = [s for s, t in enumerate(targets) if t > _OFF_SCALE * max(peaks, default=0)]
    top = max([*peaks, *metered, *(t for s, t in enumerate(targets) if s not in off)]) or 1
    unit, scale = next(((u, f) for u, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= f), ("B", 1))
    _stacked(ax, {kind: [getattr(r.peak, kind) / scale for r in plan.stages] for kind in _KINDS})
    ax.set_xticks(range(len(peaks)), [f"{s}\n{format_bytes(p)}" for s, p in enumerate(peaks)])
    ax.set_ylim(0, top * 1.12 / scale)
    label = "planning target"
    if off:
        sizes = sorted({format_bytes(targets[s]) for s in off})
        label += f" (\u25b2 off scale: {', '.join(sizes)})"
        ax.plot(off, [top * 1.07 / scale] * len(off), "^", color="black", markersize=9)
    edges = [s - 0.5 for s in range(len(peaks) + 1)]
    ax.step(edges, [t / scale for t in targets + targets[-1:]], where="post", color="black",
            linestyle="--", label=label)
    if metered:
        ax.plot(range(len(metered)), [m / scale for m in metered], "_", color="crimson", markersize=40,
                markeredgewidth=3, label="metered peak")
    title = "predicted and metered peak memory per stage" if metered else "predicted peak memory per stage"
    ax.set(title=title, xlabel="stage, predicted peak", ylabel=unit)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
