"""Transport: how values travel from the stage that made them to the stage that uses them.

A value goes straight from its producer to each consumer (no relaying through stages in
between). A copy runs on side streams (the source's and the destination's, both current, as torchgpipe
enters both) so it overlaps the compute of either device: the source's side stream first waits
for the producer's stream, the consumer's stream then waits for the copy, and the allocator is told that the side
stream reads the source and the consumer's stream uses the copy. On the CPU the same calls
run and do nothing (:mod:`lightning_pipe.stream`).
"""

from typing import Any, cast

import torch
from torch import Tensor

from lightning_pipe.internals import tree_map
from lightning_pipe.stream import current_stream, record_stream, side_stream, use_stream, wait_stream

__all__ = ["move"]


def move(value: Any, device: torch.device) -> Any:
    """Move every tensor in the pytree ``value`` to ``device``, keeping autograd history."""
    return tree_map(lambda x: _move(x, device) if isinstance(x, Tensor) else x, value)


def _move(x: Tensor, device: torch.device) -> Tensor:
    if x.device == device:
        return x
    if x.requires_grad:
        return cast(Tensor, _Copy.apply(x, device))  # type: ignore[no-untyped-call]
    return _copy(x, device)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, device: torch.device) -> Tensor:
        ctx.source = x.device
        return _copy(x, device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _copy(grad, ctx.source), None


def _copy(x: Tensor, device: torch.device) -> Tensor:
    producer, consumer = current_stream(x.device), current_stream(device)
    source, target = side_stream(x.device), side_stream(device)
    wait_stream(source, producer)
    # both devices' side streams current: a copy between GPUs queues behind neither one's compute
    with use_stream(source), use_stream(target):
        y = x.to(device, non_blocking=True)
    record_stream(x, source)  # keep x's memory until the copy has read it
    wait_stream(consumer, target)
    wait_stream(consumer, source)  # a CPU consumer blocks: it reads the host copy right away
    record_stream(y, consumer)
    return y
