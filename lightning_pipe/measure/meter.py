"""Measure: per-stage memory, observed from the tensors themselves.

Several stages may share one device (all on ``cpu`` in tests), so device statistics cannot
tell stages apart. The :class:`MemoryMeter` is a dispatch mode that sees every operator's
outputs: each new storage is charged to the stage running at that moment and released when
the storage dies (a weakref finalizer). In forward the pipeline says which stage runs; in
backward the running autograd node says it (nodes are tagged with their stage after the
stage's forward). Parameters, gradients and optimizer state are charged to the stage that
owns the parameter. An operator may also allocate and free memory inside itself (a
convolution's scratch), which no dispatch mode sees: the allocator reports it to a profiler
session the meter runs around the first call of each operator signature, and every call
charges those bytes to its stage for the instant it runs. Asked to, the meter also records
the order in which storages were charged and released, which
:mod:`~lightning_pipe.measure.allocator` replays through the CUDA caching allocator's rules.
Nothing here reads the planner's formulas.
"""

import itertools
import threading
import weakref
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, MutableMapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from lightning_pipe.internals import (
    FakeTensor,
    TorchDispatchMode,
    current_autograd_node,
    op_schema,
    profiler_enabled,
    start_memory_events,
    stop_memory_events,
    tree_flatten,
)
from lightning_pipe.measure.allocator import AllocatorPeaks, replay
from lightning_pipe.measure.meta import meta_call, on_meta

__all__ = [
    "KINDS", "MemoryMeter", "StageMemory", "StageOutOfMemoryError", "Unrefused", "learn_workspaces", "not_charged",
    "observed_workspaces",
]

#: What a stage's bytes are: parameters and buffers, their gradients, optimizer state,
#: activations kept for backward, values on their way to another stage, and the rest
#: (workspace, gradients in flight) which lives only while an op or node runs.
KINDS = ("parameters", "gradients", "optimizer", "activations", "boundary", "transient")
_RELABEL = ("transient", "boundary", "activations")


_flags = threading.local()
_T = TypeVar("_T")

# Bytes an operator allocates and frees inside itself, by signature (see _workspace): a pure
# function of the operator and its inputs' layout, so observed once per process.
_WORKSPACE: dict[Hashable, int] = {}


@contextmanager
def not_charged() -> Iterator[None]:
    """Allocations inside are not any stage's device memory (e.g. host swap buffers)."""
    previous = getattr(_flags, "off", False)
    _flags.off = True
    try:
        yield
    finally:
        _flags.off = previous


class StageOutOfMemoryError(RuntimeError):
    """A stage went over its memory capacity."""

    def __init__(self, stage: int, capacity: int, request: int, in_use: int, name: str | None = None) -> None:
        """``name``: what ran out, where that is more than stage ``stage`` (a process's stages)."""
        super().__init__(
            f"{name or f'Stage {stage}'} is out of memory: it holds {in_use:,} bytes and asked for "
            f"{request:,} more, over its capacity of {capacity:,} bytes. Lower the batch or "
            f"micro-batch size, raise the stage's memory limit, or move its cut."
        )
        self.stage, self.capacity, self.request, self.in_use = stage, capacity, request, in_use


@dataclass
class StageMemory:
    """A stage's bytes now and at its peak, by kind."""

    current: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak: int = 0
    peak_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))  # at the peak
    kind_peaks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))  # each its own max

    @property
    def total(self) -> int:
        return sum(self.current.values())


@dataclass
class Unrefused:
    """What ran inside :meth:`MemoryMeter.unrefused`, read after it: the stage's ``capacity``
    (``None``: none), the bytes it ``held`` before, and its peak ``during`` the block."""

    capacity: int | None
    held: int
    during: int


@dataclass
class _Entry:
    stage: int
    kind: str
    nbytes: int
    movable: bool = True  # made by an operator, not owned (parameters, the batch)


