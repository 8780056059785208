"""Two weight versions for 2BW: gradients computed on the previous step's weights.

PipeDream-2BW updates ``W(t+1) = W(t) - lr * grad(W(t-1))``: every micro-batch of step ``t``
runs on ``W(t-1)`` while the optimizer holds ``W(t)``, so at most two versions of each weight
exist. Swapping storages (``.data``) keeps the ``Parameter`` objects, and with them the
optimizer, the state_dict and tied weights, unchanged.
"""

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["WeightVersions"]


class WeightVersions:
    """The live weights (in the parameters) and one stale copy of them."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = list({id(p): p for p in params}.values())
        with torch.no_grad():
            self.stale = [p.detach().clone() for p in self.params]

    @contextmanager
    def stale_weights(self) -> Iterator[None]:
        """Run forward and backward on the stale version; gradients land in ``.grad`` as usual."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def advance(self) -> None:
        """Before an optimizer step: the current weights become the stale version."""
        with torch.no_grad():
            for p, s in zip(self.params, self.stale):
                s.copy_(p)

    def follow_params(self) -> None:
        """Keep each stale copy on its parameter's device after the parameters moved."""
        self.stale = [s.to(p.device) for p, s in zip(self.params, self.stale)]

    def _swap(self) -> None:
        for k, p in enumerate(self.params):
            p.data, self.stale[k] = self.stale[k], p.data
