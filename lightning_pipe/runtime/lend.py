"""Lend: a parameter or buffer one stage owns, read by a later stage on its own device.

Tied weights (a GPT's output head sharing the token embedding) and modules called in two
places (one BatchNorm applied twice) put one tensor in two stages. It lives on its owner's
device and the borrower reads a copy on its own. A parameter is copied once per batch and
device (:meth:`Lender.new_batch`), not once per micro-batch: every micro-batch reads the same
differentiable copy, so autograd keeps one copy, and a backward over the whole batch (GPipe)
sums the micro-batches' gradients on the borrower before they cross back to the parameter
once. A buffer is copied at every call, since its owner may update it in between (running
statistics), and what the call leaves in the copy is written back, so the updates land in
the one real buffer in the order they ran.
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from lightning_pipe.internals import preserve_version_counter
from lightning_pipe.runtime.transport import move

__all__ = ["Lender", "lent_buffers"]


class Lender:
    """The copies of borrowed parameters for the current batch, one per device."""

    def __init__(self) -> None:
        self._copies: dict[tuple[int, torch.device, bool], Tensor] = {}

    def new_batch(self) -> None:
        """Drop the copies: the parameters may have changed since (an optimizer step)."""
        self._copies.clear()

    def lend(self, param: nn.Parameter, device: torch.device) -> Tensor:
        """``param`` on ``device``: this batch's copy (with or without autograd history, as
        grad mode is now), made at the first call."""
        key = (id(param), device, torch.is_grad_enabled())
        if key not in self._copies:
            self._copies[key] = move(param, device)
        return self._copies[key]


@contextmanager
def lent_buffers(buffers: Mapping[str, Tensor], device: torch.device) -> Iterator[dict[str, Tensor]]:
    """Copies of ``buffers`` on ``device`` for one call; on leaving, what the call wrote to
    each copy is written back to its buffer. Kernels update running statistics in place
    without marking the tensor as changed, so every copy is written back, and neither does
    the write-back: the owner's backward may have saved the buffer (batch norm saves its
    running statistics, and reads them only in eval mode)."""
    copies = {name: move(b, device) for name, b in buffers.items()}
    yield copies
    with torch.no_grad():
        for name, buffer in buffers.items():
            if copies[name] is not buffer:
                with preserve_version_counter(buffer):
                    buffer.copy_(copies[name])
