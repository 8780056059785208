"""Transport: how values travel from the stage that made them to the stage that uses them.

A value goes straight from its producer to each consumer (no relaying through stages in
between). Copies that touch a CUDA device run on a per-device side stream so they can
overlap compute; the consumer's stream waits for the copy, and the allocator is told which
streams use each tensor.
"""

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = ["move"]

_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def move(value: Any, device: torch.device) -> Any:
    """Move every tensor in the pytree ``value`` to ``device``, keeping autograd history."""
    return tree_map(lambda x: _move(x, device) if isinstance(x, Tensor) else x, value)


def _move(x: Tensor, device: torch.device) -> Tensor:
    if x.device == device:
        return x
    if x.requires_grad:
        return _Copy.apply(x, device)
    return _copy(x, device)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, device: torch.device) -> Tensor:  # type: ignore[override]
        ctx.source = x.device
        return _copy(x, device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _copy(grad, ctx.source), None


def _copy(x: Tensor, device: torch.device) -> Tensor:
    if x.device.type != "cuda" and device.type != "cuda":
        return x.to(device)
    cuda = x.device if x.device.type == "cuda" else device
    stream = _copy_stream(cuda)
    if x.is_cuda:
        stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        y = x.to(device, non_blocking=True)
    if x.is_cuda:
        x.record_stream(stream)  # keep x's memory until the copy has read it
    if y.is_cuda:
        consumer = torch.cuda.current_stream(y.device)
        consumer.wait_stream(stream)
        y.record_stream(consumer)
    else:
        stream.synchronize()  # a CPU consumer reads the host buffer right away
    return y


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device)
    return _copy_streams[device]
