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

Where a process holds two adjacent stages (a V's turn), ``torch.distributed.pipelining``
hands the first's outputs to the second as they are, in place of the second's receive
buffers: a value the first only passes on is the first's own buffer, and one it makes lives
on as the second's buffer until the next step's, not in the first's stash.

Under a split backward each micro-batch between its halves also keeps the gradients its
weight half reads (:meth:`~lightning_pipe.plan.memory.CostModel.weight_grads`), counted
likewise: per stage, those of the micro-batches pending at the task, its own peak counting
those of its most.
"""

from collections.abc import Mapping, Sequence

from lightning_pipe.plan.memory import CostModel, StagePeak, stage_ranges
from lightning_pipe.plan.policy import Policy
from lightning_pipe.plan.schedule import HELD_CHANGE, Action, Pending, TaskKind

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
    # what a stage sends another process stays alive until the step ends where a process holds
    # several stages (the schedules waiting for their sends there): its outputs past their
    # backward, the gradients it sends back
    waited = bool(model.carry) and any(len({a.stage for a in tasks}) > 1 for tasks in order)
    # there, at each kind of task, the stage's peak at it (less the same); else the stage's peak
    at_task: dict[TaskKind, list[int]] = dict.fromkeys(("forward", "backward", "input", "weight"), own)
    if waited:
        later: tuple[TaskKind, ...] = ("backward", "input", "weight")
        for kind in later:
            at_task[kind] = [model.task_peak(r.start, r.stop, h, kind, policies, w).total - (p.total - o)
                             for r, h, w, p, o in zip(ranges, in_flight, split, peaks, own)]
        at_task["forward"] = [model.task_peak(r.start, r.stop, h, "forward", policies, w).total - (h - 1) * b
                              - (w.forward * k if w else 0)
                              for r, h, b, w, k in zip(ranges, in_flight, stash, split, kept)]
    outputs = [model.made_sent(r.start, r.stop) if waited and r.stop < model.n else 0 for r in ranges]
    sent_grads = [model.input_grads(r.start) if waited else 0 for r in ranges]
    found = []
    for tasks in order:
        stages = sorted({a.stage for a in tasks})
        static_, stash_ = ({t: v[t] for t in stages} for v in (static, stash))
        own_ = {kind: {t: v[t] for t in stages} for kind, v in at_task.items()}
        for t in (t for t in stages if t + 1 in stages and waited):  # a V's turn: handed on in-process
            passed, made = model.carry * model.passed_on(ranges[t].start, ranges[t].stop), outputs[t]
            static_[t + 1], stash_[t] = static_[t + 1] - passed, stash_[t] - made
            for at in own_.values():
                at[t + 1], at[t] = at[t + 1] - passed, at[t] - made
        held, halves = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
        fresh = {t: grads[t] for t in stages}  # until its first backward task makes them
        top = sent = 0
        for action in tasks:
            s, change = action.stage, HELD_CHANGE[action.kind]
            if action.kind == "update":
                continue
            held[s] += max(change, 0)  # a forward's micro-batch is held while it runs
            halves[s] -= action.kind == "weight"  # a backward task's own micro-batch is in own[s]
            others = sum(static_[t] - fresh[t] - loaded + held[t] * stash_[t] + halves[t] * kept[t]
                         for t in stages if t != s)
            # (a forward peak is a step's first forward's: with the gradients its backwards made since)
            running = own_[action.kind][s] + (grads[s] - fresh[s] if action.kind == "forward" and waited else 0)
            top = max(top, sent + others + running + (held[s] - 1) * stash_[s] + halves[s] * kept[s])
            if action.kind in ("backward", "input") and s - 1 not in stages:
                sent += sent_grads[s]
            if action.kind in ("backward", "weight") and s + 1 not in stages:
                sent += outputs[s]
            held[s] += min(change, 0)
            halves[s] += action.kind == "input"
            fresh[s] = 0 if action.kind in ("backward", "weight") else fresh[s]
        found.append(top)
    return found
