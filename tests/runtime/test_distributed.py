"""Stages as processes on torch.distributed.pipelining (gloo): trains like one process."""

import itertools
import os
import socket
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pipe.graph.capture import capture
from lightning_pipe.graph.microbatch import scatter
from lightning_pipe.internals import start_memory_events, stop_memory_events
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.balance import balance_by_weight
from lightning_pipe.plan.memory import CostModel, stage_ranges
from lightning_pipe.plan.plan import make_plan
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.runtime import distributed
from lightning_pipe.runtime.build import build
from lightning_pipe.runtime.distributed import (
    DistributedPipeline,
    PipelineRank,
    StageModule,
    carried,
    cuts,
    pipeline_mesh,
)
from lightning_pipe.runtime.fsdp import MixedPrecisionPolicy, is_shard, shard_of
from lightning_pipe.runtime.materialize import materialize, materialize_module, own_tensors
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
                inputs = program.bind(model.inputs(batch), {}) if pipe.is_first else None
                pipe.rank.train_step(inputs)
                pipe.sync_gradients()
                optimizer.step()
            state = pipe.state_dict()
            if rank == 0:
                torch.save(state, Path(out) / f"{family}-{schedule}.pt")
        if stages == world:
            torch.save(_bf16_cut_after_linear(mesh), Path(out) / f"bf16-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _cut_after_linear(model: torch.nn.Module, captured) -> list[int]:
    """Two stages, the GPT cut right after its second block's qkv projection."""
    names = [n.name for n in captured.nodes]
    cut = names.index("blocks_1_attn_qkv") + 1
    return [cut, len(names) - cut]


def _bf16_cut_after_linear(mesh) -> dict[str, torch.Tensor]:
    """One GPipe step of the GPT cut right after a linear layer, every stage under bfloat16
    autocast (a Trainer's bf16-mixed): the gradients of this rank's parameters."""
    model, _ = make("gpt")
    batch = _batch("gpt")
    microbatches = scatter(batch, CHUNKS)
    captured = capture(model)
    program = build(captured, model, _cut_after_linear(model, captured), [torch.device("cpu")] * 2, place=False)

    def loss_fn(output, target):
        return model.criterion(output, microbatches[int(target)]) / CHUNKS

    pipe = DistributedPipeline(program, model, cuts(program, model, model.inputs(microbatches[0]), {}), mesh, "gpipe",
                               CHUNKS, loss_fn, torch.device("cpu"))
    for stage in pipe.modules:
        stage.step_context = partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    pipe.rank.train_step(program.bind(model.inputs(batch), {}) if pipe.is_first else None)
    pipe.sync_gradients()  # (the tied embedding's, summed over the stages)
    return {name: t.grad for name, t in pipe.held_state().items() if t.grad is not None}


def _spawn(world: int, stages: int, out: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked: the ranks start with this process's imports (torch, Lightning), a few seconds each
    mp.start_processes(_train, args=(world, port, stages, str(out)), nprocs=world, join=True, start_method="fork")


@pytest.mark.slow
def test_pp2_trains_like_one_device_for_every_family(tmp_path):
    _spawn(world=2, stages=2, out=tmp_path)
    # under bf16 autocast, a stage cut right after a linear layer hands on bfloat16 where its cut
    # says float32 (the cut is described without autocast): sent as float32, not read as garbage
    model, _ = make("gpt")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(_batch("gpt"))
    loss.backward()
    for rank in range(2):
        grads = torch.load(tmp_path / f"bf16-rank{rank}.pt")
        assert grads, rank
        for name, grad in grads.items():
            expected = model.get_parameter(name).grad
            assert (grad - expected).abs().max() <= 1e-2 * expected.abs().max(), (rank, name)
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


def _buffer_bytes(program, model, microbatch, stage: int) -> tuple[int, int]:
    """Bytes of the runtime's buffers for one micro-batch of ``stage``: a receive buffer for
    each tensor it receives, and one for the gradient of each tensor it sends that takes one;
    and of the received ones, those its own nodes save for backward (found by running the
    stage under saved-tensor hooks): the buffer is what they save, nothing is stashed again."""
    env = {**program.bind(model.inputs(microbatch), {}), **program.attribute_values(model)}
    for s in program.stages[:stage]:
        env.update(zip(s.outputs, s(*[env[n] for n in s.inputs])))
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    mine = program.stages[stage]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        env.update(zip(mine.outputs, mine(*[env[n] for n in mine.inputs])))

    def tensors(names):
        return [t for n in names for t in tree_flatten(env[n])[0] if isinstance(t, torch.Tensor)]

    received = tensors(carried(program, stage)) if stage > 0 else []
    sent = tensors(carried(program, stage + 1)) if stage + 1 < len(program.stages) else []
    buffers = sum(t.nbytes for t in received) + sum(t.nbytes for t in sent if t.requires_grad)
    return buffers, sum(t.nbytes for t in received if t.untyped_storage().data_ptr() in saved)


@pytest.fixture(scope="module")
def unet_profile():
    model, _ = make("unet")
    captured = capture(model)
    microbatch = scatter(_batch("unet"), CHUNKS)[0]
    return model, captured, microbatch, profile_graph(captured, model.inputs(microbatch), repeats=1, warmup=0)


@pytest.mark.parametrize("stages", [2, 4])
def test_the_plan_counts_what_each_stage_carries_for_every_microbatch(stages, unet_profile):
    """Under the distributed runtime every stage holds, per micro-batch of the step, a buffer
    for each value it receives (U-Net skips, the encoder's output) and for the gradient of
    each it sends: the bytes each stage holds all along grow by exactly those bytes times the
    micro-batches, and by the batch each process loads (the first also the forward's arguments
    gathered from it). A received value its nodes save is its buffer, not stashed again: a
    micro-batch's stash is smaller by those bytes (they were 12% of the encoder-decoder's last
    stage at pp=4, counted for one micro-batch where the runtime holds four)."""
    model, captured, microbatch, profile = unet_profile
    balance = balance_by_weight(captured.param_bytes(), stages)
    program = build(captured, model, balance, [torch.device("cpu")] * stages, place=False)
    local = CostModel(profile, schedule="gpipe", chunks=CHUNKS)
    distributed = CostModel(profile, schedule="gpipe", chunks=CHUNKS, carry=CHUNKS)
    # what a stage holds all along (the local GPipe's one backward also sums the micro-batches'
    # weight gradients, which the distributed runtime's backward per micro-batch does not)
    grown = [distributed.static(r.start, r.stop) - local.static(r.start, r.stop) for r in stage_ranges(balance)]
    loaded = [distributed.batch + (CHUNKS * profile.input_bytes if s == 0 else 0) for s in range(stages)]
    buffers = [_buffer_bytes(program, model, microbatch, s) for s in range(stages)]
    assert grown == [CHUNKS * buffers[s][0] + loaded[s] for s in range(stages)]
    assert all(g > 0 for g in grown)
    stashed = [local.live(r.start, r.stop, {}).stashed - distributed.live(r.start, r.stop, {}).stashed
               for r in stage_ranges(balance)]
    assert stashed == [saved for _, saved in buffers]
    assert any(stashed)
    plan = make_plan(profile, PlanRequest([1 << 40] * stages, "params", "gpipe", CHUNKS, carry=True))
    assert plan.stages[1].peak.total == distributed.peak(plan.stages[1].start, plan.stages[1].stop, CHUNKS).total


def _materialise(rank: int, world: int, port: int, out: str) -> None:
    """pp=2 x dp=2: the encoder-decoder built on the meta device, given storage by a pipeline
    on the even split, then by one on another split that replaces it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = pipeline_mesh(2, world // 2, "cpu")
        with torch.device("meta"):
            model, _ = make("encdec")
        captured = capture(model)
        inputs = tree_map(lambda t: t.to("meta"), model.inputs(scatter(_batch("encdec"), CHUNKS)[0]))
        stored: list[set[int]] = []  # on rank 0, after each module got storage: which tensors have it

        def init(module: torch.nn.Module) -> None:
            materialize_module(module, torch.device("cpu"))
            stored.append({id(t) for t in [*model.parameters(), *model.buffers()] if not t.is_meta})

        held, previous = {}, None
        even = balance_by_weight(captured.param_bytes(), 2)
        torch.manual_seed(0)  # as the reference's, built on the meta device after make's seeding
        for balance in (even, [even[0] + 6, even[1] - 6]):
            on_meta = build(captured, model, balance, [torch.device("meta")] * 2, place=False)
            boundaries = cuts(on_meta, model, inputs, {})
            program = build(captured, model, balance, [torch.device("cpu")] * 2, place=False)
            pipe = DistributedPipeline(program, model, boundaries, mesh, "gpipe", CHUNKS, lambda o, t: o.sum(),
                                       torch.device("cpu"), previous=previous, init=init)
            previous = pipe.held_by_rank
            held[str(balance)] = {name: t.clone() for name, t in pipe.held_state().items()}
            held[str(balance)]["meta"] = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
            if rank == 0:  # what it held beyond its stage at any moment, in bytes
                mine, tensors = {id(t) for t in pipe.held}, {id(t): t for t in model.parameters()}
                tensors.update((id(t), t) for t in model.buffers())
                extra = [sum(tensors[i].numel() * tensors[i].element_size() for i in ids - mine) for ids in stored]
                held[str(balance)]["extra"] = max(extra, default=0)
                stored.clear()
        held["fsdp"] = _sharded_as_built(mesh)
        torch.save(held, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _tied_on_meta() -> torch.nn.Module:
    """The encoder-decoder built on the meta device, its head's weight its target embedding's
    (the first stage embeds, the last projects: a weight tied across the stages, which the
    head's ``reset_parameters()`` sets again after the embedding's)."""
    with torch.device("meta"):
        model, _ = make("encdec")
    model.head.weight = model.tgt_emb.weight
    return model


def _sharded_as_built(mesh) -> dict:
    """A fresh meta-built encoder-decoder, a weight tied across its stages, on an even split,
    each stage sharded by FSDP over its replicas as it gets storage, then one step of GPipe on
    the whole batch: this rank's shards of the values and of the gradients, and the bytes the
    CPU allocator held at most while the stages got their storage (up to the schedule's
    set-up, whose buffers are no parameters), beyond what it held before (all its allocations
    and frees, recorded by torch's profiler), with the bytes of this rank's stage whole and
    sharded."""
    model = _tied_on_meta()
    captured = capture(model)
    balance = balance_by_weight(captured.param_bytes(), 2)
    batch = _batch("encdec")
    microbatches = scatter(batch, CHUNKS)
    inputs = tree_map(lambda t: t.to("meta"), model.inputs(microbatches[0]))
    boundaries = cuts(build(captured, model, balance, [torch.device("meta")] * 2, place=False), model, inputs, {})
    program = build(captured, model, balance, [torch.device("cpu")] * 2, place=False)

    def loss_fn(output, target):
        return model.criterion(output, microbatches[int(target)]) / CHUNKS

    events: list = []

    def stored_then_scheduled(*args, **kwargs):
        events.extend(stop_memory_events())
        return PipelineRank(*args, **kwargs)

    torch.manual_seed(0)
    start_memory_events()
    with mock.patch.object(distributed, "PipelineRank", stored_then_scheduled):
        pipe = DistributedPipeline(program, model, boundaries, mesh, "gpipe", CHUNKS, loss_fn, torch.device("cpu"),
                                   init=partial(materialize_module, device=torch.device("cpu")),
                                   fsdp=MixedPrecisionPolicy())
    peak = sum(max(itertools.accumulate((e.cpu_memory_usage() for e in thread), initial=0)) for thread in events)
    pipe.rank.train_step(program.bind(model.inputs(batch), {}) if pipe.is_first else None)
    pipe.sync_gradients()
    state = pipe.held_state()
    params = [p for p in pipe.held if isinstance(p, torch.nn.Parameter)]
    return {
        "peak": peak,
        "stage": sum(p.numel() * p.element_size() for p in params),
        "sharded": sum(t.to_local().numel() * t.element_size() if is_shard(t) else t.numel() * t.element_size()
                       for t in pipe.held),
        "values": {name: t.to_local().clone() for name, t in state.items() if is_shard(t)},
        "grads": {name: t.grad.to_local().clone() for name, t in state.items() if is_shard(t)},
    }


@pytest.mark.slow
def test_a_meta_built_model_gets_storage_stage_by_stage_and_moves_with_a_new_split(tmp_path):
    """Each rank gives storage only to its own stage's tensors, with the values of the whole
    model materialised in one process; rank 0, which initialises every module, never holds
    more than its stage and one module's own tensors; a pipeline on another split takes the
    values over from the ranks that held them (each replica from its own). Sharded by FSDP,
    a stage gets its storage shard by shard (:func:`_check_sharded_as_built`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_materialise, args=(4, port, str(tmp_path)), nprocs=4, join=True, start_method="fork")
    with torch.device("meta"):
        reference, _ = make("encdec")
    materialize(reference, torch.device("cpu"))
    expected = reference.state_dict()
    largest = max(sum(t.numel() * t.element_size() for t in own_tensors(m)) for m in reference.modules())
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    _check_sharded_as_built([r.pop("fsdp") for r in ranks])
    extra = [ranks[0][split].pop("extra") for split in ranks[0]]
    assert 0 < extra[0] <= largest and extra[1] == 0  # the second split initialises nothing
    for split in ranks[0]:
        meta = [set(r[split].pop("meta")) for r in ranks]
        for rank, state in enumerate(ranks):
            assert set(state[split]) | meta[rank] == set(expected) and not set(state[split]) & meta[rank]
            for name, value in state[split].items():
                assert torch.equal(value, expected[name]), (split, rank, name)
        assert set(ranks[0][split]) == set(ranks[1][split])  # replicas hold the same stage
        assert set(ranks[0][split]) | set(ranks[2][split]) == set(expected)
    first, second = list(ranks[0])
    assert set(ranks[0][first]) != set(ranks[0][second])


def _check_sharded_as_built(ranks: list[dict]) -> None:
    """With FSDP, the meta-built model's stages get storage shard by shard: no rank ever holds
    its stage whole, only its shards and (rank 0, which initialises every module) one module's
    own tensors more, and the tied weight until the last module registering it set it; each
    replica's shards are its rows of the values one process draws, and after a step, of the
    gradients one device computes on the same batch (the tied weight's on both stages: one
    parameter)."""
    reference = _tied_on_meta()
    materialize(reference, torch.device("cpu"))
    largest = max(sum(t.numel() * t.element_size() for t in own_tensors(m)) for m in reference.modules())
    reference.loss(_batch("encdec")).backward()
    tied = reference.head.weight.numel() * reference.head.weight.element_size()
    assert {"tgt_emb.weight", "head.weight"} <= set(ranks[0]["values"]) & set(ranks[2]["values"])
    for rank, got in enumerate(ranks):
        replica = rank % 2
        assert got["peak"] <= got["sharded"] + (largest + tied if rank == 0 else 0) + 1024, (rank, got["peak"])
        assert got["peak"] < 0.75 * got["stage"], (rank, got["peak"], got["stage"])
        assert got["values"], rank
        for name, value in got["values"].items():
            param = reference.get_parameter(name)
            assert torch.equal(value, shard_of(param.detach(), 2, replica)), (rank, name)
            torch.testing.assert_close(got["grads"][name], shard_of(param.grad, 2, replica), rtol=1e-5, atol=1e-6)


def _with_policies(rank: int, world: int, port: int, out: str) -> None:
    """pp=2, the U-Net under 1F1B, every node keeping its activations, then stage 0
    recomputing and stage 1 swapping: each rank's parameters after training and its metered
    activation peak."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = pipeline_mesh(2, 1, "cpu")
        result = {}
        for memopt in (False, True):
            model, _ = make("unet")
            batch = _batch("unet")
            microbatches = scatter(batch, CHUNKS)
            captured = capture(model)
            balance = balance_by_weight(captured.param_bytes(), 2)
            names = [n.name for n in captured.nodes]
            policies = {}
            if memopt:
                policies = dict.fromkeys(names[: balance[0] - 1], "recompute")
                policies.update(dict.fromkeys(names[balance[0] : len(names) - 1], "swap"))
            program = build(captured, model, balance, [torch.device("cpu")] * 2, policies, place=False)
            boundaries = cuts(program, model, model.inputs(microbatches[0]), {})

            def loss_fn(output, target, microbatches=microbatches, model=model):
                return model.criterion(output, microbatches[int(target)]) / CHUNKS

            pipe = DistributedPipeline(program, model, boundaries, mesh, "1f1b", CHUNKS, loss_fn, torch.device("cpu"))
            meter = MemoryMeter(1)
            for stage in pipe.modules:
                stage.meter = meter
            meter.own(0, pipe.held)
            optimizer = model.configure_optimizers()
            for _ in range(STEPS):
                optimizer.zero_grad()
                with meter, meter.saved_tensors_hooks(), meter.running(0):
                    pipe.rank.train_step(program.bind(model.inputs(batch), {}) if pipe.is_first else None)
                optimizer.step()
            result[memopt] = {"activations": meter.stages[0].kind_peaks["activations"], "state": pipe.state_dict()}
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_recompute_and_swap_inside_a_stage_train_like_one_device_on_less_memory(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_with_policies, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    expected = _reference("unet")
    for memopt in (False, True):
        state = ranks[0][memopt]["state"]
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=f"memopt={memopt} {name}")
    for r in range(2):  # stage 0 recomputes, stage 1 swaps to the host: each keeps fewer activations
        assert ranks[r][True]["activations"] < ranks[r][False]["activations"], r


def test_a_stage_writing_its_received_input_in_place_hands_back_its_gradient():
    """pipelining's receive buffer is a leaf requiring grad: a stage starting with
    ``ReLU(inplace=True)`` wrote to it and failed (*a leaf Variable that requires grad is being
    used in an in-place operation*); it writes an alias, and the buffer gets the gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 1))
    captured = capture(model)
    program = build(captured, model, [1, 2], [torch.device("cpu")] * 2, place=False)
    stage = StageModule(program, 1, model, cuts(program, model, (torch.randn(2, 4),), {}))
    received = torch.randn(2, 8, requires_grad=True)
    (output,) = stage(received)
    output.sum().backward()
    h = received.detach().clone().requires_grad_()
    model[2](torch.relu(h)).sum().backward()
    assert torch.equal(received.grad, h.grad)
