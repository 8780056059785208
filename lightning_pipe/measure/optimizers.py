"""An optimizer of the user's class and settings over other parameters (fake or probe ones).

The profiler prices a step of the user's optimizer on probe tensors and the plan check runs
one on a ``meta`` copy of the model, so both need the same optimizer over other tensors. Its
class's ``__init__`` cannot always be called again: ``optimizer.defaults`` may hold settings it
rejects (AdamW fixes ``decoupled_weight_decay``), and a user's class may take arguments its
defaults do not hold. So the optimizer is copied, its own attributes kept, and only
``Optimizer.__init__`` runs again: fresh state and hooks, the same defaults for the new groups.
"""

import copy
from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

__all__ = ["rebuild"]


def rebuild(optimizer: Optimizer, params: Iterable[Tensor] | Iterable[dict[str, Any]]) -> Optimizer:
    """An optimizer of ``optimizer``'s class and settings over ``params`` (tensors, or groups
    holding their own settings), with no state."""
    twin = copy.copy(optimizer)
    Optimizer.__init__(twin, params, dict(optimizer.defaults))
    return twin
