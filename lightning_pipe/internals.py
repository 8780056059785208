"""torch's private APIs, in one place: every other module of the package goes through here.

Each name below is something torch does not offer publicly (or not in the supported range,
see ``pyproject.toml``) that the package cannot do without. The comment on each says why it
is needed and what stops working if torch changes it; ``tests/test_internals.py`` fails when
one of them moves, and a test there scans the package for a private torch name used anywhere
else. Lightning's and torchmetrics' private APIs have their own fence,
:mod:`lightning_pipe.lightning.internals`.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

# Fake tensors: a plan is checked, and a model profiled, by a training step on tensors without
# data (torch.export runs on them too, but exposes no public class to make them or test for
# them). The two exceptions are how a fake run says an operator's output depends on data.
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

# BatchNorm's common base, for isinstance over BatchNorm1d/2d/3d, SyncBatchNorm and the lazy
# ones: torch names no public base. A rename makes deferred_batch_norm and the buffer check miss
# every BatchNorm layer.
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

# The dispatch mode: the memory meter and the roofline see every operator through it. It is
# documented (torch's "__torch_dispatch__" notes) but lives in a private module.
from torch.utils._python_dispatch import TorchDispatchMode

# pytree: flattening and rebuilding nested batches (tuples, dicts, dataclasses) is what every
# micro-batch split, transfer and fake run does. torch has no public pytree module (torch.export
# and torch.compile use this one); a rename breaks every import of the package at once.
from torch.utils._pytree import (
    GetAttrKey,
    KeyEntry,
    KeyPath,
    MappingKey,
    SequenceKey,
    TreeSpec,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_structure,
    tree_unflatten,
)

if TYPE_CHECKING:
    # The base of torch.distributed.pipelining's stages, the type its schedules take (lists are
    # invariant: a list[PipelineStage] is not one). Loaded on first use (importing pipelining
    # takes seconds), see __getattr__.
    from torch.distributed.distributed_c10d import Store
    from torch.distributed.pipelining.stage import _PipelineStageBase as PipelineStageBase

__all__ = [
    "ASSERT_TENSOR_METADATA", "CPU_FLASH_ATTENTION", "CPU_FLASH_ATTENTION_BACKWARD", "CUDA_EFFICIENT_ATTENTION",
    "CUDA_FLASH_ATTENTION", "MATH_ATTENTION", "BatchNormBase", "DataDependentOutputException",
    "DynamicOutputShapeException", "FakeTensor", "FakeTensorMode", "GetAttrKey", "KernelScope", "KeyEntry",
    "KeyPath", "MappingKey", "NoWarmupVotes", "PipelineStageBase", "SequenceKey", "TorchDispatchMode", "TreeSpec",
    "buffer_table", "check_input_dim", "current_autograd_node", "current_graph_task_id", "default_store",
    "fake_process_group", "mark_as_parameter", "module_apply", "op_schema", "outer_saved_tensors_hooks",
    "parameter_table", "preserve_version_counter", "profiler_enabled", "registered_operators", "remove_library",
    "skip_backward", "skip_weight_backward", "start_memory_events", "stop_memory_events", "storage_key", "tree_flatten",
    "tree_flatten_with_path", "tree_map", "tree_structure", "tree_unflatten", "view_base",
]


def __getattr__(name: str) -> Any:
    if name == "PipelineStageBase":
        from torch.distributed.pipelining.stage import _PipelineStageBase

        return _PipelineStageBase
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- autograd -----------------------------------------------------------------------------------

def current_autograd_node() -> torch.autograd.graph.Node | None:
    """The autograd node whose backward is running on this thread, ``None`` in forward. The
    meter and the roofline charge a backward operator to the stage or graph node that node
    belongs to; without it every backward byte and second would go unattributed."""
    node: torch.autograd.graph.Node | None = torch._C._current_autograd_node()
    return node


def current_graph_task_id() -> int:
    """The running backward's id, ``-1`` outside backward: deferred BatchNorm records a
    micro-batch's statistics only in forward, not when a backward recomputes it. torch has no
    public "am I inside backward" test."""
    return int(torch._C._current_graph_task_id())


def outer_saved_tensors_hooks() -> tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None:
    """The ``saved_tensors_hooks`` pair in force (the innermost), ``None`` outside any: the swap
    hooks hand what stays on the device to the enclosing hooks (the memory meter's), which torch
    does not chain. If this goes, a swapped stage's kept tensors escape the meter."""
    hooks: tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]] | None = (
        torch._C._autograd._top_saved_tensors_default_hooks(False)
    )
    return hooks


