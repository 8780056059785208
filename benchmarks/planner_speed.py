"""How long the memory-centric planner takes, and what it buys on a CNN-like model.

    python -m benchmarks.planner_speed            # issue #47's sizes, and the CNN-like comparison
    python -m benchmarks.planner_speed --grid     # nodes x stages up to 20,000 x 64, as a table
    python -m benchmarks.planner_speed --grid --update-docs   # that table into docs/benchmarks.md

Synthetic profiles, no model and no device: a transformer-like chain of residual blocks for
speed (1F1B, capacity set so the first stages need recompute), and a CNN-like chain (conv nodes:
long compute, little memory; the others the reverse) for the largest micro-batch that fits.
Times are CPU seconds of this process (``time.process_time``: other jobs on a shared machine
slow it less than the wall clock), best of several; *pricings* count the stage peaks the
search composes (exact and bounds), which no load moves.
"""

import argparse
import datetime
import math
import os
import platform
import random
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_pipe.plan.memory import CostModel, StagePeak, stage_ranges
from lightning_pipe.plan.partitioners import partition
from lightning_pipe.plan.plan import max_microbatch
from lightning_pipe.plan.profile import NodeProfile, Profile
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.schedule import in_flight
from lightning_pipe.plan.stages import Stages

MiB = 1 << 20
# Issue #47's targets (ms) for dawnpiper with memory optimisation, by (nodes, stages): fast
# enough to plan again while training when memory drifts.
TARGETS_MS = {(1_000, 8): 20.0, (10_000, 32): 500.0, (5_000, 64): 1_000.0}


def transformer_like(num_nodes: int, seed: int = 0) -> Profile:
    """Blocks of 8 nodes; each block's input is also read by its last node (the residual add)."""
    rnd = random.Random(seed)
    nodes = []
    for i in range(num_nodes):
        k = i % 8
        heavy = k in (1, 4)  # attention / MLP matmuls
        f = rnd.uniform(0.8, 1.2) * (1.0 if heavy else 0.1)
        saved = int(rnd.uniform(0.8, 1.2) * (8 if heavy else 2) * MiB)
        users = [i + 1] if i + 1 < num_nodes else [-1]
        if k == 0 and i + 7 < num_nodes:
            users.append(i + 7)
        nodes.append(
            NodeProfile(f"n{i}", f, 2 * f, 2 * MiB, saved, MiB, 4 * MiB if heavy else 0, 4 * MiB if heavy else 0,
                        8 * MiB if heavy else 0, users=users)
        )
    return Profile(nodes, "synthetic", "float32", 8, input_bytes=2 * MiB, input_users=[0])


