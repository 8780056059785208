"""Fake execution: training steps of the real pipeline runtime on tensors without data, metered.

A plan for GPUs one does not have is checked by running it without them. The stages, the
schedule's order of forwards and backwards, recompute, swap, 2BW's weight versions and the
optimizer step run as in training, on ``meta`` tensors: shapes, dtypes and storages, but no
data, so nothing is computed and no memory is used. The meter charges a meta storage as it
charges a real one and enforces each stage's capacity at real sizes: a stage that would not
fit raises :class:`~lightning_pipe.measure.meter.StageOutOfMemoryError` where training would.
Meta tensors go straight to PyTorch's meta kernels. A run may ask for
:class:`~torch._subclasses.fake_tensor.FakeTensorMode` tensors standing on the CPU instead,
which CPU autocast (``bf16-mixed``) casts and meta tensors it does not, and which run the
kernels the CPU picks where an operator chooses by device (``scaled_dot_product_attention``:
flash on the CPU, the math kernel, keeping other tensors, on meta); they add a Python
dispatch and a cache lookup per operator (a transformer's run takes about twice as long; a
CNN's about as long, as that cache skips the Python meta kernels of repeated convolutions).

The step is driven here, not by a Lightning Trainer: a model built from a config and a batch
of shapes has no data loader, and the Trainer's machinery allocates nothing the meter
charges. What a training step does to memory, the strategy's order included (forward, then
zero grad, then backward, then the optimizer step, whose state is charged after it), is
repeated here; the tests hold a fake run's metered peaks equal to a real Lightning run's.

What tensors without data cannot show is what a kernel does inside: the workspace an operator
allocates and frees within itself (the meter charges what a real call of the same signature
showed, none if none ran), and a real kernel returning a tensor in a storage larger than it
(the CPU's ``mse_loss``): a fake storage is its tensor's size. What a GPU's caching allocator
holds beyond the storages (rounding, cached blocks) follows from their order, which a run
records when asked (``trace``) and :mod:`~lightning_pipe.measure.allocator` replays.
"""

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from copy import deepcopy
from dataclasses import replace
from functools import partial
from typing import Any, Literal
from weakref import WeakSet

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_pipe.graph.capture import Captured
from lightning_pipe.graph.microbatch import batch_size, scatter
from lightning_pipe.internals import FakeTensorMode, mark_as_parameter, tree_flatten, tree_map
from lightning_pipe.measure.attention import cuda_attention
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.plan.schedule import Schedule, actions, global_order
from lightning_pipe.runtime import swap
from lightning_pipe.runtime.build import Policy, Program, build
from lightning_pipe.runtime.distributed import DistributedPipeline, DistributedSchedule, constants, cuts
from lightning_pipe.runtime.gpipe import Pipeline
from lightning_pipe.runtime.scheduled import ScheduledPipeline
from lightning_pipe.runtime.versions import WeightVersions

__all__ = ["TrainingStep", "fake_rank_training", "fake_training", "meta_copy"]

#: ``training_step(forward, batch)``: the loss of ``batch`` (a whole batch under GPipe, a
#: micro-batch under 1F1B and 2BW), calling the pipelined ``forward`` as ``self(...)`` would.
TrainingStep = Callable[[Callable[..., Any], Any], Tensor]

_CPU = torch.device("cpu")
_RAN: "WeakSet[nn.Module]" = WeakSet()  # models that ran fake: their tensors are a run's, not a model's


