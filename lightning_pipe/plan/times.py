"""Node times on a grid: pooled over nodes doing the same work, exact when summed."""

import re
import statistics
from operator import attrgetter

import numpy as np

from lightning_pipe.plan.profile import Profile

__all__ = ["TICK_MS", "on_grid", "pooled_times"]


# A node's name's numbers: the same work in another block, or of another count, is named alike but for them.
_NUMBERS = re.compile(r"\d+")


def pooled_times(profile: Profile) -> tuple[list[float], list[float]]:
    """Forward and backward milliseconds per node, each the median over the nodes doing the
    same work: names equal but for their numbers (``blocks_3_ln1``, ``blocks_5_ln2``; ``add_7``)
    and the same byte counts, i.e. the same operation on the same shapes. Repeated blocks then
    cost exactly the same, so splits that differ only in which copy they cut tie exactly rather
    than by timing noise, and a pooled time is less noisy than one measurement."""
    nodes = profile.nodes
    # (one substitution over every name: node names hold no line breaks)
    names = _NUMBERS.sub("#", "\n".join(n.name for n in nodes)).split("\n") if nodes else []
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, work in enumerate(zip(names, map(_WORK_BYTES, nodes))):
        groups.setdefault(work, []).append(i)
    forward = [n.forward_ms for n in nodes]
    backward = [n.backward_ms for n in nodes]
    for members in groups.values():
        if len(members) > 1:
            f = _median([forward[i] for i in members])
            b = _median([backward[i] for i in members])
            for i in members:
                forward[i], backward[i] = f, b
    return _on_grid(forward), _on_grid(backward)


# The byte counts of a node's work: with its name but for numbers, what makes two nodes' work the same.
_WORK_BYTES = attrgetter("output_bytes", "saved_bytes", "transient_bytes", "param_bytes", "backward_bytes",
                         "output_grad_bytes")


def _on_grid(ms: list[float]) -> list[float]:
    """:func:`on_grid` of each of ``ms`` (rounded half to even, as :func:`round` does)."""
    grid: list[float] = (np.round(np.asarray(ms, dtype=np.float64) / TICK_MS) * TICK_MS).tolist()
    return grid


def _median(values: list[float]) -> float:
    """:func:`statistics.median`, without its sort for a node whose work no other node does."""
    return values[0] if len(values) == 1 else statistics.median(values)


# Times are multiples of 2**-20 ms (about 1 ns), so that sums of them (stage times, simulated
# steps) are exact in floating point: equal work adds up to exactly equal times, whatever the
# profile's scale, and a tie between splits stays a tie instead of going by rounding.
TICK_MS = 2.0**-20


def on_grid(ms: float) -> float:
    return round(ms / TICK_MS) * TICK_MS