def cnn_like(num_nodes: int, seed: int = 0) -> Profile:
    """Conv nodes: long compute, small activations; the rest (norms, activations, pooling):
    short compute, large activations. Early nodes have larger activations (higher resolution)."""
    rnd = random.Random(seed)
    nodes = []
    for i in range(num_nodes):
        conv = i % 3 == 0
        scale = 2.0 - i / num_nodes
        f = rnd.uniform(0.8, 1.2) * (2.0 if conv else 0.1)
        saved = int(rnd.uniform(0.8, 1.2) * scale * (MiB / 4 if conv else 2 * MiB))
        params = 2 * MiB if conv else 0
        users = [i + 1] if i + 1 < num_nodes else [-1]
        nodes.append(NodeProfile(f"n{i}", f, 2 * f, saved, saved, MiB // 8, params, params, 2 * params, users=users))
    return Profile(nodes, "synthetic", "float32", 1, input_bytes=MiB, input_users=[0])


@dataclass
class Timing:
    """One size's planning: CPU milliseconds (best of its repeats), the stage peaks the search
    composed (exact or bounds), how many stages of the split recompute, and its slowest stage."""

    nodes: int
    stages: int
    ms: float
    pricings: int
    recompute: int
    slowest_ms: float

    @property
    def target_ms(self) -> float | None:
        return TARGETS_MS.get((self.nodes, self.stages))


def time_dawnpiper(num_nodes: int, num_stages: int, repeats: int = 3) -> Timing:
    """Dawnpiper with memory optimisation on :func:`transformer_like`, 1F1B with twice as many
    micro-batches as stages, each stage's capacity 85% of the fullest stage of the
    compute-balanced split (so memory binds): ``partition`` timed whole, the cost model's
    construction included."""
    profile = transformer_like(num_nodes)
    flight = in_flight("1f1b", 2 * num_stages, num_stages)
    model = CostModel(profile)
    timed = partition("time", profile, [1 << 60] * num_stages, flight)
    worst = max(model.peak(r.start, r.stop, flight[s]).total for s, r in enumerate(stage_ranges(timed)))
    capacities = [int(0.85 * worst)] * num_stages
    best = math.inf
    for _ in range(repeats):
        start = time.process_time()
        balance = partition("dawnpiper", profile, capacities, flight)
        best = min(best, time.process_time() - start)
    pricings = _pricings(lambda: partition("dawnpiper", profile, capacities, flight))
    stages = Stages(CostModel(profile), capacities, flight)
    ranges = stage_ranges(balance)
    optimised = sum(1 for s, r in enumerate(ranges) if stages.optimum(r.start, r.stop, s).policies)
    slowest = max(stages.stage_time(r.start, r.stop, s) for s, r in enumerate(ranges))
    return Timing(num_nodes, num_stages, best * 1e3, pricings, optimised, slowest)


def _pricings(plan: Callable[[], object]) -> int:
    """How many stage peaks ``plan()`` composes (counted around the cost model's composition)."""
    compose, count = CostModel._peak, [0]

    def counted(self: CostModel, *args: Any) -> StagePeak:
        count[0] += 1
        return compose(self, *args)

    CostModel._peak = counted  # type: ignore[method-assign,assignment]
    try:
        plan()
    finally:
        CostModel._peak = compose  # type: ignore[method-assign]
    return count[0]


def grid_section(timings: list[Timing], note: str) -> str:
    """The docs' planner-time section: one row per size, issue #47's target beside it, and how
    time grows with nodes and with stages (the exponent of a power law through the ends)."""
    rows = ["| nodes | stages | CPU ms | target ms | pricings | stages recompute |", "|---|---|---|---|---|---|"]
    for t in timings:
        target = f"{t.target_ms:.0f}" if t.target_ms else ""
        rows.append(f"| {t.nodes:,} | {t.stages} | {t.ms:.0f} | {target} | {t.pricings:,} | {t.recompute} |")
    nodes, stages = sorted({t.nodes for t in timings}), sorted({t.stages for t in timings})

    def growth(value: Callable[[Timing], float]) -> str:
        """The exponents k of value ~ nodes^k per stage count and value ~ stages^k per node count."""
        by = {(t.nodes, t.stages): value(t) for t in timings}

        def k(a: float, b: float, x: float, y: float) -> float:
            return math.log(b / a) / math.log(y / x)

        return (f"nodes^k from {nodes[0]:,} to {nodes[-1]:,} nodes, k = "
                + ", ".join(f"{k(by[nodes[0], s], by[nodes[-1], s], nodes[0], nodes[-1]):.2f} at {s} stages"
                            for s in stages)
                + f"; stages^k from {stages[0]} to {stages[-1]} stages, k = "
                + ", ".join(f"{k(by[n, stages[0]], by[n, stages[-1]], stages[0], stages[-1]):.2f} at {n:,} nodes"
                            for n in nodes))
    return "\n\n".join([
        "## Planner time vs graph size",
        "`python -m benchmarks.planner_speed --grid`: dawnpiper with memory optimisation (`partition`, the cost "
        "model's construction included) on `transformer_like` profiles, 1F1B with 2 x stages micro-batches, each "
        "stage's capacity 85% of the compute-balanced split's fullest stage. CPU time of the process "
        "(`time.process_time`), best of 3 (of 2 from 10,000 nodes); *pricings*: stage peaks composed, exact or "
        f"bounds, which load does not move. {note}",
        "\n".join(rows),
        f"Pricings grow as {growth(lambda t: t.pricings)}; CPU time as {growth(lambda t: t.ms)} (k through the two "
        "ends of each row or column; the times move with the machine's load, the pricings do not).",
    ]) + "\n\n"


def machine_note() -> str:
    """Which commit, machine and load made the numbers."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    return (f"Commit {commit}, {date}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
            f"shared with other jobs (load average {load} when the table was written).")


def update_docs(section: str, page: Path = Path(__file__).parent.parent / "docs" / "benchmarks.md") -> None:
    """``section`` in place of the page's planner-time section (or at its end)."""
    text = page.read_text()
    heading = re.search(r"^## Planner time vs graph size\n.*?(?=^## |\Z)", text, flags=re.M | re.S)
    page.write_text(text[: heading.start()] + section + text[heading.end():] if heading
                    else text.rstrip("\n") + "\n\n" + section)


def compare_max_microbatch(num_stages: int) -> None:
    profile = cnn_like(120)
    capacity = 1024 * MiB
    chunks = 2 * num_stages
    ours = max_microbatch(profile, PlanRequest([capacity] * num_stages, "dawnpiper", "1f1b", chunks))
    theirs = max_microbatch(profile, PlanRequest([capacity] * num_stages, "time", "1f1b", chunks))
    print(
        f"CNN-like, {num_stages} stages, 1f1b, {chunks} micro-batches, {capacity // MiB} MiB each: "
        f"max micro-batch dawnpiper {ours}, time {theirs}, ratio {ours / theirs:.2f}"
    )


GRID = [(n, s) for n in (1_000, 5_000, 10_000, 20_000) for s in (8, 32, 64)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", action="store_true", help="time every size of GRID and print the docs' table")
    parser.add_argument("--update-docs", action="store_true", help="with --grid: write it into docs/benchmarks.md")
    args = parser.parse_args(argv)
    if not args.grid:
        for nodes, stages in TARGETS_MS:
            t = time_dawnpiper(nodes, stages)
            print(f"dawnpiper {nodes:>6} nodes x {stages:>2} stages: {t.ms:8.1f} ms CPU, target {t.target_ms:6.0f} ms "
                  f"(best of 3; {t.pricings} pricings; {t.recompute} stages recompute; slowest stage "
                  f"{t.slowest_ms:.1f} ms)")
        for stages in (4, 8):
            compare_max_microbatch(stages)
        return
    timings = []
    for nodes, stages in GRID:
        timings.append(time_dawnpiper(nodes, stages, repeats=3 if nodes < 10_000 else 2))
        print(f"{nodes} x {stages}: {timings[-1].ms:.0f} ms CPU, {timings[-1].pricings} pricings", flush=True)
    section = grid_section(timings, machine_note())
    print(section)
    if args.update_docs:
        update_docs(section)


if __name__ == "__main__":
    main()