def preserve_version_counter(tensor: Tensor) -> Any:
    """A context manager that leaves ``tensor``'s version counter as it was: a buffer lent to
    another device is written back after backward saved it (BatchNorm saves its running
    statistics), and a public in-place write would fail that backward's version check."""
    from torch.autograd.grad_mode import _unsafe_preserve_version_counter

    return _unsafe_preserve_version_counter(tensor)


def view_base(t: Tensor) -> Tensor | None:
    """The tensor ``t`` is a view of (``Tensor._base``), ``None`` for a non-view: the swap hooks
    keep a parameter's view (``W.t()`` in ``linear``) on the device. No public accessor."""
    base: Tensor | None = t._base
    return base


def mark_as_parameter(t: Tensor) -> None:
    """Make ``isinstance(t, nn.Parameter)`` hold for a plain tensor: the fake run swaps each
    parameter for a fake tensor in place (``torch.utils.swap_tensors``), and optimizers and
    ``nn.Module`` must still see a parameter. ``Parameter``'s metaclass reads this flag."""
    t._is_param = True


# --- modules -------------------------------------------------------------------------------------

def parameter_table(module: nn.Module) -> dict[str, Any]:
    """``module``'s own parameters dict (``Module._parameters``), to write into: ``setattr``
    refuses a stand-in that is not a ``Parameter`` of the same kind, and export swaps every
    parameter for a meta stand-in and back without a registration hook firing."""
    table: dict[str, Any] = module._parameters
    return table


def buffer_table(module: nn.Module) -> dict[str, Any]:
    """``module``'s own buffers dict (``Module._buffers``, with its ``None`` entries), to read
    and write as :func:`parameter_table`: capture puts back a buffer tracing replaced with a
    Proxy, which ``setattr`` would refuse."""
    table: dict[str, Any] = module._buffers
    return table


def module_apply(module: nn.Module, fn: Callable[[Tensor], Tensor]) -> nn.Module:
    """``Module._apply``: ``fn`` on every parameter and buffer, what ``.cpu()`` and ``.to()``
    do but with a function of each tensor (one that leaves a meta tensor on meta); no public
    method takes one."""
    applied: nn.Module = module._apply(fn)  # type: ignore[no-untyped-call]
    return applied


def check_input_dim(bn: BatchNormBase, input: Tensor) -> None:
    """BatchNorm's own check of its input's dimensions (``_check_input_dim``, one per class),
    which deferred BatchNorm's replacement ``forward`` keeps, so that a wrong input fails as
    on one device."""
    bn._check_input_dim(input)  # type: ignore[no-untyped-call]  # (untyped in torch)


# --- operators -----------------------------------------------------------------------------------

def op_schema(func: Any) -> Any:
    """An ATen operator overload's schema (``OpOverload._schema``: its arguments' and results'
    aliasing, whether it is in place or a view); ``None`` for anything else. No public
    accessor; the meter, the roofline, meta results and capture's buffer check read it."""
    return getattr(func, "_schema", None)


def storage_key(t: Tensor) -> int:
    """An id of ``t``'s storage itself (``UntypedStorage._cdata``, the address of its C++
    object), equal for every Python storage object of one storage."""
    return int(t.untyped_storage()._cdata)


def registered_operators(key: str) -> list[str]:
    """The operators (``name.overload``, without ``aten::``) with a kernel of their own for
    dispatch key ``key``: what the CPU's autocast casts, which :mod:`lightning_pipe.autocast`
    lets fall through. The dispatcher's tables have no public reader."""
    return [name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)]


def remove_library(library: torch.library.Library) -> None:
    """Take back every kernel ``library`` registered, now (``Library._destroy``; otherwise only
    once it is garbage, whenever that is): the CUDA autocast stand-in's kernels must not outlive
    their scope."""
    library._destroy()  # type: ignore[no-untyped-call]


class KernelScope:
    """The aten kernels ``register`` adds to the dispatcher, for as long as the outermost
    :meth:`active` lasts, taken back at its end (:func:`remove_library`); scopes within share
    them. A kernel of the dispatcher's, not a Python mode: autograd's threads see it too."""

    def __init__(self, register: Callable[[torch.library.Library], None]) -> None:
        self._register = register
        self._library: torch.library.Library | None = None

    @contextmanager
    def active(self) -> Iterator[None]:
        if self._library is not None:
            yield
            return
        self._library = library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
        try:
            self._register(library)
            yield
        finally:
            self._library = None
            remove_library(library)


