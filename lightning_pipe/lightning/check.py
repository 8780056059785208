"""A plan's check before it trains: the module's own ``training_step``, run on fake tensors.

:func:`~lightning_pipe.plan.headroom.checked` plans to the memory limit and asks what each
stage of the plan would peak at. The answer is a fake training step
(:func:`~lightning_pipe.runtime.fake.fake_training`) of a copy of the module whose weights are
``meta`` tensors: the user's step, loss and optimizer as they will train, using no memory,
and leaving the module, its metrics and its logs as they were. A stage on a GPU is checked by
what its caching allocator will reserve (``torch.cuda.max_memory_reserved``), replayed from the
order the fake step allocated and freed its storages in
(:mod:`~lightning_pipe.measure.allocator`): what runs out is the device's memory, and the
allocator's rounding and cached blocks take their share of it.
"""

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, cast

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import Metric

from lightning_pipe.autocast import cuda_policy
from lightning_pipe.graph.capture import Captured
from lightning_pipe.internals import DataDependentOutputException, DynamicOutputShapeException, tree_map
from lightning_pipe.lightning.internals import attached_trainer
from lightning_pipe.lightning.microlog import silenced
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.measure.optimizers import rebuild
from lightning_pipe.plan.plan import PREDICTION_ERROR, Plan
from lightning_pipe.plan.schedule import Schedule
from lightning_pipe.runtime.build import Policy
from lightning_pipe.runtime.distributed import DistributedSchedule
from lightning_pipe.runtime.fake import fake_rank_training, fake_training, meta_copy

__all__ = [
    "UncheckableStepError", "device_peaks", "fake_meter", "fake_peaks", "fake_rank_peak", "meta_replica",
    "picks_kernel_by_device",
    "unchecked_warning",
]

#: Operators that pick their kernel, and so what they keep, by the device of their inputs:
#: on ``meta`` tensors they run another one (``scaled_dot_product_attention``: the math kernel,
#: where the CPU runs flash). A graph torch.export captured holds the kernel already chosen.
_BY_DEVICE = frozenset({"scaled_dot_product_attention"})


class UncheckableStepError(Exception):
    """The user's training step cannot run on fake tensors; the message says why."""


def picks_kernel_by_device(captured: Captured) -> bool:
    """Whether the graph calls an operator that picks its kernel by device (:data:`_BY_DEVICE`),
    itself or inside a module it keeps whole (``nn.MultiheadAttention`` and the
    ``nn.Transformer*`` layers call ``scaled_dot_product_attention``; a module of the user's
    may call anything): its check must run on fake tensors standing on the device (slower
    than ``meta`` ones)."""
    modules = dict(captured.graph_module.named_modules())
    for n in captured.graph_module.graph.nodes:
        # (an exported graph calls the ATen overload: aten.scaled_dot_product_attention.default)
        if n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] in _BY_DEVICE:
            return True
        if n.op == "call_module" and any(_may_pick_kernel(m) for m in modules[str(n.target)].modules()):
            return True
    return False


def _may_pick_kernel(module: nn.Module) -> bool:
    """A module whose forward may call an operator of :data:`_BY_DEVICE`: attention, or code
    that is not ``torch.nn``'s (whose other layers call no such operator)."""
    return isinstance(module, nn.MultiheadAttention) or not type(module).__module__.startswith("torch.")


def unchecked_warning(why: str) -> str:
    """What an engine says, once, when it plans by the flat headroom for want of a check."""
    return (
        f"MemoryPipeStrategy cannot check its plan by a training step on fake tensors ({why}); it plans "
        f"for a {PREDICTION_ERROR:.0%} under-prediction instead (each stage at most the memory limit / "
        f"{1 + PREDICTION_ERROR:g}), a margin measured on other models."
    )


def fake_peaks(
    module: LightningModule,
    captured: Captured,
    batch: Any,
    batch_idx: int,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    plan: Plan,
    on_cpu: bool = False,
    devices: Sequence[torch.device] = (),
) -> list[int]:
    """Each stage's peak when ``plan`` trains ``module`` on batches shaped as ``batch``, with
    an optimizer of ``optimizer``'s kind and settings (none: no state), as
    :func:`device_peaks` reports it for the stages' ``devices`` (none given: metered).
    ``on_cpu``: the fake tensors stand on the CPU, and run the kernels it picks
    (``scaled_dot_product_attention``'s flash one; ``meta`` tensors run the math one); stages
    on CUDA ``devices`` run the fused attention kernels a GPU picks."""
    on_gpu = any(d.type == "cuda" for d in devices)
    meter = fake_meter(module, captured, batch, batch_idx, optimizer, precision, plan, on_cpu, trace=on_gpu,
                       cuda=on_gpu)
    return device_peaks(meter, devices)