class MemoryMeter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Charge every live storage to a stage; optionally enforce per-stage capacities.

    Args:
        num_stages: number of pipeline stages.
        capacities: per-stage byte limits (``None`` entries or list: unlimited).
        trace: record every charge and release in order (:attr:`trace`), for
            :meth:`allocator_peaks`; it grows with every storage, so only for a bounded run.
    """

    def __init__(
        self, num_stages: int, capacities: Sequence[int | None] | None = None, *, trace: bool = False
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if capacities is not None and len(capacities) != num_stages:
            raise ValueError(f"{len(capacities)} capacities given for {num_stages} stages.")
        self.capacities: list[int | None] = list(capacities) if capacities is not None else [None] * num_stages
        self.stages = [StageMemory() for _ in range(num_stages)]
        self._entries: MutableMapping[torch.UntypedStorage, _Entry] = WeakIdKeyDictionary()
        self._owner: MutableMapping[Tensor, int] = WeakIdKeyDictionary()  # parameter -> stage
        self._hooks: list[RemovableHandle] = []
        self.last_saver: dict[int, int] = {}  # first stage keeping a storage -> last stage saving it
        self._tag = f"lightning_pipe.stage.{id(self)}"  # meters may nest (profiling while metering)
        self._local = threading.local()
        self._lock = threading.RLock()  # finalizers may fire inside a locked update
        self._total = 0  # bytes charged to any stage now
        self.process_peak = 0  # the most bytes charged to all stages together at one moment
        self._batch: list[_Entry] = []  # the training batch's storages (charge_batch)
        #: ``(stage, key, nbytes)`` in order: a storage (or an operator's workspace) of ``nbytes``
        #: charged to ``stage`` as ``key``, or released where ``nbytes`` is negative; a storage
        #: moving to another stage is released there and charged here, one event after the other
        self.trace: list[tuple[int, int, int]] | None = [] if trace else None
        self._workspaces = itertools.count(-1, -1)  # keys of workspaces: no entry's id

    # -- what runs now ---------------------------------------------------------------------

    def running(self, stage: int | None) -> AbstractContextManager[None]:
        """Charge what is allocated inside to ``stage`` (a stage's forward); ``None``: to no
        stage (planning inside a step)."""
        return self._setting("stage", stage)

    def stepping(self) -> AbstractContextManager[None]:
        """An optimizer step: what it allocates outside any stage (its temporaries, new
        state) is charged to the stage owning what the operator reads, for as long as it
        lives. A closure the step calls runs the pipeline as usual (:meth:`step`)."""
        return self._setting("stepping", True)

    def step(self, step: Callable[[Any], _T], closure: Callable[[], Any] | None) -> _T:
        """``step(closure)``, an optimizer step (``Strategy.optimizer_step``) run
        :meth:`stepping`; the closure inside, the training step it calls, runs as usual."""

        def training(closure: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                with self._setting("stepping", False):
                    return closure()

            return run

        with self.stepping():
            return step(None if closure is None else training(closure))

    @contextmanager
    def unrefused(self, stage: int) -> Iterator[Unrefused]:
        """Refuse nothing inside (code that must run to its end, such as a collective its peers
        wait in); after, ``stage``'s capacity is back and the :class:`Unrefused` yielded tells
        how far the block went, for the caller to decide what passing the capacity means. The
        stage's own peak stands where the block did not exceed it, else the block's is its peak."""
        memory, capacity = self.stages[stage], self.capacities[stage]
        inside = Unrefused(capacity, memory.total, memory.total)
        peak, kinds = memory.peak, memory.peak_by_kind
        memory.peak, self.capacities[stage] = inside.held, None
        try:
            yield inside
        finally:
            inside.during, self.capacities[stage] = memory.peak, capacity
            if inside.during <= peak:
                memory.peak, memory.peak_by_kind = peak, kinds

    @contextmanager
    def _setting(self, name: str, value: Any) -> Iterator[None]:
        """This thread's ``name`` set to ``value`` inside."""
        previous = getattr(self._local, name, None)
        setattr(self._local, name, value)
        try:
            yield
        finally:
            setattr(self._local, name, previous)

    def run_as(self, stage: int, run: Callable[[], _T]) -> _T:
        """Run code outside the pipeline's stages as part of ``stage``, its backward included:
        the loss ``training_step`` computes lives on the last stage's device."""
        with self.running(stage):
            result = run()
        self.tag_backward([result], stage)
        return result

    def tag_backward(self, outputs: Iterable[Any], stage: int) -> None:
        """Mark the autograd nodes a stage's forward created, so its backward is charged to it."""
        flat = tree_flatten(list(outputs))[0]
        stack: list[Node | None] = [t.grad_fn for t in flat if isinstance(t, Tensor) and t.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or type(node).__name__ == "AccumulateGrad":
                continue
            if self._tag in node.metadata:  # type: ignore[operator]  # torch types the property as a method
                continue
            node.metadata[self._tag] = stage  # type: ignore[index]
            stack.extend(f for f, _ in node.next_functions)

    def _stage_now(self) -> tuple[int, str] | None:
        node: Node | None = current_autograd_node()
        if node is None:
            stage = getattr(self._local, "stage", None)
            return None if stage is None else (stage, "transient")
        if type(node).__name__ == "AccumulateGrad":
            owner = self._owner.get(node.variable)  # type: ignore[attr-defined]
            return None if owner is None else (owner, "gradients")
        stage = node.metadata.get(self._tag)  # type: ignore[attr-defined]
        return None if stage is None else (stage, "transient")

    # -- charging --------------------------------------------------------------------------

    def own(self, stage: int, tensors: Iterable[Tensor], kind: str = "parameters") -> None:
        """Charge existing tensors (parameters, buffers) to ``stage``; a parameter's gradient
        is charged to the same stage once autograd has accumulated it."""
        for t in tensors:
            if isinstance(t, torch.nn.Parameter):
                if t not in self._owner and t.requires_grad:
                    self._hooks.append(t.register_post_accumulate_grad_hook(self._own_grad))  # type: ignore[no-untyped-call]
                self._owner[t] = stage
            self._charge(t, stage, kind, movable=False)

    def charge_batch(self, stage: int, tensors: Iterable[Tensor]) -> None:
        """Charge this step's training batch to ``stage`` and stop charging the last step's:
        a batch the data loader keeps alive is the loader's, once its step is done. One
        seen again (a loader cycling over held batches) is charged again."""
        for entry in self._batch:  # (its storage may have died already: released then)
            self._release(entry)
        self._batch = []
        for t in tensors:
            storage = t.untyped_storage()
            released = self._entries.get(storage)
            if released is not None and released.nbytes == 0:
                released.nbytes, released.stage, released.kind = storage.nbytes(), stage, "boundary"
                self._add(stage, "boundary", released.nbytes)
                self._record((stage, id(released), released.nbytes))
            else:
                self._charge(t, stage, "boundary", movable=False)
            self._batch.append(self._entries[storage])

    def _own_grad(self, param: Tensor) -> None:
        if param.grad is not None:
            self._charge(param.grad, self._owner[param], "gradients")

    def close(self) -> None:
        """Remove the gradient hooks this meter put on parameters."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def own_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Charge optimizer state to the stage owning each parameter (call after a step)."""
        for param, state in optimizer.state.items():
            stage = self._owner.get(param)
            if stage is None:
                continue
            for value in state.values():
                if isinstance(value, Tensor):
                    self._charge(value, stage, "optimizer")
            if param.grad is not None:
                self._charge(param.grad, stage, "gradients")

    def mark(self, tensors: Iterable[Any], kind: str) -> None:
        """Re-label charged storages of short-lived kinds: ``"boundary"`` (sent to another
        stage) outranks ``"transient"``, ``"activations"`` (saved for backward) both."""
        rank = _RELABEL.index(kind)
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, Tensor):
                entry = self._entries.get(t.untyped_storage())
                if entry is not None and entry.kind in _RELABEL and _RELABEL.index(entry.kind) < rank:
                    self._move(entry, entry.stage, kind)

    def keep(self, stage: int | None, tensors: Iterable[Any], kind: str = "activations") -> None:
        """Storages ``stage`` keeps for its backward (autograd saves them, or a recomputed
        segment holds its inputs): its activations, whichever stage made them, as on a device
        of its own, where it would keep a copy. The first stage keeping one holds it: its
        backward runs last. Owned storages (parameters, the batch) stay where they are.
        ``kind="boundary"``: values that arrived at ``stage`` for good (the pipeline's outputs
        the loss holds), which on devices of their own its copy holds and the maker frees."""
        for t in tree_flatten(list(tensors))[0]:
            entry = self._entries.get(t.untyped_storage()) if isinstance(t, Tensor) else None
            if entry is not None and entry.movable and entry.kind in ("transient", "boundary"):
                self._move(entry, entry.stage if stage is None else stage, kind)

    def _charge(self, t: Tensor, stage: int, kind: str, movable: bool = True) -> None:
        storage = t.untyped_storage()
        entry = self._entries.get(storage)
        if entry is None:
            entry = _Entry(stage, kind, storage.nbytes(), movable)
            self._entries[storage] = entry
            weakref.finalize(storage, self._release, entry)
            self._add(stage, kind, entry.nbytes)
            self._record((stage, id(entry), entry.nbytes))
        elif (entry.stage, entry.kind) != (stage, kind):
            self._move(entry, stage, kind)

    def _move(self, entry: _Entry, stage: int, kind: str) -> None:
        with self._lock:
            self.stages[entry.stage].current[entry.kind] -= entry.nbytes
            self._total -= entry.nbytes
            if stage != entry.stage:
                self._record((entry.stage, id(entry), -entry.nbytes), (stage, id(entry), entry.nbytes))
        entry.stage, entry.kind = stage, kind
        self._add(stage, kind, entry.nbytes)

    def _add(self, stage: int, kind: str, nbytes: int) -> None:
        with self._lock:
            self._check(stage, nbytes)
            self.stages[stage].current[kind] += nbytes
            self._total += nbytes
            self._note_peak(stage, kind)

    def _spike(self, stage: int, nbytes: int) -> None:
        """``nbytes`` of transient memory held for an instant (an operator's workspace)."""
        with self._lock:
            self._check(stage, nbytes)
            self._note_peak(stage, "transient", nbytes)
            key = next(self._workspaces)
            self._record((stage, key, nbytes), (stage, key, -nbytes))

    def _check(self, stage: int, nbytes: int) -> None:
        capacity, in_use = self.capacities[stage], self.stages[stage].total
        if capacity is not None and in_use + nbytes > capacity:
            raise StageOutOfMemoryError(stage, capacity, nbytes, in_use)

    def _note_peak(self, stage: int, kind: str, extra: int = 0) -> None:
        memory = self.stages[stage]
        level = memory.current[kind] + extra
        memory.kind_peaks[kind] = max(memory.kind_peaks[kind], level)
        if memory.total + extra > memory.peak:
            memory.peak = memory.total + extra
            memory.peak_by_kind = {**memory.current, kind: level}
        self.process_peak = max(self.process_peak, self._total + extra)

    def _record(self, *events: tuple[int, int, int]) -> None:
        """Append charges and releases to the trace, where one is kept; none of zero bytes
        (no allocator hands out a block for them, nor takes one back)."""
        if self.trace is not None and events[0][2]:
            self.trace.extend(events)

    def _release(self, entry: _Entry) -> None:
        """Stop charging ``entry`` (its storage died, or :meth:`charge_batch`); once only."""
        with self._lock:
            self.stages[entry.stage].current[entry.kind] -= entry.nbytes
            self._total -= entry.nbytes
            self._record((entry.stage, id(entry), -entry.nbytes))
            entry.nbytes = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _DEVICE or getattr(_flags, "off", False):
            return func(*args, **kwargs)
        where = self._stage_now()
        if where is None:
            stepping = getattr(self._local, "stepping", False)
            return self._step_op(func, args, kwargs) if stepping else func(*args, **kwargs)
        flat = _leaves((*args, *kwargs.values()))
        out, workspace = _workspace(func, args, kwargs, flat)
        # Views and in-place results share an input's storage: not an allocation.
        inputs = {id(t.untyped_storage()) for t in flat if isinstance(t, Tensor)}
        aliases = [r.alias_info is not None for r in op_schema(func).returns]
        for k, t in enumerate(_leaves((out,))):
            if not isinstance(t, Tensor):
                continue
            if where[1] == "gradients" or not (id(t.untyped_storage()) in inputs or aliases[min(k, len(aliases) - 1)]):
                self._charge(t, *where)  # (under AccumulateGrad: a buffer adopted as .grad)
        if workspace:
            self._spike(where[0], workspace)
        return out

    def _step_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An operator of an optimizer step: each new storage goes to the stage owning what it
        is made from (for an operator over lists of tensors, the tensor at the same place in
        its first list; else the first input charged to a stage)."""
        out = func(*args, **kwargs)
        inputs = [t for t in _leaves((*args, *kwargs.values())) if isinstance(t, Tensor)]
        owner = next((e.stage for t in inputs if (e := self._entries.get(t.untyped_storage())) is not None), None)
        if owner is None:
            return out
        storages = {id(t.untyped_storage()) for t in inputs}
        listed = next((a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], Tensor)), None)
        results = out if isinstance(out, (list, tuple)) else [out]
        for k, t in enumerate(results):
            if not isinstance(t, Tensor) or id(t.untyped_storage()) in storages:
                continue
            source = listed[k] if listed is not None and len(listed) == len(results) else None
            entry = self._entries.get(source.untyped_storage()) if source is not None else None
            self._charge(t, entry.stage if entry is not None else owner, "transient")
        return out

    # -- reading ---------------------------------------------------------------------------

    def charged(self, t: Tensor) -> tuple[int, str] | None:
        """The stage and kind ``t``'s storage is charged to, if any."""
        entry = self._entries.get(t.untyped_storage())
        return None if entry is None else (entry.stage, entry.kind)

    def peaks(self) -> list[int]:
        return [m.peak for m in self.stages]

    def reset_peaks(self) -> None:
        for m in self.stages:
            m.peak = m.total
            m.peak_by_kind = dict(m.current)
            m.kind_peaks = dict(m.current)
        self.process_peak = self._total

    def allocator_peaks(self, stages: Collection[int]) -> AllocatorPeaks:
        """What one CUDA caching allocator serving ``stages`` together would show as its
        ``max_memory_allocated`` and ``max_memory_reserved``, from the :attr:`trace`
        (:func:`~lightning_pipe.measure.allocator.replay`): one stage, as on a device of its
        own, or the stages sharing a device (where a storage moving between two of them is
        freed and at once allocated again: the block just freed fits it, no segment is added).

        Raises:
            ValueError: the meter keeps no trace.
        """
        if self.trace is None:
            raise ValueError("The meter keeps no trace: make it with MemoryMeter(..., trace=True).")
        return replay((key, nbytes) for stage, key, nbytes in self.trace if stage in stages)

    @staticmethod
    def cuda_peaks(devices: Sequence[torch.device]) -> list[int] | None:
        """``torch.cuda.max_memory_allocated`` per stage, when every stage has its own GPU."""
        if not all(d.type == "cuda" for d in devices) or len(set(devices)) != len(devices):
            return None
        return [torch.cuda.max_memory_allocated(d) for d in devices]

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks that charge tensors autograd saves to the saving stage as stashed activations
        (:meth:`keep`). What they keep is a detached alias (same storage): a tensor saved as
        its own operator's output, kept itself, would keep its ``grad_fn`` and so itself alive
        (a reference cycle only a backward breaks, which a forward never backwarded, as a
        profiler's timing runs, never gets)."""

        def pack(t: Tensor) -> Tensor:
            saver = getattr(self._local, "stage", None)
            self.keep(saver, [t])
            entry = self._entries.get(t.untyped_storage())
            if entry is not None and saver is not None:
                self.last_saver[entry.stage] = max(self.last_saver.get(entry.stage, -1), saver)
            return t.detach()

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


_CPU = torch.device("cpu")
_DEVICE = torch.ops.prim.device.default  # a fake tensor's ``.device``, asked often; allocates nothing


def _workspace(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any]) -> tuple[Any, int]:
    """Run an operator; return its result and the most bytes it held inside itself beyond
    what it returns. Observed from the allocator's reports to a profiler session at the first
    call of each signature (operator, input layouts, other arguments), which is all they depend
    on; while another profiler runs, an unseen signature counts none, and so does one on fake
    or meta tensors, which allocate nothing to observe (they get what a real call showed)."""
    key = _signature(func, kwargs, flat)
    known = _WORKSPACE.get(key) if key is not None else None
    if on_meta(flat):
        return meta_call(func, args, kwargs, flat), known or 0
    if known is not None or profiler_enabled() or any(map(_without_data, flat)):
        return func(*args, **kwargs), known or 0
    out, workspace = _observed(lambda: func(*args, **kwargs), _on_cuda(flat))
    if key is not None:
        _WORKSPACE[key] = workspace
    return out, workspace


def observed_workspaces() -> dict[Hashable, int]:
    """The workspaces this process has observed, by signature, to send to another process
    (an operator by its name): a fake run there charges what real calls here showed. Only
    those of some bytes (a fake run counts none for an unknown signature), and none of an
    operator on a process group (a collective's, which no fake run makes)."""
    return {
        (str(key[0]), *key[1:]): nbytes  # type: ignore[index]
        for key, nbytes in _WORKSPACE.items()
        if nbytes and not any(isinstance(x, torch.ScriptObject) for x in key)  # type: ignore[attr-defined]
    }


def learn_workspaces(observed: dict[Hashable, int]) -> None:
    """Take the workspaces another process observed (:func:`observed_workspaces`)."""
    for key, nbytes in observed.items():
        name, *rest = cast(tuple[Any, ...], key)
        namespace, op, overload = str(name).split(".")
        func = getattr(getattr(getattr(torch.ops, namespace), op), overload)
        _WORKSPACE.setdefault((func, *rest), nbytes)


def _observed(run: Callable[[], Any], cuda: bool) -> tuple[Any, int]:
    """``run()`` in a profiler session that records allocations: its result and the peak of
    the bytes it allocated, less those still allocated when it returns (its outputs)."""
    start_memory_events()
    try:
        out = run()
    finally:
        threads = stop_memory_events()
    start = next(e for thread in threads for e in thread)
    sizes = [(start.cpu_elapsed_us(e), e.cuda_memory_usage() if cuda else e.cpu_memory_usage())
             for thread in threads for e in thread]  # only allocations and frees have a size
    now = peak = 0
    for _, size in sorted(sizes, key=lambda s: s[0]):
        now += size
        peak = max(peak, now)
    return out, peak - max(now, 0)


def _signature(func: Any, kwargs: dict[str, Any], flat: list[Any]) -> Hashable | None:
    """What an operator's workspace depends on; ``None`` where an argument is not hashable."""
    key = (func, tuple(kwargs), *(_layout(x) if isinstance(x, Tensor) else x for x in flat))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _layout(t: Tensor) -> tuple[Any, ...]:
    """What of ``t`` a workspace depends on; a meta tensor stands for a CPU one (a fake run's
    stages run on the CPU)."""
    strides = t.stride() if t.layout == torch.strided else None
    return t.shape, strides, t.dtype, _CPU if t.is_meta else t.device, t.layout


def _leaves(values: Iterable[Any]) -> list[Any]:
    """An operator's arguments or results with their lists and tuples flattened: what
    ``tree_flatten`` gives for an ``aten`` schema, which holds nothing else that nests, at a
    fraction of its cost (it runs for every operator of a fake run)."""
    flat: list[Any] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            flat.extend(_leaves(v))
        else:
            flat.append(v)
    return flat


def _without_data(x: Any) -> bool:
    return isinstance(x, FakeTensor) or (isinstance(x, Tensor) and x.is_meta)


def _on_cuda(flat: list[Any]) -> bool:
    return any(isinstance(t, Tensor) and t.device.type == "cuda" for t in flat)