# aten's own operators, private by name (a leading underscore) but the graph holds them: export
# adds checks of the meta stand-ins' devices that a stage on another device must drop, and
# attention on the CPU runs as a flash kernel torch's FLOP counter has no formula for; autocast
# casts a parameter with a copy (``_to_copy``), which a matrix product then saves.
TO_COPY = torch.ops.aten._to_copy.default
ASSERT_TENSOR_METADATA = torch.ops.aten._assert_tensor_metadata.default
CPU_FLASH_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_FLASH_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
# The kernels ``scaled_dot_product_attention`` dispatches to on CUDA, called by their positional
# schemas so that a fake run for a CUDA target keeps what the device's kernel keeps
# (:mod:`lightning_pipe.measure.attention`).
CUDA_FLASH_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention
CUDA_EFFICIENT_ATTENTION = torch.ops.aten._scaled_dot_product_efficient_attention
MATH_ATTENTION = torch.ops.aten._scaled_dot_product_attention_math


# --- the allocator's reports ---------------------------------------------------------------------

def _memory_events_config() -> Any:
    from torch._C._profiler import ProfilerConfig, ProfilerState, _ExperimentalConfig

    # CPU events, memory on, no shapes, stacks, FLOPs or modules
    return ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())


def profiler_enabled() -> bool:
    """Whether an autograd profiler session is running (then the meter observes nothing)."""
    return bool(torch._C._autograd._profiler_enabled())


def start_memory_events() -> None:
    """Start a legacy profiler session that records every allocation and free: the meter
    learns an operator's workspace (bytes it allocates and frees inside) from them.
    ``torch.profiler`` records the same events but costs a trace's worth per call."""
    torch._C._autograd._enable_profiler_legacy(_memory_events_config())


def stop_memory_events() -> list[list[Any]]:
    """End :func:`start_memory_events`'s session: its events, per thread (each has
    ``cpu_elapsed_us(start)``, ``cpu_memory_usage()``, ``cuda_memory_usage()``)."""
    threads: list[list[Any]] = torch._C._autograd._disable_profiler_legacy()
    return threads


# --- torch.distributed ---------------------------------------------------------------------------

def fake_process_group(rank: int, size: int) -> Any:
    """torch's FakeProcessGroup (private: it backs torch's own tests of distributed code on one
    process): answers every collective and point-to-point call at once and moves no data. The
    plan check runs a rank's schedule on it."""
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(rank, size)


def default_store() -> "Store":
    """The default process group's key-value store (lives in global rank 0): the first failure
    is recorded there for every rank to name. Raises ``RuntimeError``/``ValueError`` without a
    process group."""
    return torch.distributed.distributed_c10d._get_default_store()


class NoWarmupVotes:
    """A pipelining stage that skips the warm-up votes of ``torch.distributed.pipelining``'s
    schedules (private methods the schedules call on each stage) and takes the static shapes
    every stage votes for when given its input and output metadata. On a silent mesh no peer's
    vote arrives, and the vote would read a tensor without data. Mix in before the stage class.

    An override of private methods cannot be wrapped; it lives here, and a test checks that
    ``PipelineStage`` still has both methods with these signatures."""

    def _warmup_forward_vote(self, has_backward: bool, received_acc: Tensor | None = None) -> Tensor:
        return _static_vote()

    def _warmup_backward_result(self, received_result: Tensor | None = None) -> Tensor:
        return _static_vote()


def skip_backward(stage: Any, chunk: int, inputs: int) -> None:
    """Stand in for a pipelining stage's backward of micro-batch ``chunk``: its forward's
    values dropped and no gradient for its ``inputs`` (pipelining sends zeros for ``None``).
    ``fwd_cache`` and ``bwd_cache`` are the stage's undocumented state that
    ``backward_one_chunk`` reads and fills; a test checks they still are."""
    stage.fwd_cache.pop(chunk, None)
    stage.bwd_cache[chunk] = (None,) * inputs


def skip_weight_backward(stage: Any, chunk: int) -> None:
    """Stand in for a pipelining stage's weight-gradient step of micro-batch ``chunk`` (the
    zero-bubble schedules split each backward) after its input-gradient step was skipped:
    drop what that step would have left. ``dw_runner`` and ``backward_state`` are the stage's
    undocumented state that ``backward_one_chunk(full_backward=False)`` fills and
    ``backward_weight_one_chunk`` reads; a test checks they still are."""
    stage.dw_runner.pop(chunk, None)
    stage.backward_state.pop(chunk, None)


def _static_vote() -> Tensor:
    """The vote for static shapes, whose value the schedule reads: made from a Python list, so
    that within a fake tensor mode (a fake rank's check on the CPU) it keeps its value."""
    return torch.tensor([1], dtype=torch.int32)