def device_peaks(meter: MemoryMeter, devices: Sequence[torch.device] = ()) -> list[int]:
    """Each stage's peak as its device will show it: on a CUDA device, what its caching
    allocator reserves, alone on a device of its own (the limit it is checked against is its
    share of the device); elsewhere, and where ``devices`` are not given, the metered bytes."""
    cuda = {s for s, d in enumerate(devices) if d.type == "cuda"}
    return [meter.allocator_peaks([s]).reserved if s in cuda else peak for s, peak in enumerate(meter.peaks())]


def fake_meter(
    module: LightningModule,
    captured: Captured,
    batch: Any,
    batch_idx: int,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    plan: Plan,
    on_cpu: bool = False,
    *,
    trace: bool = False,
    cuda: bool = False,
) -> MemoryMeter:
    """The meter of :func:`fake_peaks`' fake training step (``trace``: with its trace, for
    :meth:`~lightning_pipe.measure.meter.MemoryMeter.allocator_peaks`; ``cuda``: the stages are
    CUDA GPUs, whose attention kernels it runs)."""
    replica, graph = meta_replica(module, captured)
    params = list(replica.parameters())
    twin = _twin(optimizer, module, replica) if optimizer is not None else torch.optim.SGD(params, lr=0.0)
    _inert_metrics(replica)
    policies = {n.name: cast(Policy, p) for n, p in zip(graph.nodes, plan.policies) if p != "keep"}

    def step(forward: Any, microbatch: Any) -> Tensor:
        replica.forward = forward  # type: ignore[method-assign]
        return _user_step(replica, precision, microbatch, batch_idx)

    shapes = _on_meta(batch)
    # autocast casts fake tensors standing on the CPU, not meta ones (CUDA's: see _step_context)
    on_cpu = on_cpu or isinstance(precision, MixedPrecision)
    with silenced(replica), torch.random.fork_rng(devices=[]), _policy(precision):
        meter = fake_training(replica, graph, shapes, step, twin, plan.balance, policies,
                              schedule=cast(Schedule, plan.schedule), chunks=plan.chunks,
                              tensors="cpu" if on_cpu else "meta", trace=trace, cuda=cuda)
    return meter


def fake_rank_peak(
    module: LightningModule,
    captured: Captured,
    batch: Any,
    batch_idx: int,
    arguments: tuple[tuple[Any, ...], dict[str, Any]],
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    plan: Plan,
    mesh: DeviceMesh,
    shapes: Mapping[int, torch.Size] | None = None,
    cuda: bool = False,
) -> int:
    """This rank's metered peak when ``plan`` trains ``module`` under ``runtime="distributed"``
    on batches shaped as ``batch`` (``arguments``: the forward's, for the whole batch), on
    ``mesh`` (a :func:`~lightning_pipe.runtime.distributed.silent_mesh`): the user's step runs
    on the last rank per micro-batch, as in training. ``shapes``: each tensor's shape by
    ``id``, where the rank released some (:func:`meta_replica`). ``cuda``: the rank's device
    is a CUDA GPU, whose attention kernels the step runs."""
    replica, graph = meta_replica(module, captured, shapes)
    twin = _twin(optimizer, module, replica) if optimizer is not None else torch.optim.SGD(replica.parameters(), lr=0.0)
    _inert_metrics(replica)
    batch = _on_meta(batch)

    def loss(output: Any, microbatch: Any) -> Tensor:
        replica.forward = lambda *args, **kwargs: output  # type: ignore[method-assign]
        return _user_step(replica, precision, microbatch, batch_idx)

    policies = {n.name: cast(Policy, p) for n, p in zip(graph.nodes, plan.policies) if p != "keep"}
    tensors: Literal["cpu", "meta"] = "cpu" if isinstance(precision, MixedPrecision) else "meta"  # (autocast: CPU)
    with silenced(replica), torch.random.fork_rng(devices=[]), _policy(precision):
        meter = fake_rank_training(replica, graph, batch, _on_meta(arguments), loss, twin, plan.balance, policies,
                                   mesh, schedule=cast(DistributedSchedule, plan.schedule), chunks=plan.chunks,
                                   tensors=tensors, step_context=lambda: _step_context(precision), cuda=cuda)
    return meter.stages[0].peak


