"""Node times on a grid: pooled over nodes doing the same work, exact when summed."""

import re
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np

from lightning_pipe.plan.nodes import Array
from lightning_pipe.plan.profile import Profile

__all__ = ["TICK_MS", "WORK_BYTES", "on_grid", "pooled_times"]


# A node's name's numbers: the same work in another block, or of another count, is named alike but for them.
_NUMBERS = re.compile(r"\d+")
# The byte counts of a node's work: with its name but for numbers, what makes two nodes' work the same.
WORK_BYTES = ("output_bytes", "saved_bytes", "transient_bytes", "param_bytes", "backward_bytes", "output_grad_bytes")


def pooled_times(profile: Profile, work: Sequence[Array]) -> tuple[list[float], list[float]]:
    """Forward and backward milliseconds per node, each the median over the nodes doing the
    same work: names equal but for their numbers (``blocks_3_ln1``, ``blocks_5_ln2``; ``add_7``)
    and the same byte counts (``work``: per node, each of :data:`WORK_BYTES`), i.e. the same
    operation on the same shapes. Repeated blocks then cost exactly the same, so splits that
    differ only in which copy they cut tie exactly rather than by timing noise, and a pooled
    time is less noisy than one measurement. (Grouped and pooled by NumPy: a planner pools the
    times of every profile it plans, one per micro-batch size searched.)"""
    nodes = profile.nodes
    if not nodes:
        return [], []
    # (one substitution over every name: node names hold no line breaks)
    names: dict[str, int] = {}
    pattern = _NUMBERS.sub("#", "\n".join(n.name for n in nodes)).split("\n")
    named = [names.setdefault(name, len(names)) for name in pattern]
    keys = [np.asarray(named, dtype=np.int64), *work]
    order = np.lexsort(keys)  # nodes doing the same work next to each other
    new = np.ones(len(nodes), dtype=bool)
    new[1:] = np.any([k[order[1:]] != k[order[:-1]] for k in keys], axis=0)
    group = np.empty(len(nodes), dtype=np.int64)
    group[order] = np.cumsum(new) - 1
    return (_on_grid(_medians(np.asarray([n.forward_ms for n in nodes], dtype=np.float64), group)),
            _on_grid(_medians(np.asarray([n.backward_ms for n in nodes], dtype=np.float64), group)))


Times: TypeAlias = "np.ndarray[tuple[int], np.dtype[np.float64]]"


def _medians(ms: Times, group: Array) -> Times:
    """Per node, the median of ``ms`` over its ``group`` (:func:`statistics.median`: the middle
    value, or the mean of the two middle ones; a value alone is its own median)."""
    order = np.lexsort((ms, group))
    counts = np.bincount(group)
    starts = np.cumsum(counts) - counts
    ordered = ms[order]
    medians: Times = ((ordered[starts + (counts - 1) // 2] + ordered[starts + counts // 2]) / 2)[group]
    return medians


def _on_grid(ms: Times) -> list[float]:
    """:func:`on_grid` of each of ``ms`` (rounded half to even, as :func:`round` does)."""
    grid: list[float] = (np.round(ms / TICK_MS) * TICK_MS).tolist()
    return grid


# Times are multiples of 2**-20 ms (about 1 ns), so that sums of them (stage times, simulated
# steps) are exact in floating point: equal work adds up to exactly equal times, whatever the
# profile's scale, and a tie between splits stays a tie instead of going by rounding.
TICK_MS = 2.0**-20


def on_grid(ms: float) -> float:
    return round(ms / TICK_MS) * TICK_MS
