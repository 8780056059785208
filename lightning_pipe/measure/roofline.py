"""Roofline: what each node's operators would take on a GPU, from the work they do.

A profile on fake tensors runs nothing to time, yet the planner needs times: to balance
compute, and to weigh recompute, swap and transfers, priced in seconds, against each other.
:class:`WorkCounter` sees every operator (a dispatch mode) and charges it to the node that
runs it, in forward by what the profiler says runs, in backward by the autograd node (tagged
after each node's forward, as the meter tags stages): the longer of its FLOPs at the device's
peak for its math and the bytes it reads and writes at the device's memory bandwidth. FLOPs
are torch's own formulas (:mod:`torch.utils.flop_counter`); an operator without one (an
elementwise operator, a reduction) is bound by its bytes. Fused kernels, caches and launch
overheads are outside the model: it bounds each operator from below.
"""

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.utils.flop_counter import flop_registry, shape_wrapper

from lightning_pipe.internals import (
    CPU_FLASH_ATTENTION,
    CPU_FLASH_ATTENTION_BACKWARD,
    TorchDispatchMode,
    current_autograd_node,
    op_schema,
    tree_flatten,
)
from lightning_pipe.plan.devices import DeviceSpec, Math

__all__ = ["WorkCounter", "operator_ms"]


class WorkCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Per node, the milliseconds its forward and its backward take on ``device``, each
    operator call costing ``overhead_ms`` more (its launch: what bounds small operators)."""

    def __init__(self, nodes: int, device: DeviceSpec, overhead_ms: float = 0.0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device = device
        self.overhead_ms = overhead_ms
        self.forward_ms = [0.0] * nodes
        self.backward_ms = [0.0] * nodes
        self._node: int | None = None
        self._tag = f"lightning_pipe.work.{id(self)}"

    @contextmanager
    def running(self, node: int) -> Iterator[None]:
        """Charge the operators run inside to ``node``'s forward."""
        self._node = node
        try:
            yield
        finally:
            self._node = None

    def tag_backward(self, outputs: Iterable[Any], node: int) -> None:
        """Mark the autograd nodes ``node``'s forward made, so its backward is charged to it."""
        stack: list[Node | None] = [t.grad_fn for t in tree_flatten(list(outputs))[0] if isinstance(t, Tensor)]
        while stack:
            grad_fn = stack.pop()
            if grad_fn is None or self._tag in grad_fn.metadata:  # type: ignore[operator]
                continue
            grad_fn.metadata[self._tag] = node  # type: ignore[index]
            stack.extend(f for f, _ in grad_fn.next_functions)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        grad_fn: Node | None = current_autograd_node()
        if grad_fn is None:
            node, times = self._node, self.forward_ms
        else:
            node, times = grad_fn.metadata.get(self._tag), self.backward_ms  # type: ignore[attr-defined]
        if node is not None:
            times[node] += operator_ms(self.device, func, args, kwargs, out) + self.overhead_ms
        return out


def operator_ms(device: DeviceSpec, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    """Milliseconds of one operator call on ``device``: its FLOPs at the peak for its math,
    or the bytes of its inputs and outputs at the memory bandwidth, whichever is longer. A
    view (its schema says so, or its outputs share an input's storage) moves no bytes; an
    in-place operator reads and writes its input."""
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
    storages = {id(t.untyped_storage()) for t in inputs}
    if not op_schema(func).is_mutable and (
        func.is_view or all(id(t.untyped_storage()) in storages for t in outputs)
    ):
        return 0.0
    nbytes = sum(t.numel() * t.element_size() for t in inputs + outputs)
    formula = _FLOPS.get(func.overloadpacket)
    flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
    return device.roofline_ms(flops, nbytes, _math(func, inputs))


def _math(func: Any, inputs: Sequence[Tensor]) -> Math:
    """The math an operator's FLOPs run in: its inputs' precision, and for float32 products
    TF32 where PyTorch allows it (by default for convolutions, not for matrix products)."""
    dtype = next((t.dtype for t in inputs if t.is_floating_point()), torch.float32)
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.bfloat16:
        return "bf16"
    convolution = func.overloadpacket in (torch.ops.aten.convolution, torch.ops.aten.convolution_backward)
    tf32 = torch.backends.cudnn.allow_tf32 if convolution else torch.backends.cuda.matmul.allow_tf32
    return "tf32" if dtype == torch.float32 and tf32 else "fp32"


def _attention_flops(
    query: Sequence[int], key: Sequence[int], value: Sequence[int], *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    """``softmax(q kᵀ) v``: two batched products (shapes ``(batch, heads, length, features)``)."""
    *heads, length, features = query
    return 2 * math.prod(heads) * length * key[-2] * (features + value[-1])


def _attention_backward_flops(
    grad: Sequence[int], query: Sequence[int], key: Sequence[int], value: Sequence[int], *args: Any,
    out_shape: Any = None, **kwargs: Any,
) -> int:
    """Its backward: four products, the gradients of the scores, of q, of k and of v."""
    return 2 * _attention_flops(query, key, value)


# torch's formulas, and attention as the CPU runs it, which torch has none for.
_FLOPS = {
    **flop_registry,
    CPU_FLASH_ATTENTION: shape_wrapper(_attention_flops),  # type: ignore[no-untyped-call]
    CPU_FLASH_ATTENTION_BACKWARD: shape_wrapper(  # type: ignore[no-untyped-call]
        _attention_backward_flops
    ),
}
