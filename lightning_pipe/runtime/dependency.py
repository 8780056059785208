"""Fork/join: autograd edges that fix the backward order across micro-batches.

Autograd orders backward only by data dependencies. Forking an empty "phony" tensor off
micro-batch ``i-1``'s stage output and joining it into micro-batch ``i``'s stage input makes
stage ``j`` run ``i``'s backward before ``i-1``'s: the reverse of the forward order, as in
torchgpipe, so the order per device is deterministic.
"""

from typing import cast

import torch
from torch import Tensor

__all__ = ["fork", "join"]


class _Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, input: Tensor) -> tuple[Tensor, Tensor]:
        return input.detach(), input.new_empty(0)

    @staticmethod
    def backward(ctx: object, grad: Tensor, _phony_grad: Tensor) -> Tensor:
        return grad


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, input: Tensor, phony: Tensor) -> Tensor:
        return input.detach()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def fork(input: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``input`` (to use in its place) and a phony whose backward it will wait for."""
    return cast(tuple[Tensor, Tensor], _Fork.apply(input))  # type: ignore[no-untyped-call]


def join(input: Tensor, phony: Tensor) -> Tensor:
    """Return ``input`` (to use in its place), making ``phony``'s backward wait for it."""
    return cast(Tensor, _Join.apply(input, phony))  # type: ignore[no-untyped-call]
