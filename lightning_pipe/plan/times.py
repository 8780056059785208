"""Node times on a grid: pooled over nodes doing the same work, exact when summed."""

import re
import statistics

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
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, n in enumerate(profile.nodes):
        work = (
            _NUMBERS.sub("#", n.name), n.output_bytes, n.saved_bytes, n.transient_bytes, n.param_bytes,
            n.backward_bytes, n.output_grad_bytes,
        )
        groups.setdefault(work, []).append(i)
    forward = [0.0] * len(profile.nodes)
    backward = [0.0] * len(profile.nodes)
    for members in groups.values():
        f = on_grid(_median([profile.nodes[i].forward_ms for i in members]))
        b = on_grid(_median([profile.nodes[i].backward_ms for i in members]))
        for i in members:
            forward[i], backward[i] = f, b
    return forward, backward


def _median(values: list[float]) -> float:
    """:func:`statistics.median`, without its sort for a node whose work no other node does."""
    return values[0] if len(values) == 1 else statistics.median(values)


# Times are multiples of 2**-20 ms (about 1 ns), so that sums of them (stage times, simulated
# steps) are exact in floating point: equal work adds up to exactly equal times, whatever the
# profile's scale, and a tie between splits stays a tie instead of going by rounding.
TICK_MS = 2.0**-20


def on_grid(ms: float) -> float:
    return round(ms / TICK_MS) * TICK_MS