def _on_meta(value: Any) -> Any:
    return tree_map(lambda x: torch.empty_like(x, device="meta") if isinstance(x, Tensor) else x, value)


def _user_step(replica: LightningModule, precision: Precision, microbatch: Any, batch_idx: int) -> Tensor:
    """The loss ``replica.training_step`` returns on fake tensors; what keeps it from running
    there, as :class:`UncheckableStepError`."""
    with _step_context(precision):
        try:
            returned = replica.training_step(microbatch, batch_idx)
        except NotImplementedError as error:  # an operator without a meta kernel
            raise UncheckableStepError(f"an operator cannot run on fake tensors: {error}") from error
        except DataDependentOutputException as error:  # fake tensors standing on the CPU
            raise UncheckableStepError(f"training_step reads a tensor's value ({error})") from error
        except DynamicOutputShapeException as error:
            raise UncheckableStepError(f"an operator's output shape depends on values ({error})") from error
        except RuntimeError as error:
            text = str(error)
            if "meta tensors" in text:
                raise UncheckableStepError(f"training_step reads a tensor's value: {error}") from error
            if "meta" in text and ("expected device" in text or "same device" in text):
                # a tensor the step made on a fixed device, met with the batch's
                raise UncheckableStepError(
                    f"training_step makes tensors on a fixed device, not the batch's (torch.rand(shape) rather "
                    f"than torch.rand_like(x) or device=x.device): {error}"
                ) from error
            raise
    return cast(Tensor, returned["loss"] if isinstance(returned, Mapping) else returned)


def _policy(precision: Precision) -> AbstractContextManager[Any]:
    """What the whole fake step runs in: for CUDA stages under ``*-mixed``, CUDA's autocast
    policy on the CPU (:func:`~lightning_pipe.autocast.cuda_policy`), which casts layer norm,
    softmax and the losses to float32 where the CPU's keeps them in the lower precision."""
    return cuda_policy() if isinstance(precision, MixedPrecision) and precision.device == "cuda" else nullcontext()


def _step_context(precision: Precision) -> AbstractContextManager[Any]:
    """``precision``'s training-step context, on the fake CPU tensors of the check (CUDA
    stages' autocast too, as :func:`_policy` casts)."""
    if isinstance(precision, MixedPrecision) and precision.device == "cuda":
        dtype = torch.bfloat16 if precision.precision == "bf16-mixed" else torch.float16
        return torch.autocast("cpu", dtype=dtype, cache_enabled=False)
    return precision.train_step_context()


def meta_replica(
    module: LightningModule, captured: Captured, shapes: Mapping[int, torch.Size] | None = None
) -> tuple[LightningModule, Captured]:
    """:func:`~lightning_pipe.runtime.fake.meta_copy` of ``module``, sharing its Trainer; the
    strategy's ``forward`` is not copied. ``shapes``: each tensor's shape by ``id``, where
    ``module`` holds some without storage (a distributed rank's released tensors)."""
    forward = vars(module).pop("forward", None)
    try:
        trainer = attached_trainer(module)
        replica, graph = meta_copy(module, captured, [trainer] if trainer is not None else [], shapes)
    finally:
        if forward is not None:
            module.forward = forward  # type: ignore[method-assign]
    return cast(LightningModule, replica), graph


def _twin(optimizer: torch.optim.Optimizer, module: nn.Module, replica: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s kind and settings over ``replica``'s parameters."""
    copies = dict(zip(map(id, module.parameters()), replica.parameters()))
    groups = [{**g, "params": [copies[id(p)] for p in g["params"] if id(p) in copies]} for g in optimizer.param_groups]
    return rebuild(optimizer, groups)


def _inert_metrics(replica: nn.Module) -> None:
    """Every torchmetrics ``Metric`` of the copy returns a scalar and keeps nothing: metrics
    hold no stage's memory, their operators (``unique``) have no meta kernels, and what they
    return only reaches ``self.log``, which the check silences."""
    for parent in list(replica.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Metric):
                parent.register_module(name, _Inert())


class _Inert(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return torch.zeros((), device="meta")

    def update(self, *args: Any, **kwargs: Any) -> None:
        pass

    def compute(self) -> Tensor:
        return torch.zeros((), device="meta")
