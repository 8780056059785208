"""FSDP inside the pipeline: each rank's stages sharded over the stage's data-parallel replicas.

``data_parallel="fsdp"``: every stage module is wrapped by ``torch.distributed.fsdp.fully_shard``
over the ``"dp"`` dimension of the ``("pp", "dp")`` mesh, so a replica holds ``1 / replicas`` of
its stage's parameters, gradients and optimizer state between steps. Inside the stage, the
units that gather and free their parameters together, and whether they free them after a
forward, are the plan's (:func:`planned_shardings`, applied by :func:`sharding`); the stage
module is the root unit, which ``torch.distributed.pipelining`` drives (it defers the gradient
reduce-scatter to the last micro-batch, then reshards).

``fully_shard`` swaps each parameter for a new, sharded one (a ``DTensor``), registered where
the old one was: the LightningModule, the optimizer and the pipeline's bookkeeping are told of
the swap (:func:`shard_stages` returns it, old ``id`` to new parameter).

A model built on the meta device is sharded before it has values: each replica is sent only
its rows of each parameter (:func:`shard_of`, the rows ``fully_shard`` gives it), which
:func:`fill_shard` puts under the sharded parameter, so no rank holds its stage whole.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_pipe.internals import parameter_table
from lightning_pipe.plan.profile import block_of

__all__ = [
    "MixedPrecisionPolicy", "PlannedSharding", "Sharding", "check_shardable", "fill_shard", "fsdp_roots",
    "full_value", "is_shard", "managed_parameters", "mixed_precision", "planned_shardings", "reshard_value",
    "shard_of", "shard_optimizer", "shard_stages", "sharding",
]


@dataclass(frozen=True)
class Sharding:
    """How one stage is sharded: ``units``, groups of its modules gathered and freed together
    (what no unit holds belongs to the stage's root unit), and whether a unit frees its
    gathered parameters after its forward (``reshard_after_forward``: less memory, one more
    all-gather in the backward)."""

    units: list[list[nn.Module]]
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class PlannedSharding:
    """A plan's choice for one stage (:class:`~lightning_pipe.plan.plan.StageReport`): the
    blocks that are units of their own, by the graph's name of their module (``model_layers_3``
    for ``model.layers.3``; none: the stage is one unit), and ``reshard_after_forward``."""

    blocks: frozenset[str]
    reshard_after_forward: bool


class _PlannedStage(Protocol):
    fsdp_units: list[list[int]]
    reshard_after_forward: bool | None


class _Plan(Protocol):
    """What :func:`planned_shardings` reads of a :class:`~lightning_pipe.plan.plan.Plan`."""

    data_parallel: str
    nodes: list[str]

    @property
    def stages(self) -> Sequence[_PlannedStage]: ...


def planned_shardings(plan: _Plan) -> list[PlannedSharding] | None:
    """Each stage's :class:`PlannedSharding` in a plan made for ``data_parallel="fsdp"`` (``None``
    for another: the runtime then chooses, :func:`sharding`)."""
    if plan.data_parallel != "fsdp":
        return None
    return [PlannedSharding(frozenset(b for start, _ in s.fsdp_units if (b := block_of(plan.nodes[start]))),
                            bool(s.reshard_after_forward)) for s in plan.stages]


def sharding(stage: nn.Module, root: nn.Module, planned: PlannedSharding | None = None) -> Sharding:
    """The units of ``stage`` (a stage module of ``root``): one per layer block it runs (the
    modules under one index of a ``ModuleList`` or ``Sequential``, ``blocks.3``) that the plan
    made a unit (``planned``; without one: every block, or none, the whole stage one unit,
    where it runs fewer than two), and its ``reshard_after_forward`` (without a plan: each unit
    frees its parameters after the forward). A module sharing a parameter with a module
    outside its block stays in the root unit (FSDP keeps a parameter in one unit)."""
    names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    blocks: dict[str, list[nn.Module]] = {}
    for module in stage.modules():
        if id(module) in names and any(True for _ in module.parameters(recurse=False)):
            block = _block(names[id(module)])
            if block is not None:
                blocks.setdefault(block, []).append(module)
    outside: dict[str, set[int]] = {}  # the parameters each block's modules share with modules outside it
    for module in stage.modules():
        block = _block(names.get(id(module), ""))
        for p in module.parameters(recurse=False):
            for other in blocks:
                if other != block:
                    outside.setdefault(other, set()).add(id(p))
    units = [
        [m for m in modules if not {id(p) for p in m.parameters(recurse=False)} & outside.get(block, set())]
        for block, modules in blocks.items() if planned is None or block.replace(".", "_") in planned.blocks
    ]
    units = [u for u in units if u]
    if planned is not None:
        return Sharding(units, planned.reshard_after_forward)
    return Sharding(units if len(units) > 1 else [], reshard_after_forward=True)


def _block(name: str) -> str | None:
    """The layer block a module's qualified name lies in (up to its first index), if any."""
    parts = name.split(".")
    index = next((k for k, part in enumerate(parts) if part.isdigit()), None)
    return None if index is None else ".".join(parts[: index + 1])


