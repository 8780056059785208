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
static bytes count the batch, which its process loads once: counted once here. They count
its parameters' gradients too, which a step makes at the stage's first backward task (a
whole backward or a weight half): before it, the stage holds none while another stage of its
process runs (DualPipeV's first process runs its last stage's backwards while its first stage
holds every micro-batch: counting them there, 8% over the meter).

Under a split backward each micro-batch between its halves also keeps the gradients its
weight half reads (:meth:`~lightning_pipe.plan.memory.CostModel.weight_grads`), counted
likewise: per stage, those of the micro-batches pending at the task, its own peak counting
those of its most.
"""

from collections.abc import Mapping, Sequence

from lightning_pipe.plan.memory import CostModel, StagePeak, stage_ranges
from lightning_pipe.plan.policy import Policy
from lightning_pipe.plan.schedule import HELD_CHANGE, Action, Pending

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
    pending: Sequence[Pending | None] = (),
) -> list[int]:
    """Each process's peak (bytes) over its action list in ``order`` (one list per process,
    :func:`~lightning_pipe.plan.schedule.actions`), given each stage's predicted ``peaks``
    holding ``in_flight`` micro-batches and, under a split backward, ``pending`` ones between
    its halves (:func:`~lightning_pipe.plan.schedule.weights_pending`; none when empty)."""
    stash = stashes(model, balance, policies)
    ranges = stage_ranges(balance)
    static = [model.static(r.start, r.stop) for r in ranges]
    grads = [model.step_grads(r.start, r.stop) for r in ranges]
    split = pending or [None] * len(ranges)
    kept = [model.weight_grads(r.start, r.stop) if p else 0 for r, p in zip(ranges, split)]  # per micro-batch pending
    # holding one micro-batch, none between the halves: less the most its peak may count of both
    own = [p.total - max([(h - 1) * b + (w.forward * k if w else 0)] + [(j - 1) * b + c * k for j, c in w.backward])
           if w and k else p.total - (h - 1) * b for p, h, b, w, k in zip(peaks, in_flight, stash, split, kept)]
    loaded = model.batch if model.carry else 0  # each stage's static counts the batch its process loads once
    found = []
    for tasks in order:
        stages = sorted({a.stage for a in tasks})
        held, halves = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
        fresh = {t: grads[t] for t in stages}  # until its first backward task makes them
        top = 0
        for action in tasks:
            s, change = action.stage, HELD_CHANGE[action.kind]
            if action.kind == "update":
                continue
            held[s] += max(change, 0)  # a forward's micro-batch is held while it runs
            halves[s] -= action.kind == "weight"  # a backward task's own micro-batch is in own[s]
            others = sum(static[t] - fresh[t] - loaded + held[t] * stash[t] + halves[t] * kept[t]
                         for t in stages if t != s)
            top = max(top, others + own[s] + (held[s] - 1) * stash[s] + halves[s] * kept[s])
            held[s] += min(change, 0)
            halves[s] += action.kind == "input"
            fresh[s] = 0 if action.kind in ("backward", "weight") else fresh[s]
        found.append(top)
    return found
