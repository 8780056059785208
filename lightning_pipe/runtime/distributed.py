"""Distributed: one pipeline stage (or a few) per process, on ``torch.distributed.pipelining``.

The one adapter around ``torch.distributed.pipelining``: nothing else imports it. A rank builds
the same :class:`~lightning_pipe.runtime.build.Program` as the one-process runtime and keeps
only its own stages (recompute and swap segments included). ``PipelineStage`` and the
schedules (:data:`SCHEDULES`) only talk between adjacent stages and only send tensors, so
what crosses a cut is flattened: every value a later stage reads (a U-Net skip, the encoder
output every decoder stage reads, a forward argument the last stage reads) is carried through
the stages in between, and non-tensor leaves (sizes, flags) are constants taken from one
example micro-batch. Shapes are static, as ``pipelining`` requires: the cut metadata is given
to ``PipelineStage`` so that it runs no shape-inference pass of its own.

Forward-only runs (validation, test, predict) take any batch size: they send each cut's
values as objects, micro-batch by micro-batch.

A rank that runs out of memory in a training step cannot stop there: its peers would wait
forever on the sends and receives it owes them. It goes on through the schedule without
computing (:class:`StageFailure`: zeros where it sends, no backward), and after the step every
rank learns of the failure together.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import InitVar, dataclass
from datetime import timedelta
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.fx.node import map_aggregate

from lightning_pipe.graph.capture import get_attr
from lightning_pipe.graph.microbatch import gather
from lightning_pipe.internals import (
    NoWarmupVotes,
    PipelineStageBase,
    TreeSpec,
    fake_process_group,
    skip_backward,
    skip_weight_backward,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from lightning_pipe.measure.clock import StageClock
from lightning_pipe.measure.meter import MemoryMeter, StageOutOfMemoryError
from lightning_pipe.plan.schedule import GRADIENT_BUCKET_BYTES, DistributedSchedule, placement, process_stages
from lightning_pipe.runtime.build import Program, Stage
from lightning_pipe.runtime.fsdp import (
    MixedPrecisionPolicy,
    PlannedSharding,
    fill_shard,
    fsdp_roots,
    full_value,
    is_shard,
    managed_parameters,
    reshard_value,
    shard_of,
    shard_stages,
)
from lightning_pipe.runtime.materialize import allocate, has_meta, own_tensors, to_meta

__all__ = [
    "OUT_OF_MEMORY", "Cut", "DistributedPipeline", "DistributedSchedule", "PipelineRank", "StageFailure", "StageModule",
    "StageRunner", "TensorMeta", "constants", "cuts", "pipeline_mesh", "silent_mesh", "to_device", "to_host",
]

#: What a step that ran out of memory raises: the meter's limit, or the device's.
OUT_OF_MEMORY = (StageOutOfMemoryError, torch.OutOfMemoryError)

#: ``torch.distributed.pipelining``'s schedule for each of ours: one stage per process, or
#: several (``"1f1b"`` with several is Interleaved 1F1B). The zero-bubble and V-shape ones split
#: each backward into the input gradients' and, later, the weights' (``stage_backward_input``,
#: ``stage_backward_weight``).
SCHEDULES: dict[tuple[DistributedSchedule, bool], type] = {
    ("gpipe", False): ScheduleGPipe,
    ("1f1b", False): Schedule1F1B,
    ("1f1b", True): ScheduleInterleaved1F1B,
    ("interleaved-1f1b", True): ScheduleInterleaved1F1B,
    ("interleaved-1f1b", False): ScheduleInterleaved1F1B,
    ("interleaved-zb", True): ScheduleInterleavedZeroBubble,
    ("interleaved-zb", False): ScheduleInterleavedZeroBubble,
    ("zbv", True): ScheduleZBVZeroBubble,
    ("dualpipev", True): ScheduleDualPipeV,
}



@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor crossing a cut, per micro-batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def example(self, requires_grad: bool) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype).requires_grad_(requires_grad and self.dtype.is_floating_point)


@dataclass
class Cut:
    """What crosses one cut, flattened: tensor leaves travel, the other leaves are constants."""

    spec: TreeSpec
    leaves: list[Any]  # TensorMeta for a tensor, else the constant itself

    @classmethod
    def of(cls, value: Any) -> "Cut":
        leaves, spec = tree_flatten(value)
        return cls(spec, [TensorMeta(tuple(v.shape), v.dtype) if isinstance(v, Tensor) else v for v in leaves])

    def flatten(self, value: Any) -> tuple[Tensor, ...]:
        leaves, _ = tree_flatten(value)
        return tuple(v for v, meta in zip(leaves, self.leaves) if isinstance(meta, TensorMeta))

    def unflatten(self, tensors: Sequence[Tensor]) -> Any:
        sent = iter(tensors)
        return tree_unflatten([next(sent) if isinstance(m, TensorMeta) else m for m in self.leaves], self.spec)

    def examples(self, requires_grad: bool) -> tuple[Tensor, ...]:
        return tuple(m.example(requires_grad) for m in self.leaves if isinstance(m, TensorMeta))

    def cast(self, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """``tensors`` (flattened) in the dtypes the cut says: the receiver reads the bytes so.
        A stage under autocast makes bfloat16 where the cut, described without it, says
        float32 (a cut right after a linear layer), which would arrive as garbage."""
        metas = [m for m in self.leaves if isinstance(m, TensorMeta)]
        return tuple(t.to(m.dtype) for t, m in zip(tensors, metas))


def cuts(program: Program, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Cut]:
    """Run ``program`` on one micro-batch (no gradients) and describe what crosses each cut:
    entry ``s`` is what stage ``s`` receives (entry 0: the forward's arguments), entry ``n``
    what the last stage returns."""
    env = {**program.bind(args, kwargs), **program.attribute_values(root)}
    with torch.no_grad():
        for stage in program.stages:
            env.update(zip(stage.outputs, stage(*[env[n] for n in stage.inputs])))
    result = [Cut.of({n: env[n] for n in carried(program, s)}) for s in range(len(program.stages))]
    return result + [Cut.of(map_aggregate(program.output, lambda n: env[cast(str, n)]))]


def carried(program: Program, stage: int) -> list[str]:
    """Names of the values stage ``stage`` receives: made before it (a forward argument counts
    as made before stage 0) and read by it or a later stage (or returned)."""
    made = dict.fromkeys(program.placeholders, -1)
    for s in program.stages:
        made.update((name, s.index) for name in s.outputs)
    return [n for n, m in made.items() if m < stage <= program.last_use.get(n, -1)]


class StageRunner(nn.Module):
    """This rank's stage of a program, run on values by name: forward-only runs take any
    program of the model (its evaluation graph's too).

    The stage's graph modules are its children, so ``parameters()`` are the ones it uses,
    each the model's own ``Parameter``; the model itself is not a child.
    """

    def __init__(self, program: Program, index: int, root: nn.Module) -> None:
        super().__init__()
        self.stage: Stage = program.stages[index]
        self.segments = nn.ModuleList(seg.module for seg in self.stage.segments)
        self.program = program
        self._root = [root]  # in a list: not a child
        self.receives = carried(program, index)
        self.sends = carried(program, index + 1) if index + 1 < len(program.stages) else None
        self.is_last = self.sends is None
        # the running step's non-tensor forward arguments: they do not travel, every rank knows them
        self.arguments: dict[str, Any] = {}
        # the stage module holding the parameters read by attribute, where FSDP shards them (hold_attributes)
        self.attribute_source: list[StageModule] = []  # (in a list: not a child)

    def run(self, received: dict[str, Any]) -> Any:
        """What this stage sends on (by name), or on the last stage the forward's output."""
        env = dict(received)
        env.update((n, v) for n, v in self.arguments.items() if n in env)
        env.update((n, v) for n, v in self._attribute_values().items() if n in self.stage.inputs)
        env.update(zip(self.stage.outputs, self.stage(*[env[n] for n in self.stage.inputs])))
        if self.sends is None:
            return map_aggregate(self.program.output, lambda n: env[cast(str, n)])
        return {n: env[n] for n in self.sends}

    def _attribute_values(self) -> dict[str, Tensor]:
        values = self.program.attribute_values(self._root[0])
        for source in self.attribute_source:
            held = source.held_attributes
            values.update((n, getattr(held, source.attribute_names[q])) for n, q in self.program.attributes.items()
                          if q in source.attribute_names)
        return values

    def tensors(self) -> list[Tensor]:
        """Every parameter and buffer the stage reads, by attribute or inside its modules."""
        found = {id(t): t for seg in self.segments for t in [*seg.parameters(), *seg.buffers()]}
        for name, qualname in self.program.attributes.items():
            if name in self.stage.inputs:
                value = get_attr(self._root[0], qualname)
                found[id(value)] = value
        return list(found.values())


class StageFailure:
    """This rank's training step ran out of memory (``error``): the rest of the step runs
    without computing, each forward handing on zeros and each backward skipped (sending zero
    gradients), so the schedule's messages still meet their peers'. ``on_failure`` is called
    once, at the failure: what allocates past a limit must stop enforcing it for the rest of
    the step (the meter)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] = lambda error: None

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self.on_failure(error)

    def clear(self) -> BaseException | None:
        """The failure of the step just run (``None``: it succeeded), forgotten for the next."""
        error, self.error = self.error, None
        return error


class StageModule(StageRunner):
    """This rank's stage of the training program as a module on flat tensors, for
    ``PipelineStage``: ``boundaries`` say what crosses each cut."""

    def __init__(self, program: Program, index: int, root: nn.Module, boundaries: Sequence[Cut]) -> None:
        super().__init__(program, index, root)
        self.inputs, self.outputs = boundaries[index], boundaries[index + 1]
        self.clock: StageClock | None = None  # this rank's stage as stage 0
        self.meter: MemoryMeter | None = None
        # what each forward runs in: the Trainer precision's autocast, which Lightning opens only
        # around training_step, which on every rank but the last never calls a stage's forward
        self.step_context: Callable[[], AbstractContextManager[Any]] = nullcontext
        # what each forward of (stage, micro-batch) draws its random numbers (dropout) under
        self.randomness: Callable[[int, int], AbstractContextManager[Any]] = lambda stage, microbatch: nullcontext()
        self.failure = StageFailure()  # the rank's, shared by its stages (DistributedPipeline)
        self.held_attributes = nn.Module()  # the parameters the stage reads by attribute, once held
        self.attribute_names: dict[str, str] = {}  # qualified name in the model -> name in held_attributes

    def hold_attributes(self) -> None:
        """Register the parameters this stage reads by attribute (not inside its modules) as
        its own, so that FSDP shards them with the stage and gathers them for its forward."""
        for name, qualname in self.program.attributes.items():
            value = get_attr(self._root[0], qualname)
            if name in self.stage.inputs and isinstance(value, nn.Parameter) and qualname not in self.attribute_names:
                self.attribute_names[qualname] = f"p{len(self.attribute_names)}"
                self.held_attributes.register_parameter(self.attribute_names[qualname], value)
        self.attribute_source = [self]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Every parameter the stage reads, by attribute too (a graph torch.export captured reads
        them so): the zero-bubble schedules make the weights' gradients for these alone."""
        for tensor in self.tensors():
            if isinstance(tensor, nn.Parameter):
                yield tensor

    def forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        if self.failure.error is None:
            try:
                return self._forward(*tensors)
            except OUT_OF_MEMORY as error:
                self.failure.fail(error)
        device = tensors[0].device if tensors else self.stage.device
        return tuple(torch.zeros(e.shape, dtype=e.dtype, device=device) for e in self.outputs.examples(False))

    def _forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        # a received tensor is a leaf requiring grad (pipelining's receive buffer), which a
        # stage writing its input in place (ReLU(inplace=True) right after the cut) may not
        # write to: the stage reads an alias of it that autograd lets it write
        tensors = tuple(_Alias.apply(t) if t.requires_grad and t.is_leaf else t for t in tensors)  # type: ignore[no-untyped-call]
        with self.step_context(), self.clock.forward(0, self.stage.device) if self.clock else nullcontext():
            # (gloo sends only contiguous tensors: a transposed view leaving the stage is copied)
            made = self.outputs.flatten(self.run(self.inputs.unflatten(tensors)))
            outputs = tuple(t.contiguous() for t in self.outputs.cast(made))
        # the zero-bubble schedules detach a stage's outputs in place once their input gradients
        # are made, and the weights' gradients come later: an output an operator saved for its
        # backward (a ReLU's, a cut after it) leaves as an alias, which may be detached, and one
        # without gradient as a detached tensor (no view: an expanded mask cannot be detached)
        outputs = tuple(_Alias.apply(t) if t.requires_grad else t.detach() for t in outputs)  # type: ignore[no-untyped-call]
        if self.meter is not None:
            self.meter.tag_backward(outputs, 0)  # the backward's allocations are this stage's
        return outputs


class _Alias(torch.autograd.Function):
    """Identity on the same storage (no copy), whose output is neither a leaf nor a view."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        # (a received input's gradient is sent back, and gloo sends only contiguous tensors: the
        # zero-bubble schedules send what autograd.grad made, which may be an expanded view)
        return grad.contiguous()


@dataclass(eq=False)
class PipelineRank:
    """One rank's stages in one pipeline replica: training steps on a ``pipelining`` schedule,
    forward-only runs over object point-to-point, and the gradient reductions across ranks.
    ``modules``: the rank's stages, in order; ``indices``: their places among all
    ``num_stages`` (placed on the ranks by ``schedule``, :func:`~lightning_pipe.plan.schedule.placement`)."""

    modules: list[StageModule]
    indices: list[int]
    num_stages: int
    group: dist.ProcessGroup  # the pipeline's ranks
    device: torch.device
    schedule: InitVar[DistributedSchedule]
    chunks: int
    loss_fn: Callable[[Any, Tensor], Tensor]
    fake: bool = False  # on a silent mesh (DistributedPipeline's fake)

    def __post_init__(self, schedule: DistributedSchedule) -> None:
        self.ranks = dist.get_world_size(self.group)
        stage_type = _SilentStage if self.fake else _TimedStage
        stages: list[PipelineStageBase] = [
            stage_type(
                module, index, self.num_stages, self.device,
                input_args=module.inputs.examples(requires_grad=index > 0),
                output_args=module.outputs.examples(requires_grad=index < self.num_stages - 1),
                group=self.group,
            )
            for module, index in zip(self.modules, self.indices)
        ]
        kind = SCHEDULES[schedule, len(stages) > 1]  # (the options allow only these)
        for stage in stages:
            if isinstance(stage, _SilentStage):
                stage.holds_sends = kind not in (ScheduleGPipe, Schedule1F1B)
        if kind in (ScheduleGPipe, Schedule1F1B):
            self._schedule: Any = kind(stages[0], self.chunks, loss_fn=self._loss, scale_grads=False)
        else:
            self._schedule = kind(stages, self.chunks, loss_fn=self._loss, scale_grads=False)
        self._placement = placement(schedule, self.ranks, len(stages))

    @property
    def is_first(self) -> bool:
        return self.indices[0] == 0

    @property
    def is_last(self) -> bool:
        return self.indices[-1] == self.num_stages - 1

    def _loss(self, output: Any, target: Tensor) -> Tensor:
        failure = self.modules[-1].failure
        if failure.error is None:
            outputs = output if isinstance(output, tuple) else (output,)
            try:
                return self.loss_fn(self.modules[-1].outputs.unflatten(outputs), target)
            except OUT_OF_MEMORY as error:
                failure.fail(error)
        return torch.zeros((), device=self.device)  # its backward is skipped (_TimedStage)

    def train_step(self, received: dict[str, Any] | None) -> None:
        """Forward and backward of one batch, gradients accumulated in ``.grad``. The first
        stage's rank passes the whole batch's forward arguments (by name); the last stage's
        ``loss_fn`` receives each micro-batch's output and a one-element tensor with its index."""
        if self.is_first:
            assert received is not None, "stage 0 needs the forward's arguments"
            first = self.modules[0]  # the arguments it receives, in its cut's order (not the binding's)
            inputs = first.inputs.flatten({name: received[name] for name in first.receives})
            self._schedule.step(*inputs, target=_indices(self.chunks), return_outputs=False)
        elif self.is_last:  # losses come from loss_fn: no merged outputs to keep
            self._schedule.step(target=_indices(self.chunks), return_outputs=False)
        else:
            self._schedule.step()

    def forward_only(self, runners: list[StageRunner], microbatches: list[dict[str, Any]] | None, count: int) -> Any:
        """The forward of ``count`` micro-batches through ``runners`` (this rank's stages of any
        program of the model), one micro-batch at a time through every stage, any shapes: the
        first stage's rank passes them (by name); the last stage's rank returns the merged
        output, the others ``None``."""
        outputs, rank = [], dist.get_rank(self.group)
        for i in range(count):
            result: Any = None  # the previous stage's, when this rank runs it too (a V's turn)
            for runner, index, module in zip(runners, self.indices, self.modules):
                if index == 0:
                    assert microbatches is not None, "stage 0 needs the forward's arguments"
                    received = microbatches[i]
                elif self._placement[index - 1] == rank:
                    received = result
                else:
                    received = self._recv(self._placement[index - 1])
                with torch.no_grad(), _gathered(module):
                    result = runner.run(received)
                if runner.is_last:
                    outputs.append(result)
                elif self._placement[index + 1] != rank:
                    self._send(result, self._placement[index + 1])
        return gather(outputs, self.device) if outputs else None

    def _send(self, value: Any, rank: int) -> None:
        dist.send_object_list([to_host(value)], group_dst=rank, group=self.group, device=self.device)

    def _recv(self, rank: int) -> Any:
        box: list[Any] = [None]
        dist.recv_object_list(box, group_src=rank, group=self.group, device=self.device)
        return to_device(box[0], self.device)


@contextmanager
def _gathered(module: nn.Module) -> Iterator[None]:
    """A stage's root FSDP unit gathered around a run outside the schedule (its blocks'
    units gather themselves, when called); nothing for an unsharded stage."""
    roots = fsdp_roots([module])
    for root in roots:
        root.unshard()
    try:
        yield
    finally:
        for root in roots:
            root.reshard()


class _TimedStage(PipelineStage):
    """Times each micro-batch's backward (both halves of a split one: zero-bubble, V-shape) on
    the stage module's clock; after this rank ran out of memory in the step
    (:class:`StageFailure`), skips it, sending zero gradients. Runs each micro-batch's forward
    under the stage module's randomness for it: a stage's dropout masks do not depend on the
    order the schedule runs it in, nor on which rank holds the stage."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with cast(StageModule, self.submod).randomness(self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._whole: set[int] = set()  # the micro-batches whose split backward ran whole, in one step

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        metas = [m for m in cast(StageModule, self.submod).inputs.leaves if isinstance(m, TensorMeta)]
        if kwargs.get("full_backward") is False and not self.is_first and not any(
                m.dtype.is_floating_point or m.dtype.is_complex for m in metas):
            # pipelining's split backward finds a weight's gradient only past an input that carries
            # one (the first stage aside, which it runs whole): a later stage receiving only integer
            # tensors (the token ids, where a plan gives the first stage no more than their read)
            # never made its weights' gradients, and its embedding never trained. It runs whole here
            kwargs["full_backward"] = True
            self._whole.add(bwd_chunk_id)
        self._timed(partial(super().backward_one_chunk, bwd_chunk_id, *args, **kwargs),
                    partial(skip_backward, self, bwd_chunk_id, len(metas)))

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        if bwd_chunk_id in self._whole:  # (its weights' gradients made with its inputs')
            self._whole.discard(bwd_chunk_id)
            return
        self._timed(partial(super().backward_weight_one_chunk, bwd_chunk_id, *args, **kwargs),
                    partial(skip_weight_backward, self, bwd_chunk_id))

    def _timed(self, run: Callable[[], None], skip: Callable[[], None]) -> None:
        module = cast(StageModule, self.submod)
        if module.failure.error is None:
            try:
                with module.clock.backward(0, self.device) if module.clock else nullcontext():
                    run()
                return
            except RuntimeError as error:  # (pipelining raises its own, from the backward's)
                cause = error if isinstance(error, OUT_OF_MEMORY) else error.__cause__
                if not isinstance(cause, OUT_OF_MEMORY):
                    raise
                module.failure.fail(cause)
        skip()


class _SilentStage(NoWarmupVotes, _TimedStage):
    """A stage on a silent mesh, where no peer's vote arrives: it takes the static shapes every
    stage votes for when given its input and output metadata, as each stage here is. (The
    vote is ``pipelining``'s private warm-up, which would read a tensor without data.)

    A real process group's send keeps its tensor alive until the schedule drops its work, which
    the schedules of several stages per process do at the step's end (gloo's, checked); a fake
    group's keeps nothing. Under them (``holds_sends``) this stage keeps what it sends as long."""

    holds_sends = False

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._held(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._held(super().get_bwd_send_ops(bwd_chunk_id))

    def clear_runtime_states(self) -> None:  # (the schedules call it as a step begins)
        super().clear_runtime_states()
        self.sent: list[Tensor] = []

    def _held(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        if self.holds_sends:
            self.sent.extend(op.tensor for op in ops)
        return ops


def constants(bound: dict[str, Any]) -> dict[str, Any]:
    """The forward arguments of a binding that hold no tensor: cuts carry only tensors, so
    every rank's stages read these (:meth:`DistributedPipeline.set_arguments`)."""
    return {
        name: value for name, value in bound.items() if not any(isinstance(x, Tensor) for x in tree_flatten(value)[0])
    }


def to_host(value: Any) -> Any:
    """``value`` with every tensor detached and copied to the CPU: what an object collective
    may carry (it unpickles a CUDA tensor on the sender's device index, another GPU on the
    receiving process, or one it cannot see)."""
    return tree_map(lambda t: t.detach().to("cpu", copy=True) if isinstance(t, Tensor) else t, value)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` received from an object collective, its tensors moved to ``device``."""
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, value)


def _indices(chunks: int) -> Tensor:
    return torch.arange(chunks)



class DistributedPipeline:
    """This process's part of a pipeline of ``ranks`` processes times ``replicas``
    data-parallel copies, on a ``("pp", "dp")`` device mesh (pipeline outermost: global rank
    = ``position * replicas + replica``). A program of more stages than ranks is placed on them
    as ``schedule`` places it (:func:`~lightning_pipe.plan.schedule.placement`: a loop, or a V).

    Every rank builds the same program from the same plan and keeps only the tensors its
    stages read; the rest become empty. Global rank 0's values are the model's: it sends
    each rank its stages' tensors. A parameter read by several stages (a tied embedding) is
    held by each of them, one logical parameter: its gradient is summed over those ranks
    before the data-parallel average. ``release=False`` keeps every tensor (a provisional
    pipeline, for evaluation before the planned one is built). ``timeout``: how long the
    gradient reductions of tied parameters wait (default: ``torch.distributed``'s).

    ``fake``: ``root`` is a :func:`~lightning_pipe.runtime.fake.meta_copy` and ``mesh`` a
    :func:`silent_mesh`: a training step of this rank as it would run, on tensors without data
    (:func:`~lightning_pipe.runtime.fake.fake_rank_training`).

    A model built on the meta device (:mod:`~lightning_pipe.runtime.materialize`) is never
    whole in any process: rank 0 initialises it module by module (``init``, called with each
    module whose tensors it has just given storage) and sends each tensor on before the next
    module; the other ranks give storage only to their stages' tensors, and what a rank does
    not hold stays on the meta device. ``previous``: the tensors each pipeline rank held in a
    released pipeline this one replaces (its ``held_by_rank``); a rank then receives what it
    lacks from the rank of its replica that held it. ``shapes``: that pipeline's
    :attr:`shapes`, the shape of each tensor by ``id`` (a released one's storage is empty).

    ``fsdp`` (a mixed precision policy): shard this rank's stages over its replicas
    (:mod:`~lightning_pipe.runtime.fsdp`) in place of reducing whole gradients across them;
    :attr:`swapped` maps each old parameter's ``id`` to its sharded one, which the
    optimizer must take (:func:`~lightning_pipe.runtime.fsdp.shard_optimizer`). A meta-built
    model is then never whole in a stage either: each replica receives only its shard of each
    parameter, and the rank that initialises or held a tensor keeps only its shard of it.
    ``planned``: each stage's units and ``reshard_after_forward`` as its plan chose them
    (:func:`~lightning_pipe.runtime.fsdp.planned_shardings`; ``None``: the runtime's own).
    """

    def __init__(
        self,
        program: Program,
        root: nn.Module,
        boundaries: Sequence[Cut],
        mesh: DeviceMesh,
        schedule: DistributedSchedule,
        chunks: int,
        loss_fn: Callable[[Any, Tensor], Tensor],
        device: torch.device,
        release: bool = True,
        timeout: timedelta | None = None,
        previous: Sequence[set[int]] | None = None,
        init: Callable[[nn.Module], None] | None = None,
        fake: bool = False,
        shapes: Mapping[int, torch.Size] | None = None,
        fsdp: MixedPrecisionPolicy | None = None,
        planned: Sequence[PlannedSharding] | None = None,
    ) -> None:
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "this rank is not in the mesh"
        self.position, self.replica = coordinate  # this rank's place in its pipeline, and its replica
        self.ranks, self.replicas = mesh.size(0), mesh.size(1)
        self.num_stages = len(program.stages)
        if self.num_stages % self.ranks:
            raise ValueError(f"{self.num_stages} stages do not loop evenly over {self.ranks} pipeline ranks.")
        self.mesh = mesh
        modules = [StageModule(program, s, root, boundaries) for s in range(self.num_stages)]
        self.failure = StageFailure()  # this rank's stages' training step ran out of memory
        for module in modules:
            module.failure = self.failure
        self.shapes = {id(t): (shapes or {}).get(id(t), t.shape) for t in _unique(root)}
        self.placement = placement(schedule, self.ranks, self.num_stages // self.ranks)  # each stage's rank
        by_rank = process_stages(schedule, self.ranks, self.num_stages // self.ranks)
        self.stages = by_rank[self.position]
        self.modules = [modules[s] for s in self.stages]
        self.names = dict(root.state_dict(keep_vars=True))  # name -> tensor, tied ones under each name
        self.owner = {id(t): stage.index for stage in reversed(program.stages) for t in stage.owned}
        by_stage = [{id(t) for t in m.tensors()} | {k for k, s in self.owner.items() if s == m.stage.index}
                    for m in modules]
        held = [set().union(*(by_stage[s] for s in stages)) for stages in by_rank]
        self.held = [t for t in _unique(root) if id(t) in held[self.position]]
        self.held_by_rank = held
        meta_built = has_meta(root)
        self.released = release or meta_built
        sharding = fsdp is not None and not fake
        managed = None  # what each pipeline rank's FSDP shards, travelling as shards (a meta-built model's)
        if sharding:
            for module in modules:
                module.hold_attributes()
            if meta_built:
                managed = [set().union(*(managed_parameters(modules[s]) for s in stages)) for stages in by_rank]
        shards: dict[int, Tensor] = {}
        if fake:  # a meta copy on a silent mesh: nothing to send; tied copies reduce over the pipeline's group
            tied = [p for p in self._shared(root, held) if id(p) in held[self.position]]
            self._tied = [(mesh.get_group("pp"), tied)] if tied else []
        else:
            shards = self._distribute(root, held, previous, init, device, meta_built, managed)
            self._tied = self._tied_groups(root, held, timeout)
        self.swapped: dict[int, nn.Parameter] = {}
        self.sharded = sharding
        if fsdp is not None and sharding:
            self._shard(root, fsdp, shards, planned)
        self.rank = PipelineRank(
            self.modules, self.stages, self.num_stages, mesh.get_group("pp"), device, schedule, chunks, loss_fn, fake
        )

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage (it reads the batch)."""
        return self.rank.is_first

    def set_arguments(self, arguments: dict[str, Any]) -> None:
        """The next training step's non-tensor forward arguments, by graph input: cuts carry
        only tensors, so the stages read these in place of the values they were built with."""
        for module in self.modules:
            module.arguments = arguments

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it computes the losses)."""
        return self.rank.is_last

    def stage_of(self) -> dict[int, int]:
        """``id`` of each tensor to the stage owning it, for another graph's balance."""
        return dict(self.owner)

    def runners(self, program: Program, root: nn.Module) -> list[StageRunner]:
        """This rank's stages of another program of the model (its evaluation graph's).

        Raises:
            RuntimeError: such a stage reads a tensor this rank released.
        """
        runners = [StageRunner(program, s, root) for s in self.stages]
        for runner, module in zip(runners, self.modules):  # parameters read by attribute, where FSDP holds them
            runner.attribute_source = list(module.attribute_source)
        if self.released:
            held = {id(t) for t in self.held}
            reads = {id(t) for runner in runners for t in runner.tensors()}
            missing = [name for name, t in self.names.items() if id(t) in reads - held]
            if missing:
                raise RuntimeError(
                    f"Stages {self.stages} of the graph captured for the modules' current modes (evaluation) read "
                    f"{missing}, which another rank holds: that graph uses parameters in another order than the "
                    f"training graph. Give forward the same parameter order in both modes, or use runtime='local'."
                )
        return runners

    def _shard(
        self, root: nn.Module, policy: MixedPrecisionPolicy, shards: dict[int, Tensor],
        planned: Sequence[PlannedSharding] | None,
    ) -> None:
        """FSDP over this stage's replicas; every record of a parameter follows it to its sharded one.
        A stage reads a tied parameter it does not own as its own (not lent: a copy of the
        unsharded parameter would take its gradient away from FSDP). ``shards``: this replica's
        rows of each parameter still on the meta device, by the parameter's ``id``."""
        for module in self.modules:
            for segment in module.stage.segments:
                segment.borrowed.clear()
        chosen = None if planned is None else [planned[s] for s in self.stages]
        swapped = self.swapped = shard_stages(self.modules, root, self.mesh["dp"], policy, chosen)
        for old, new in swapped.items():
            if old in shards:
                fill_shard(new, shards.pop(old))
        self.held = [swapped.get(id(t), t) for t in self.held]
        self.names = {name: swapped.get(id(t), t) for name, t in self.names.items()}
        self.owner.update({id(p): self.owner[old] for old, p in swapped.items() if old in self.owner})
        self.shapes.update({id(p): p.shape for p in swapped.values()})
        self._tied = [(group, [swapped.get(id(p), p) for p in params]) for group, params in self._tied]

    def _global_rank(self, position: int, replica: int) -> int:
        return position * self.replicas + replica

    def _distribute(
        self,
        root: nn.Module,
        held: list[set[int]],
        previous: Sequence[set[int]] | None,
        init: Callable[[nn.Module], None] | None,
        device: torch.device,
        meta_built: bool,
        managed: Sequence[set[int]] | None = None,
    ) -> dict[int, Tensor]:
        """Send every rank the values of its stages' tensors it lacks, module by module in
        ``modules()`` order (every rank walks the same order, so the blocking sends and
        receives meet), then release what this rank does not hold: back to the meta device
        for a model built there, else to an empty tensor. A tensor several modules register (a
        tied weight) travels after the last of them, whose ``reset_parameters()`` may set it
        again, as :func:`~lightning_pipe.runtime.materialize.materialize` lets it.
        ``managed``: the parameters each pipeline rank's FSDP shards; of those, each replica
        receives or keeps only its shard (returned by ``id``), the tensor itself going back to
        the meta device."""
        me, shards = dist.get_rank(), dict[int, Tensor]()
        modules = list(root.modules())
        last = {id(t): k for k, module in enumerate(modules) for t in own_tensors(module)}
        for k, module in enumerate(modules):
            tensors = own_tensors(module)
            if me == 0 and previous is None and init is not None and any(t.is_meta for t in tensors):
                init(module)
            for tensor in [t for t in tensors if last[id(t)] == k]:  # (a later module may initialise it again)
                for src, dst in self._transfers(id(tensor), held, previous):
                    if managed is not None and id(tensor) in managed[dst // self.replicas]:
                        self._send_shard(tensor, src, dst, device, shards)
                    elif me == dst:
                        if tensor.is_meta:
                            allocate(tensor, device)
                        elif tensor.shape != self.shapes[id(tensor)]:  # released by this rank before
                            tensor.data = torch.empty(self.shapes[id(tensor)], dtype=tensor.dtype, device=device)
                        with torch.no_grad():
                            buffer = torch.empty_like(tensor)
                            dist.recv(buffer, src)
                            tensor.copy_(buffer)
                    elif me == src:
                        dist.send(tensor.detach().contiguous(), dst)
                if managed is not None and id(tensor) in managed[self.position] and not tensor.is_meta:
                    shards[id(tensor)] = shard_of(tensor.detach(), self.replicas, self.replica).clone()
                    to_meta(tensor)
                if not self.released or id(tensor) in held[self.position] or tensor.is_meta:
                    continue
                if meta_built:
                    to_meta(tensor)
                else:
                    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return shards

    def _send_shard(self, tensor: Tensor, src: int, dst: int, device: torch.device, shards: dict[int, Tensor]) -> None:
        """Global rank ``src``'s value of ``tensor``, of it the shard of ``dst``'s replica alone,
        to ``dst`` (into ``shards``); an empty shard does not travel."""
        me, replica = dist.get_rank(), dst % self.replicas
        shard = shard_of(tensor.detach(), self.replicas, replica)
        if me == dst:
            shards[id(tensor)] = torch.empty(shard.shape, dtype=tensor.dtype, device=device)
            if shard.numel():
                dist.recv(shards[id(tensor)], src)
        elif me == src and shard.numel():
            dist.send(shard.contiguous(), dst)

    def _transfers(
        self, tensor: int, held: list[set[int]], previous: Sequence[set[int]] | None
    ) -> list[tuple[int, int]]:
        """(source, destination) global ranks for one tensor: from rank 0, or from the rank of
        the same replica that held it in the ``previous`` pipeline. ``held``, ``previous``: the
        tensors each pipeline rank holds."""
        pairs = []
        source = None if previous is None else next((p for p, ids in enumerate(previous) if tensor in ids), None)
        for position in range(self.ranks):
            if tensor not in held[position] or (previous is not None and tensor in previous[position]):
                continue
            for replica in range(self.replicas):
                dst = self._global_rank(position, replica)
                src = 0 if source is None else self._global_rank(source, replica)
                if src != dst:
                    pairs.append((src, dst))
        return pairs

    def _tied_groups(
        self, root: nn.Module, held: list[set[int]], timeout: timedelta | None
    ) -> list[tuple[dist.ProcessGroup, list[nn.Parameter]]]:
        """A process group per replica and set of pipeline ranks sharing parameters; every rank
        creates every group, in the same order, as ``new_group`` requires."""
        shared: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for param in self._shared(root, held):
            positions = tuple(p for p in range(self.ranks) if id(param) in held[p])
            shared.setdefault(positions, []).append(param)
        groups = []
        for positions, params in sorted(shared.items(), key=lambda item: item[0]):
            for replica in range(self.replicas):
                group = dist.new_group([self._global_rank(p, replica) for p in positions], timeout=timeout)
                if replica == self.replica and self.position in positions:
                    groups.append((group, params))
        return groups

    def _shared(self, root: nn.Module, held: list[set[int]]) -> list[nn.Parameter]:
        """Trainable parameters several pipeline ranks hold (a tied embedding)."""
        return [
            p for p in _unique(root)
            if isinstance(p, nn.Parameter) and p.requires_grad and sum(id(p) in ids for ids in held) > 1
        ]

    def sync_gradients(self) -> None:
        """Sum tied parameters' gradients over the stages holding them, then average every
        gradient over the data-parallel replicas of this stage (FSDP averaged its own already,
        each replica's shard: the tied sum is of shards alike on every stage)."""
        for group, params in self._tied:
            all_reduce_grads(params, group, average=False)
        if self.replicas > 1:
            params = [p for p in self.held if isinstance(p, nn.Parameter) and p.requires_grad and not is_shard(p)]
            all_reduce_grads(params, self.mesh.get_group("dp"), average=True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole pipeline: each parameter counted
        once (at the stage owning it), the norm reduced over the pipeline's ranks."""
        owned = [p for p in self.held if isinstance(p, nn.Parameter) and p.grad is not None and self._owns(p)]
        grads = [cast(Tensor, p.grad) for p in owned]
        parts = [[_local(g) for g in grads if is_shard(g) == shards] for shards in (False, True)]
        inf = norm_type == float("inf")
        whole, shards = (
            max((g.abs().max().float() for g in part), default=torch.zeros(())) if inf
            else sum((g.float().norm(norm_type) ** norm_type for g in part), torch.zeros(()))
            for part in parts
        )
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        if self.sharded:  # each replica holds a shard of a sharded gradient
            shards = shards.detach().clone()
            dist.all_reduce(shards, op=op, group=self.mesh.get_group("dp"))
        total = (torch.maximum(whole, shards) if inf else whole + shards).detach().clone()
        dist.all_reduce(total, op=op, group=self.mesh.get_group("pp"))
        if not inf:
            total = total ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.held:
            if isinstance(p, nn.Parameter) and p.grad is not None:
                _local(p.grad).mul_(coefficient.to(p.grad.dtype))
        return total

    def state_dict(self) -> dict[str, Tensor] | None:
        """The plain module's ``state_dict``, gathered on global rank 0 (``None`` elsewhere)
        from replica 0's ranks, each sending what its stages own."""
        mine = to_host(self.owned_state(gather=True))
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return None
        merged: dict[str, Tensor] = {}
        for part in gathered:
            merged.update(part)
        return {name: merged[name] for name in self.names}

    def owned_state(self, gather: bool = False) -> dict[str, Tensor]:
        """This rank's part of the plain module's ``state_dict``: what its stages own, on
        replica 0 (the other replicas hold copies). Sharded by FSDP, each replica's shards;
        ``gather``: whole, on replica 0 (every replica gathers)."""
        owned = {name: t.detach() for name, t in self.names.items() if self._owns(t)}
        if gather:
            owned = {name: full_value(t) for name, t in owned.items()}
        return {name: t for name, t in owned.items() if not self.replica or is_shard(t)}

    def _owns(self, tensor: Tensor) -> bool:
        """Whether one of this rank's stages owns ``tensor`` (the first stage reading it; a
        tensor no stage reads belongs to the first)."""
        return self.placement[self.owner.get(id(tensor), 0)] == self.position

    def held_state(self) -> dict[str, Tensor]:
        """The tensors this rank holds, by every name of the plain module's ``state_dict``."""
        held = {id(t) for t in self.held}
        return {name: t for name, t in self.names.items() if id(t) in held}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Copy the values of the tensors this rank holds from a full ``state_dict``."""
        with torch.no_grad():
            for name, tensor in self.held_state().items():
                if name in state:
                    tensor.copy_(reshard_value(tensor, state[name]))


def pipeline_mesh(
    stages: int, replicas: int, device_type: str, timeout: timedelta | None = None, backend: str | None = None
) -> DeviceMesh:
    """The ``("pp", "dp")`` device mesh of ``stages`` pipeline ranks times ``replicas``
    data-parallel copies (global rank = ``stage * replicas + replica``) over every rank of the
    default process group, its groups new ones that wait ``timeout`` for a peer
    (``init_device_mesh`` would reuse the default group, or give ``torch.distributed``'s default
    of 30 minutes), of ``backend`` (default: the default group's)."""
    grid = torch.arange(stages * replicas).view(stages, replicas)
    world, me = dist.get_world_size(), dist.get_rank()
    if grid.numel() != world:
        raise ValueError(f"{stages} stages x {replicas} replicas need {grid.numel()} processes, not {world}.")
    mine: list[dist.ProcessGroup] = []
    for lines in (grid.t(), grid):  # a pipeline's ranks are a column, a stage's replicas a row
        for ranks in lines.tolist():  # every rank creates every group, in the same order
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if me in ranks:
                mine.append(group)
    return DeviceMesh.from_group(mine, device_type, mesh=grid, mesh_dim_names=("pp", "dp"))


def silent_mesh(stages: int, replicas: int) -> DeviceMesh:
    """:func:`pipeline_mesh` whose groups send nothing and wait for no one: each rank runs its
    stages' training step alone, on tensors without data, with every message the real one
    sends (:func:`~lightning_pipe.runtime.fake.fake_rank_training`)."""
    if not hasattr(dist.Backend, _SILENT.upper()):
        dist.Backend.register_backend(_SILENT, _silent_group, extended_api=True, devices=["cpu", "cuda", "meta"])
    return pipeline_mesh(stages, replicas, "cpu", backend=_SILENT)


_SILENT = "lightning_pipe_silent"


def _silent_group(common: Any, options: Any) -> Any:
    return fake_process_group(common.group_rank, common.group_size)


def _unique(root: nn.Module) -> list[Tensor]:
    return list({id(t): t for t in [*root.parameters(), *root.buffers()]}.values())


def all_reduce_grads(params: Sequence[nn.Parameter], group: dist.ProcessGroup, average: bool) -> None:
    """Sum (or average) the gradients of ``params`` over ``group``, in flat buckets of at most
    :data:`~lightning_pipe.plan.schedule.GRADIENT_BUCKET_BYTES` per dtype (a larger gradient
    is a bucket of its own); a missing gradient counts as zeros."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.dtype, []).append(p)
    size = dist.get_world_size(group)
    for ps in by_dtype.values():
        for bucket in _buckets([_local(cast(Tensor, p.grad)) for p in ps]):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            if average:
                flat /= size
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()


def _local(t: Tensor) -> Tensor:
    """This rank's part of a sharded tensor (written through), or ``t``."""
    return t.to_local() if is_shard(t) else t  # type: ignore[attr-defined]


def _buckets(grads: Sequence[Tensor]) -> list[list[Tensor]]:
    buckets: list[list[Tensor]] = [[]]
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if buckets[-1] and size + nbytes > GRADIENT_BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return [b for b in buckets if b]