def check_shardable(root: nn.Module) -> None:
    """Raise unless ``fully_shard`` can shard every parameter of ``root`` (on dim 0): frozen
    ones too, which it shards alike, and ones on the meta device, which keep their strides
    when they get storage.

    Raises:
        ValueError: a parameter is a scalar or not contiguous, named with the fix.
    """
    for name, p in root.named_parameters():
        if p.ndim == 0:
            raise ValueError(
                f"Parameter {name!r} is a scalar (shape ()), which data_parallel='fsdp' cannot shard: fully_shard "
                f"splits parameters along dim 0. Make it a tensor of shape (1,), or use data_parallel='ddp'."
            )
        if not p.is_contiguous():
            raise ValueError(
                f"Parameter {name!r} is not contiguous (shape {tuple(p.shape)}, stride {p.stride()}), which "
                f"data_parallel='fsdp' cannot shard. Make it contiguous where it is built (.contiguous()), or use "
                f"data_parallel='ddp'."
            )


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP's mixed precision for a Trainer precision: ``bf16-mixed`` gathers parameters in
    bfloat16 and reduces gradients in float32, as autocast would compute, and each unit hands
    its outputs on in float32, as autocast's residual streams are (on bfloat16 parameters the
    embeddings would make them bfloat16) and as a stage's boundary says
    (:func:`~lightning_pipe.runtime.distributed.cuts`). Other precisions keep the parameters'
    dtype.

    Raises:
        ValueError: ``16-mixed``, whose grad scaler cannot unscale sharded gradients here.
    """
    if precision in ("16-mixed", "16"):
        raise ValueError(
            "data_parallel='fsdp' does not run precision='16-mixed' (its grad scaler would unscale sharded "
            "gradients per rank). Use precision='bf16-mixed', or data_parallel='ddp'."
        )
    if precision in ("bf16-mixed", "bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    output_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_stages(
    stages: Sequence[nn.Module], root: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy,
    planned: Sequence[PlannedSharding] | None = None,
) -> dict[int, nn.Parameter]:
    """``fully_shard`` each of ``stages`` (modules of ``root``'s parameters) over ``mesh``, its
    units first (:func:`sharding`, by ``planned``, one per stage, where given), then every
    parameter ``root`` registers swapped for its sharded one. The swap: ``id`` of each old
    parameter to its sharded one."""
    places = _places(root, stages)
    for k, stage in enumerate(stages):
        plan = sharding(stage, root, None if planned is None else planned[k])
        for unit in plan.units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=policy)
        fully_shard(stage, mesh=mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=policy)
    swapped: dict[int, nn.Parameter] = {}
    for module, name, old in places:
        new = parameter_table(module)[name]
        if new is not old and isinstance(new, nn.Parameter):
            swapped[id(old)] = new
    for _, module in root.named_modules(remove_duplicate=False):
        table = parameter_table(module)
        for name, p in list(table.items()):
            if p is not None and id(p) in swapped:
                table[name] = swapped[id(p)]
    return swapped


def _places(root: nn.Module, stages: Sequence[nn.Module]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Where each parameter of ``stages`` is registered, before sharding swaps it."""
    return [
        (module, name, p)
        for stage in stages for module in stage.modules() for name, p in parameter_table(module).items()
        if p is not None
    ]


def managed_parameters(stage: nn.Module) -> set[int]:
    """``id`` of each parameter :func:`shard_stages` shards with ``stage``: every one
    registered in its modules (buffers stay whole)."""
    return {id(p) for _, _, p in _places(stage, [stage])}


def shard_of(t: Tensor, replicas: int, replica: int) -> Tensor:
    """The rows of ``t`` (dim 0) that ``fully_shard`` over ``replicas`` leaves ``replica``: a
    view; empty past the last of ``torch.chunk``'s pieces."""
    pieces = torch.chunk(t, replicas, dim=0)
    return pieces[replica] if replica < len(pieces) else t[t.shape[0]:]


def fill_shard(param: Tensor, local: Tensor) -> None:
    """Give ``param``, sharded while on the meta device, this replica's rows ``local``
    (:func:`shard_of` of its value) as storage. The object stays: FSDP, the optimizer and the
    module keep it (FSDP pads an uneven shard when it first gathers)."""
    assert isinstance(param, DTensor) and param.to_local().is_meta, "fill_shard takes a sharded parameter on meta"
    value = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                               stride=param.stride())
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))  # type: ignore[no-untyped-call]


def is_shard(t: Tensor) -> bool:
    return isinstance(t, DTensor)


def full_value(t: Tensor) -> Tensor:
    """The whole of a sharded tensor (a collective over its replicas), or ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def reshard_value(like: Tensor, value: Tensor) -> Tensor:
    """``value``, a whole tensor, as ``like`` shards it (this replica's part; no collective)."""
    if isinstance(like, DTensor) and not isinstance(value, DTensor):
        return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements,
                                 src_data_rank=None)
    return value


def shard_optimizer(optimizer: Optimizer, swapped: Mapping[int, nn.Parameter]) -> None:
    """Point ``optimizer`` at the sharded parameters; state it holds of an old parameter (a
    checkpoint loaded before the stages were built) moves to the new one, sharded alike."""
    for group in optimizer.param_groups:
        group["params"] = [swapped.get(id(p), p) for p in group["params"]]
    for old in [p for p in optimizer.state if id(p) in swapped]:
        new = swapped[id(old)]
        state = optimizer.state.pop(old)
        optimizer.state[new] = {k: _shard_like(new, v) for k, v in state.items()}
    for param, state in list(optimizer.state.items()):
        if isinstance(param, DTensor):
            optimizer.state[param] = {k: _shard_like(param, v) for k, v in state.items()}


def _shard_like(param: Tensor, value: object) -> object:
    if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
        return reshard_value(param, value)
    return value


def fsdp_roots(stages: Iterable[nn.Module]) -> list[FSDPModule]:
    """The root units among ``stages``: a run outside the schedule gathers them first."""
    return [s for s in stages if isinstance(s, FSDPModule)]
