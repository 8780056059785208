"""Several stages on one device: the device's peak, read off the order its tasks run in.

A process holding several stages (the interleaved and V-shape schedules) holds all of their
parameters and state all along, and at each moment the stash of every micro-batch each of
them has run forward and not yet finished backward (under a split backward: whose weight
half has not run). Its peak is the highest of those moments, not the sum of its stages' own
peaks, which they reach at different tasks: the V's first stage holds many micro-batches
while its last holds one.

At a task of stage ``r`` the device holds, per other stage ``t`` of it, ``static_t + H_t *
stash_t`` (``H_t`` micro-batches held then), and for ``r`` its own peak with ``H_r`` held:
the stage's predicted peak less the stash of the micro-batches it held beyond ``H_r``
(:meth:`~lightning_pipe.plan.memory.CostModel.peak` grows by one stash per micro-batch held).
With one stage per device this is the stage's predicted peak. As processes, each stage's
static bytes count the batch, which its process loads once: counted once here.
"""

from collections.abc import Mapping, Sequence

from lightning_pipe.plan.memory import CostModel, StagePeak, stage_ranges
from lightning_pipe.plan.policy import Policy
from lightning_pipe.plan.schedule import HELD_CHANGE, Action

__all__ = ["device_peaks", "stashes"]


def stashes(model: CostModel, balance: Sequence[int], policies: Mapping[int, Policy]) -> list[int]:
    """Per stage, the bytes one micro-batch it holds keeps on its device until its backward:
    its stash under ``policies`` and, for stages as processes, its outputs (kept until then)."""
    found = []
    for r in stage_ranges(balance):
        live = model.live(r.start, r.stop, policies)
        found.append(live.stashed + (live.leaving if model.carry and r.stop < model.n else 0))
    return found


def device_peaks(
    model: CostModel,
    balance: Sequence[int],
    policies: Mapping[int, Policy],
    peaks: Sequence[StagePeak],
    in_flight: Sequence[int],
    order: Sequence[Sequence[Action]],
) -> list[int]:
    """Each process's peak (bytes) over its action list in ``order`` (one list per process,
    :func:`~lightning_pipe.plan.schedule.actions`), given each stage's predicted ``peaks``
    holding ``in_flight`` micro-batches."""
    stash = stashes(model, balance, policies)
    static = [model.static(r.start, r.stop) for r in stage_ranges(balance)]
    own = [p.total - (h - 1) * b for p, h, b in zip(peaks, in_flight, stash)]  # holding one micro-batch
    loaded = model.batch if model.carry else 0  # each stage's static counts the batch its process loads once
    found = []
    for tasks in order:
        stages = sorted({a.stage for a in tasks})
        held = dict.fromkeys(stages, 0)
        top = 0
        for action in tasks:
            s, change = action.stage, HELD_CHANGE[action.kind]
            if action.kind == "update":
                continue
            held[s] += max(change, 0)  # a forward's micro-batch is held while it runs
            others = sum(static[t] - loaded + held[t] * stash[t] for t in stages if t != s)
            top = max(top, others + own[s] + (held[s] - 1) * stash[s])
            held[s] += min(change, 0)
        found.append(top)
    return found