def fake_training(
    root: nn.Module,
    captured: Captured,
    batch: Any,
    training_step: TrainingStep,
    optimizer: torch.optim.Optimizer,
    balance: Sequence[int],
    policies: Mapping[str, Policy] | None = None,
    *,
    schedule: Schedule = "gpipe",
    chunks: int = 1,
    capacities: Sequence[int | None] | None = None,
    tensors: Literal["meta", "cpu"] = "meta",
    trace: bool = False,
    cuda: bool = False,
) -> MemoryMeter:
    """Train on fake tensors, split by ``balance`` with ``policies``; return the meter,
    whose per-stage peaks are what a steady training step on ``batch`` reaches.

    ``root``'s parameters and buffers become fake in place (the objects stay, so the
    captured graph, tied weights and ``optimizer`` keep referring to them): a real or a
    ``meta`` model goes in, and it can neither train nor run fake again (run each time a
    :func:`meta_copy`). Every stage runs on one device, ``meta`` (``tensors="meta"``) or
    fake tensors on the CPU (``"cpu"``: for a step under CPU autocast); the meter tells
    stages apart by itself. ``trace``: the meter records the order of its charges and
    releases, for :meth:`~lightning_pipe.measure.meter.MemoryMeter.allocator_peaks`. ``cuda``:
    the stages are CUDA GPUs, whose attention runs a fused kernel
    (:func:`~lightning_pipe.measure.attention.cuda_attention`), not the math one ``meta`` and
    CPU tensors run with dropout.
    ``batch`` may be real or ``meta``: only its shapes and dtypes are used. Two steps run:
    the first on one micro-batch, only to leave what a step leaves (gradients, optimizer
    state: which parameters get them does not depend on the batch), at a fraction of a whole
    step's operators; then the steady step on ``batch``, whose forward runs while they are
    alive. Its peak is the run's: at every moment it holds at least what a first whole step
    would.

    Raises:
        StageOutOfMemoryError: a stage went over its entry of ``capacities``.
        ValueError: ``root`` ran fake before.
    """
    if root in _RAN:
        # the storages of a run before are not all charged again (2BW's weight swap loses one)
        raise ValueError(
            "The model's parameters and buffers are those of an earlier fake run, which a second run does not "
            "meter right. Run a fresh copy each time: model, graph = meta_copy(root, captured), with an "
            "optimizer over the copy's parameters."
        )
    _RAN.add(root)
    device = torch.device(tensors)
    # the graph's own constants stay real
    mode = FakeTensorMode(allow_non_fake_inputs=True) if device == _CPU else nullcontext()
    _fake_in_place(root, mode, device)
    for p in root.parameters():
        p.grad = None  # gradients from before are no part of this run
    stages = len(balance)
    program = build(captured, root, balance, [device] * stages, policies)
    meter = MemoryMeter(stages, capacities, trace=trace)
    with mode, _own_host_pool(device), cuda_attention() if cuda else nullcontext():
        versions = WeightVersions(root.parameters()) if schedule == "2bw" else None
        stale = dict(zip(map(id, versions.params), versions.stale)) if versions else {}
        for stage in program.stages:
            meter.own(stage.index, stage.owned)
            meter.own(stage.index, [stale[id(t)] for t in stage.owned if id(t) in stale])
        fake_batch = tree_map(lambda x: _fake(x, mode, device) if isinstance(x, Tensor) else x, batch)
        try:
            with meter, meter.saved_tensors_hooks():
                for step_batch, step_chunks in ((scatter(fake_batch, chunks)[0], 1), (fake_batch, chunks)):
                    inputs = [t for t in tree_flatten(step_batch)[0] if isinstance(t, Tensor)]
                    meter.own(stages - 1, inputs, "boundary")  # the batch lives on the last stage's device
                    if schedule == "gpipe":
                        _gpipe_step(program, root, device, step_chunks, meter, step_batch, training_step, optimizer)
                    else:
                        _scheduled_step(program, root, device, schedule, step_chunks, meter, step_batch,
                                        training_step, optimizer, versions)
                    _optimizer_step(meter, optimizer)
        finally:
            meter.close()
    return meter


