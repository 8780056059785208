"""Stages as processes on torch.distributed.pipelining (gloo): trains like one process."""

import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_pipe.graph.capture import capture
from lightning_pipe.graph.microbatch import scatter
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.balance import balance_by_weight
from lightning_pipe.plan.memory import CostModel, stage_ranges
from lightning_pipe.plan.plan import make_plan
from lightning_pipe.runtime.build import build
from lightning_pipe.runtime.distributed import DistributedPipeline, carried, cuts, pipeline_mesh
from tests.models import make

STEPS, BATCH, CHUNKS = 3, 8, 4
# each family once, the schedules alternating (tests/lightning/test_distributed.py runs the others)
CONFIGS = [("gpt", "1f1b"), ("unet", "gpipe"), ("encdec", "1f1b")]


def _batch(family: str) -> dict:
    _, data = make(family)
    return torch.utils.data.default_collate([data[i] for i in range(BATCH)])


def _reference(family: str) -> dict[str, torch.Tensor]:
    model, _ = make(family)
    optimizer = model.configure_optimizers()
    batch = _batch(family)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model.loss(batch).backward()
        optimizer.step()
    return model.state_dict()


def _train(rank: int, world: int, port: int, stages: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = pipeline_mesh(stages, world // stages, "cpu")
        for family, schedule in CONFIGS:
            model, _ = make(family, seed=rank)  # rank 0's weights must win
            batch = _batch(family)
            replica = mesh.get_coordinate()[1]
            batch = {k: v.chunk(world // stages)[replica] for k, v in batch.items()}
            microbatches = scatter(batch, CHUNKS)
            captured = capture(model)
            balance = balance_by_weight(captured.param_bytes(), stages)
            program = build(captured, model, balance, [torch.device("cpu")] * stages, place=False)
            box = [cuts(program, model, model.inputs(microbatches[0]), {}) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)

            def loss_fn(output, target, microbatches=microbatches, model=model):
                return model.criterion(output, microbatches[int(target)]) / CHUNKS

            pipe = DistributedPipeline(program, model, box[0], mesh, schedule, CHUNKS, loss_fn, torch.device("cpu"))
            optimizer = model.configure_optimizers()
            for _ in range(STEPS):
                optimizer.zero_grad()
                inputs = program.bind(model.inputs(batch), {}) if pipe.stage_index == 0 else None
                pipe.rank.train_step(inputs)
                pipe.sync_gradients()
                optimizer.step()
            state = pipe.state_dict()
            if rank == 0:
                torch.save(state, Path(out) / f"{family}-{schedule}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(world: int, stages: int, out: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked: the ranks start with this process's imports (torch, Lightning), a few seconds each
    mp.start_processes(_train, args=(world, port, stages, str(out)), nprocs=world, join=True, start_method="fork")


@pytest.mark.slow
def test_pp2_trains_like_one_device_for_every_family(tmp_path):
    _spawn(world=2, stages=2, out=tmp_path)
    for family, schedule in CONFIGS:
        expected = _reference(family)
        state = torch.load(tmp_path / f"{family}-{schedule}.pt")
        assert list(state) == list(expected), (family, schedule)
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=f"{family} {schedule} {name}")


def test_carried_values_reach_every_later_reader():
    model, _ = make("unet")
    captured = capture(model)
    program = build(captured, model, balance_by_weight(captured.param_bytes(), 4), [torch.device("cpu")] * 4,
                    place=False)
    # the stem's output is read by the last decoder level: it crosses every cut
    stem = program.stages[0].outputs[0]
    readers = [s.index for s in program.stages if stem in s.inputs]
    assert all(stem in carried(program, c) for c in range(1, max(readers) + 1))
    assert carried(program, 0) == list(program.placeholders)


def _carried_bytes(program, boundaries, stage: int) -> int:
    """Bytes per micro-batch of what ``stage`` receives and sends on (read after it), from the
    runtime's cut metadata: a receive buffer each, and one for the gradient of a float value."""
    received = tree_unflatten(boundaries[stage].leaves, boundaries[stage].spec)
    passed = set(carried(program, stage + 1))
    total = 0
    for name, value in received.items():
        for meta in tree_flatten(value)[0] if name in passed else []:
            size = math.prod(meta.shape) * meta.dtype.itemsize
            total += 2 * size if meta.dtype.is_floating_point else size
    return total


@pytest.fixture(scope="module")
def unet_profile():
    model, _ = make("unet")
    captured = capture(model)
    microbatch = scatter(_batch("unet"), CHUNKS)[0]
    return model, captured, microbatch, profile_graph(captured, model.inputs(microbatch), repeats=1, warmup=0)


@pytest.mark.parametrize("stages", [2, 4])
def test_the_plan_counts_what_each_stage_carries_for_every_microbatch(stages, unet_profile):
    """Under the distributed runtime every stage holds a receive buffer per micro-batch of the
    step for each value it passes on (U-Net skips): the bytes each stage holds all along grow
    by exactly those bytes times the micro-batches, as the runtime's cuts describe them."""
    model, captured, microbatch, profile = unet_profile
    balance = balance_by_weight(captured.param_bytes(), stages)
    program = build(captured, model, balance, [torch.device("cpu")] * stages, place=False)
    boundaries = cuts(program, model, model.inputs(microbatch), {})
    local = CostModel(profile, schedule="gpipe", chunks=CHUNKS)
    distributed = CostModel(profile, schedule="gpipe", chunks=CHUNKS, carry=CHUNKS)
    # what a stage holds all along (the local GPipe's one backward also sums the micro-batches'
    # weight gradients, which the distributed runtime's backward per micro-batch does not)
    grown = [distributed.static(r.start, r.stop) - local.static(r.start, r.stop) for r in stage_ranges(balance)]
    assert grown == [CHUNKS * _carried_bytes(program, boundaries, s) for s in range(stages)]
    assert grown[0] == grown[-1] == 0 and all(g > 0 for g in grown[1:-1])  # middle stages carry skips
    plan = make_plan(profile, [1 << 40] * stages, "params", "gpipe", CHUNKS, carry=True)
    assert plan.stages[1].peak.total == distributed.peak(plan.stages[1].start, plan.stages[1].stop, CHUNKS).total
