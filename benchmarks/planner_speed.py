"""How long the memory-centric planner takes, and what it buys on a CNN-like model.

    python -m benchmarks.planner_speed

Synthetic profiles, no model and no device: a transformer-like chain of residual blocks for
speed (1F1B, capacity set so the first stages need recompute), and a CNN-like chain (conv nodes:
long compute, little memory; the others the reverse) for the largest micro-batch that fits.
"""

import random
import time

from lightning_pipe.plan.memory import CostModel, stage_ranges
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


def time_dawnpiper(num_nodes: int, num_stages: int, repeats: int = 3) -> None:
    profile = transformer_like(num_nodes)
    flight = in_flight("1f1b", 2 * num_stages, num_stages)
    # Capacity: 85% of the fullest stage of the compute-balanced split, so memory binds.
    model = CostModel(profile)
    timed = partition("time", profile, [1 << 60] * num_stages, flight)
    worst = max(model.peak(r.start, r.stop, flight[s]).total for s, r in enumerate(stage_ranges(timed)))
    capacities = [int(0.85 * worst)] * num_stages
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        balance = partition("dawnpiper", profile, capacities, flight)
        best = min(best, time.perf_counter() - start)
    stages = Stages(CostModel(profile), capacities, flight)
    ranges = stage_ranges(balance)
    optimised = sum(1 for s, r in enumerate(ranges) if stages.optimum(r.start, r.stop, s).policies)
    slowest = max(stages.stage_time(r.start, r.stop, s) for s, r in enumerate(ranges))
    target = TARGETS_MS[num_nodes, num_stages]
    print(
        f"dawnpiper {num_nodes:>6} nodes x {num_stages:>2} stages: {best * 1e3:8.1f} ms, target {target:6.0f} ms "
        f"(best of {repeats}; {optimised} stages recompute; slowest stage {slowest:.1f} ms)"
    )


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


def main() -> None:
    for nodes, stages in TARGETS_MS:
        time_dawnpiper(nodes, stages)
    for stages in (4, 8):
        compare_max_microbatch(stages)


if __name__ == "__main__":
    main()