def fake_rank_training(
    root: nn.Module,
    captured: Captured,
    batch: Any,
    arguments: tuple[tuple[Any, ...], dict[str, Any]],
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: torch.optim.Optimizer,
    balance: Sequence[int],
    policies: Mapping[str, Policy],
    mesh: DeviceMesh,
    *,
    schedule: DistributedSchedule,
    chunks: int,
    tensors: Literal["meta", "cpu"] = "meta",
    step_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    cuda: bool = False,
) -> MemoryMeter:
    """This rank's training steps under ``runtime="distributed"``, on fake tensors, metered:
    the stages ``balance`` gives its place in ``mesh`` (a
    :func:`~lightning_pipe.runtime.distributed.silent_mesh`: every message is sent, none
    arrives, none is waited for), ``torch.distributed.pipelining``'s schedule with its receive
    buffers, the values carried through the rank, the gradient reductions and the optimizer
    step. ``root`` is a :func:`meta_copy` and ``optimizer`` over its parameters; ``batch``:
    the training batch every rank loads, ``arguments`` the forward's for the whole batch (the
    first rank's copy); ``loss_fn(output, microbatch)`` a micro-batch's loss (the last rank's).
    ``tensors`` as :func:`fake_training`'s (``"cpu"``: under autocast); ``step_context``: what
    each stage's forward runs in (the precision's autocast); ``cuda`` as :func:`fake_training`'s.
    Two steps run, the second with
    the first's gradients freed and its optimizer state alive: the meter's peak is a steady
    step's."""
    device = torch.device(tensors)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if device == _CPU else nullcontext()
    _fake_in_place(root, mode, device)
    batch, arguments = tree_map(lambda x: _fake(x, mode, device) if isinstance(x, Tensor) else x, (batch, arguments))
    program = build(captured, root, balance, [device] * len(balance), policies, place=False)
    boundaries = cuts(program, root, *scatter(arguments, chunks)[0])
    # the last rank computes the losses in micro-batch order (a fake target has no value to read)
    microbatches, order = scatter(batch, chunks), itertools.count()
    with mode:
        pipe = DistributedPipeline(program, root, boundaries, mesh, schedule, chunks,
                                   lambda output, _: loss_fn(output, microbatches[next(order) % chunks]) / chunks,
                                   device, fake=True)
    meter = MemoryMeter(1)
    for stage in pipe.modules:
        stage.meter, stage.step_context = meter, step_context
    meter.own(0, pipe.held)
    meter.own(0, [t for t in tree_flatten(batch)[0] if isinstance(t, Tensor)], "boundary")
    bound = program.bind(*arguments)
    pipe.set_arguments(constants(bound))
    received = bound if pipe.is_first else None
    meter.own(0, [t for t in tree_flatten(received)[0] if isinstance(t, Tensor)], "boundary")
    try:
        with (mode, _own_host_pool(device), meter, meter.saved_tensors_hooks(),
              cuda_attention() if cuda else nullcontext()):
            for _ in range(2):
                optimizer.zero_grad()
                with meter.running(0):
                    pipe.rank.train_step(received)
                    pipe.sync_gradients()
                _optimizer_step(meter, optimizer)
    finally:
        meter.close()
    return meter


def _optimizer_step(meter: MemoryMeter, optimizer: torch.optim.Optimizer) -> None:
    """The step, as the strategy runs it: its temporaries and new state charged to the stages
    owning the parameters."""
    with meter.stepping():
        optimizer.step()
    meter.own_optimizer_state(optimizer)


def meta_copy(
    root: nn.Module, captured: Captured, shared: Iterable[object] = (), shapes: Mapping[int, torch.Size] | None = None
) -> tuple[nn.Module, Captured]:
    """A copy of ``root`` and of its captured graph, sharing submodules as they do, whose
    parameters and buffers are ``meta`` tensors (tied ones tied): what :func:`fake_training`
    runs without touching ``root``. ``shared``: objects ``root`` refers to that the copy
    shares rather than copies (a Trainer). ``shapes``: each tensor's shape by ``id``, where
    ``root`` holds some without their storage (a distributed rank's released tensors)."""
    memo: dict[int, Any] = {id(o): o for o in shared}
    for t in [*root.parameters(), *root.buffers()]:
        if id(t) not in memo:
            shape = (shapes or {}).get(id(t), t.shape)
            meta = torch.empty_like(t, device="meta") if shape == t.shape else torch.empty(shape, dtype=t.dtype,
                                                                                              device="meta")
            memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    copy = deepcopy(root, memo)
    graph_module = deepcopy(captured.graph_module, memo)
    names = {n.name for n in captured.nodes}
    nodes = [n for n in graph_module.graph.nodes if n.name in names]
    return copy, replace(captured, graph_module=graph_module, nodes=nodes)


def _gpipe_step(
    program: Program, root: nn.Module, device: torch.device, chunks: int, meter: MemoryMeter, batch: Any,
    training_step: TrainingStep, optimizer: torch.optim.Optimizer,
) -> None:
    """As Lightning runs a step: ``training_step`` on the whole batch (its loss is the last
    stage's), zero grad, backward of the loss divided by ``accumulate_grad_batches`` (1): a
    new tensor, so that the loss itself is freed at once."""
    pipeline = Pipeline(program, root, chunks, device, meter)
    loss = meter.run_as(len(program.stages) - 1, lambda: training_step(pipeline, batch)) / 1
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]


def _scheduled_step(
    program: Program, root: nn.Module, device: torch.device, schedule: Schedule, chunks: int, meter: MemoryMeter,
    batch: Any, training_step: TrainingStep, optimizer: torch.optim.Optimizer, versions: WeightVersions | None,
) -> None:
    """As :class:`~lightning_pipe.lightning.steps.ScheduledStep` runs one: ``training_step``
    per micro-batch, each stage's backward at its place in the schedule, gradients zeroed
    before the first backward, losses weighted by micro-batch size."""
    pipeline = ScheduledPipeline(program, device, meter)
    microbatches = scatter(batch, chunks)
    sizes = [batch_size(mb) for mb in microbatches]
    last = len(program.stages) - 1
    losses: dict[int, Tensor] = {}
    zeroed = False
    with versions.stale_weights() if versions else nullcontext():
        for step in global_order(actions(schedule, len(microbatches), len(program.stages))):
            if step.kind == "forward":
                pipeline.microbatch = step.microbatch
                run = partial(training_step, partial(pipeline, root), microbatches[step.microbatch])
                losses[step.microbatch] = meter.run_as(last, run)
                continue
            if not zeroed:
                optimizer.zero_grad()
                zeroed = True
            assert step.stage is not None
            loss = losses[step.microbatch] * (sizes[step.microbatch] / sum(sizes)) if step.stage == last else None
            pipeline.backward(step.microbatch, step.stage, loss)
            if loss is not None:
                losses[step.microbatch] = losses[step.microbatch].detach()
            del loss  # its graph would keep the outputs alive through the next forward, as the strategy's does not
    if versions is not None:
        versions.advance()


def _fake_in_place(module: nn.Module, mode: AbstractContextManager[Any], device: torch.device) -> None:
    """Make every parameter and buffer of ``module`` a fake tensor of its shape on ``device``
    (made in ``mode``), keeping the Python objects (``torch.utils.swap_tensors``): whatever
    refers to them sees the fake."""
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen or (t.is_meta and device.type == "meta"):
            continue
        seen.add(id(t))
        fake = _fake(t, mode, device)
        if isinstance(t, nn.Parameter):
            fake.requires_grad_(t.requires_grad)
            mark_as_parameter(fake)  # isinstance(fake, nn.Parameter) holds
        torch.utils.swap_tensors(t, fake)  # type: ignore[no-untyped-call]


def _fake(t: Tensor, mode: AbstractContextManager[Any], device: torch.device) -> Tensor:
    """A tensor like ``t`` without data, on ``device``, made in ``mode``."""
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


@contextmanager
def _own_host_pool(device: torch.device) -> Iterator[None]:
    """Host buffers for swap on ``device``, in a pool of their own: one kept for reuse must
    never serve a real run."""
    real = swap.pool
    swap.pool = swap.HostPool(device)
    try:
        yield
    finally:
        swap.pool = real
