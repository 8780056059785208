"""Memory model: predict each stage's peak bytes from a profile, a split and a schedule.

A stage's memory follows its schedule: forwards add a micro-batch's stash at a time, and the
first backward starts with every micro-batch in flight stashed. So the peak is the larger of

    forward:  static + (in_flight - 1) * stashed + waiting outputs + one forward's live bytes
    backward: static + (in_flight - 1) * stashed + one backward's live bytes

static: parameters (one copy per weight version the schedule keeps), gradients and optimizer
state the stage owns, and the one copy per batch of each parameter it borrows (a tied weight
whose first user is on an earlier stage); stashed: bytes one micro-batch keeps for backward
(a storage counts at the node saving it first, as on a device of its own); in_flight:
micro-batches whose stash a schedule holds at once (GPipe: all of them). One forward's live
bytes at a node: what the nodes before it stashed, the values they made that are still to be
read, and the node's own allocations (outputs and workspace); one backward's at a node: the
stash of the nodes up to it, the gradients made for earlier nodes' values not yet taken, and
the node's backward growth (in a step's first backward the parameter gradients appear as it
goes). Under GPipe a stage's outputs of earlier micro-batches wait for the stage reading them
while it runs (the last stage's, for the merge of all micro-batches'). The last stage also holds
the training batch and the loss made from its outputs, which the strategy measures. What waits
at a stage for other stages (gradients for an earlier stage's backward under 1F1B and 2BW, a
long skip's values under GPipe) is known once a split is (:meth:`CostModel.waiting`).

Per node, a policy says where its saved bytes live between forward and backward: ``keep``
(on the device), ``swap`` (in host memory: no device bytes while in flight, brought back when
the backward of what follows it begins) or ``recompute`` (dropped; a maximal run of recomputed
nodes, a *region*, stashes only its inputs and rebuilds its stash before its backward).

:class:`CostModel` holds prefix sums over the profile so that a planner can price contiguous
node ranges fast; one range's live bytes are computed once (vectorised) and cached. Given the
``link_bandwidth`` between stage devices, it also prices what a stage sends to the next
(:meth:`CostModel.send_ms`).
"""

import bisect
import itertools
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias, TypeVar

import numpy as np

from lightning_pipe.plan.policy import CodedPolicies, Codes, Policy, policy_codes
from lightning_pipe.plan.profile import NodeProfile, Profile
from lightning_pipe.plan.schedule import GRADIENT_BUCKET_BYTES, BackwardState, Schedule

__all__ = ["CodedPolicies", "CostModel", "Policy", "StagePeak", "predict_peaks", "stage_ranges"]

_Array: TypeAlias = "np.ndarray[tuple[int], np.dtype[np.int64]]"
_Codes2: TypeAlias = "np.ndarray[tuple[int, int], np.dtype[np.int8]]"  # rows of Codes
# bytes waiting at a stage while it runs forwards; at each of its backwards, (held, waiting)
Waiting: TypeAlias = tuple[int, Sequence[tuple[float, int]]]


@dataclass
class StagePeak:
    """A stage's predicted peak, split by kind (bytes)."""

    static: int
    activations: int
    transient: int
    boundary: int

    @property
    def total(self) -> int:
        return self.static + self.activations + self.transient + self.boundary

    def waiting(self, gradients: int) -> "StagePeak":
        """This peak with ``gradients`` bytes of waiting gradients added to the boundary."""
        return StagePeak(self.static, self.activations, self.transient, self.boundary + gradients)


def stage_ranges(balance: Sequence[int]) -> list[range]:
    """Node index ranges of the stages of a balance."""
    ranges, start = [], 0
    for count in balance:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def predict_peaks(
    profile: Profile,
    balance: Sequence[int],
    in_flight: Sequence[int],
    policies: Sequence[Policy] = (),
    weight_versions: int = 1,
    waits: Sequence[Sequence[int]] = (),
    *,
    backward_states: Sequence[Sequence[BackwardState]] = (),
    schedule: Schedule = "1f1b",
    chunks: int = 1,
) -> list[StagePeak]:
    """Predicted peak of every stage; ``in_flight[s]`` micro-batches hold activations at once.

    ``policies`` gives one policy per node (all kept when empty); ``weight_versions`` is the
    number of parameter copies the schedule keeps (2 for PipeDream-2BW); ``waits`` and
    ``backward_states`` are the schedule's :func:`~lightning_pipe.plan.schedule.gradient_waits`
    and :func:`~lightning_pipe.plan.schedule.backward_states` (none wait when empty);
    ``schedule`` and ``chunks`` say what waits on the stages and how large the batch is.
    """
    model = CostModel(profile, schedule=schedule, chunks=chunks)
    chosen = {i: p for i, p in enumerate(policies) if p != "keep"}
    waiting = model.waiting(balance, waits, backward_states, chosen)
    return [
        model.peak(r.start, r.stop, in_flight[s], chosen, weight_versions, waiting[s])
        for s, r in enumerate(stage_ranges(balance))
    ]


_Number = TypeVar("_Number", int, float)


def _prefix(values: Sequence[_Number]) -> list[_Number]:
    out: list[_Number] = [0] * (len(values) + 1)
    for i, v in enumerate(values):
        out[i + 1] = out[i] + v
    return out


class CostModel:
    """A profile's per-node costs, indexed for pricing node ranges ``[lo, hi)`` fast."""

    def __init__(
        self, profile: Profile, link_bandwidth: float | None = None, *, schedule: Schedule = "1f1b", chunks: int = 1,
        carry: int = 0, replicas: int = 1,
    ) -> None:
        nodes = profile.nodes
        self.profile = profile
        self.carry = carry  # micro-batches whose carried values a stage holds (see carried, static)
        self.replicas = replicas  # data-parallel copies of each stage, which reduce its gradients
        self.link_bandwidth = link_bandwidth  # bytes per second between stage devices
        self.n = len(nodes)
        # GPipe: a stage's outputs wait for the next stage, the last stage's for the merge
        # (stages as processes run a loss and a backward per micro-batch, as 1F1B does).
        self.merges = schedule == "gpipe" and not carry
        self.chunks = chunks
        self.batch = chunks * (profile.batch_bytes or profile.input_bytes)  # the training batch
        # on the last stage's device; stages as processes each load it (see static)
        self._last_batch = 0 if carry else self.batch
        self._arrays = _NodeArrays(profile)
        self._kept: dict[tuple[int, int], LiveBytes] = {}
        self._priced: dict[tuple[int, int, bytes], LiveBytes] = {}  # with policies; a search prices many twice
        self._borrowed: dict[tuple[int, int], int] = {}
        self._range_gradients: tuple[tuple[int, int], _Array] = ((0, 0), np.zeros(0, dtype=np.int64))
        self.forward_ms, self.backward_ms = _pooled_times(profile)
        self.saved = [n.saved_bytes for n in nodes]
        self.last_saver = [n.last_saver for n in nodes]
        self.output = [n.output_bytes for n in nodes]
        self.users = [n.users for n in nodes]
        self._params = _prefix([n.param_bytes for n in nodes])
        self._state = _prefix([n.grad_bytes + n.optimizer_bytes for n in nodes])
        self._grads = _prefix([n.grad_bytes for n in nodes])
        # gradient and optimizer-state bytes per parameter byte (tied copies have the same)
        self._state_per_param = self._state[-1] / self._params[-1] if self._params[-1] else 0.0
        self._grads_per_param = self._grads[-1] / self._params[-1] if self._params[-1] else 0.0
        self._saved = _prefix(self.saved)
        self._to_graph_output = _prefix([n.output_bytes if -1 in n.users else 0 for n in nodes])
        # storages a node makes that end up in the graph's output and no later node keeps:
        # under GPipe they wait on its stage for the merge, every micro-batch's
        self._to_output = _prefix([n.held_bytes if n.held_until >= self.n and n.held_by < 0 else 0 for n in nodes])
        self._forward = _prefix(self.forward_ms)
        self._compute = _prefix([f + b for f, b in zip(self.forward_ms, self.backward_ms)])
        self._transient = _sparse_max([max(n.transient_bytes, n.backward_bytes - n.grad_bytes) for n in nodes])
        self._step_sum = _prefix([n.step_bytes for n in nodes])
        self._step_max = _sparse_max([n.step_bytes for n in nodes])
        self.reads_input = set(profile.input_users)
        # Values leaving a range [lo, hi): node i < hi whose last reader is at or after hi
        # (or the graph output). _leaving[hi] lists those (i, bytes), i descending.
        last = [max(n.users) if n.users and min(n.users) >= 0 else (self.n if n.users else -1) for n in nodes]
        self._last_reader = [i if r < 0 else r for i, r in enumerate(last)]  # n: the graph output
        self._leaving: list[list[tuple[int, int]]] = [[] for _ in range(self.n + 1)]
        for i, n in enumerate(nodes):
            sent = max(0, n.output_bytes - n.saved_bytes)
            for cut in range(i + 1, min(last[i], self.n) + 1):
                self._leaving[cut].append((i, sent))
        for entry in self._leaving:
            entry.reverse()
        # crossing[c]: bytes of the values made before node c and read from it on
        self.crossing = [sum(self.output[i] for i, _ in entry) for entry in self._leaving]

    def params(self, lo: int, hi: int) -> int:
        return self._params[hi] - self._params[lo]

    def stashed(self, lo: int, hi: int) -> int:
        """Saved bytes of one micro-batch when every node is kept."""
        return self._saved[hi] - self._saved[lo]

    def compute_ms(self, lo: int, hi: int) -> float:
        """Forward plus backward time of one micro-batch."""
        return self._compute[hi] - self._compute[lo]

    def forward_time(self, lo: int, hi: int) -> float:
        return self._forward[hi] - self._forward[lo]

    def transient(self, lo: int, hi: int) -> int:
        """Largest workspace of a node's forward or backward growth in the range."""
        return _range_max(self._transient, lo, hi)

    def step(self, lo: int, hi: int) -> int:
        """What the optimizer's step holds for a while on a stage of nodes ``[lo, hi)``
        besides parameters, gradients and state: its temporaries (:attr:`NodeProfile.step_bytes`)."""
        if self.profile.step_grouped:
            return self._step_sum[hi] - self._step_sum[lo]
        return _range_max(self._step_max, lo, hi)

    def boundary(self, lo: int, hi: int) -> int:
        """Bytes of one micro-batch's values nodes ``[lo, hi)`` made that later stages read
        and no node of the range keeps: alive once the range's forward is done."""
        return self.live(lo, hi, {}).leaving

    def carried(self, lo: int, hi: int) -> int:
        """Bytes of the distributed runtime's buffers a stage of nodes ``[lo, hi)`` holds per
        micro-batch, from its first step on: one for every value it receives (made before it,
        read by it or a later stage: a U-Net skip, an encoder output, the graph inputs),
        unless one of its nodes saves that value (counted with its activations), and one for
        the gradient coming back of every value it sends (read after it)."""
        total = self.profile.input_bytes if lo > 0 and any(u >= lo for u in self.reads_input) else 0
        nodes = self.profile.nodes
        for i, _ in self._leaving[lo]:
            if not lo <= nodes[i].held_by < hi:
                total += self.output[i]
        for i, _ in self._leaving[hi] if hi < self.n else []:
            total += nodes[i].output_grad_bytes
        return total

    def send_ms(self, lo: int, hi: int) -> float:
        """Milliseconds to send one micro-batch's values leaving nodes ``[lo, hi)`` for later
        stages over the link (their gradients take as long back); 0 without a link, and for
        the last stage, whose outputs stay on its device."""
        if not self.link_bandwidth or hi == self.n:
            return 0.0
        sent = 0
        for i, _ in self._leaving[hi]:
            if i < lo:
                break
            sent += self.output[i]
        return 1e3 * sent / self.link_bandwidth

    def borrowed(self, lo: int, hi: int) -> int:
        """Bytes of the parameters nodes ``[lo, hi)`` read whose first user comes earlier:
        the stage keeps a copy of each."""
        if (lo, hi) not in self._borrowed:
            self._borrowed[lo, hi] = sum(p.nbytes for p in self.profile.shared
                                         if p.users[0] < lo and any(lo <= u < hi for u in p.users))
        return self._borrowed[lo, hi]

    def waiting_gradients(self, balance: Sequence[int], waits: Sequence[Sequence[int]]) -> list[int]:
        """Per stage, bytes of gradients computed for earlier stages that wait there for their
        producer's backward. A schedule that runs backward stage by stage completes a value's
        gradient in the backward of the last stage reading it, ``s``, and keeps it on that
        stage's device until its producer ``p`` runs that micro-batch's backward: up to
        ``waits[p][s]`` micro-batches at once. Only a whole split determines this, so the
        partitioners' search leaves it out and checks it once a split is chosen."""
        if not waits:
            return [0] * len(balance)
        sent = self.gradient_bytes(balance)
        return [sum(sent[p][s] * waits[p][s] for p in range(s)) for s in range(len(balance))]

    def gradient_bytes(self, balance: Sequence[int]) -> list[list[int]]:
        """``[p][s]``: bytes of one micro-batch's gradients that wait at stage ``s`` for stage
        ``p``'s backward. The schedule-driven runtimes keep a value's gradient, summed over its
        readers, on the stage of its last reader until its producer ``p`` takes it. Under
        GPipe, autograd sums it as it goes: each stage reading it makes a new sum, which waits
        there for the next earlier reader's backward (the producer's, after the earliest); a
        reader whose backward hands out slices of one buffer (``cat``) keeps that buffer, once,
        for the earliest stage taking a slice (it waits longest). A value read only on its own
        stage waits for nothing, so only the values crossing a cut are visited."""
        sent = [[0] * len(balance) for _ in balance]
        cuts = list(itertools.accumulate(balance))[:-1]
        slicers: set[int] = set()
        for p, cut in enumerate(cuts):
            start = cuts[p - 1] if p else 0
            for i, _ in self._leaving[cut]:  # i descending: stop at the first made before stage p
                if i < start:
                    break
                reader = self._last_reader[i]
                if not self.merges:
                    sent[p][bisect.bisect_right(cuts, reader)] += self.output[i]
                    continue
                buffer = self.profile.nodes[reader].input_grad_bytes if reader < self.n else 0
                first = 0 if buffer and reader in slicers else max(buffer, self.output[i])  # one buffer per reader
                if buffer:
                    slicers.add(reader)
                readers = sorted({bisect.bisect_right(cuts, u if u >= 0 else self.n) for u in self.users[i]} - {p})
                for taker, holder in zip([p, *readers], readers):
                    sent[taker][holder] += first if holder == readers[-1] else self.output[i]
        return sent

    def waiting(
        self,
        balance: Sequence[int],
        waits: Sequence[Sequence[int]],
        states: Sequence[Sequence[BackwardState]],
        policies: Mapping[int, Policy] = {},
    ) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
        """Per stage of ``balance``, the bytes waiting at it while it runs forwards (gradients
        for earlier stages, and under GPipe outputs for later ones) and, at each of its
        backwards (``states``), the micro-batches it holds and the gradients waiting there."""
        forward = self.waiting_gradients(balance, waits)
        outputs = self.waiting_outputs(balance, policies)
        sent = self.gradient_bytes(balance) if states else []
        backward = [backward_waiting(states[s], [(p, sent[p][s]) for p in range(s) if sent[p][s]]) if states else ()
                    for s in range(len(balance))]
        return [(f + o, b) for f, o, b in zip(forward, outputs, backward)]

    def waiting_outputs(self, balance: Sequence[int], policies: Mapping[int, Policy] = {}) -> list[int]:
        """Per stage, bytes of the values it made for a stage beyond the next that wait for
        it. Under GPipe, stage ``t`` reads a micro-batch's values ``t - s`` clock ticks after
        stage ``s`` made them, so up to ``t - s`` micro-batches of a long skip wait at ``s``;
        a stage's peak counts one (:meth:`peak`), this the rest. Other schedules run a
        micro-batch's forward through every stage at once: none wait; nor when stages carry
        such values on (``carry``)."""
        waiting = [0] * len(balance)
        if not self.merges or self.carry:
            return waiting
        cuts = list(itertools.accumulate(balance))[:-1]
        a = self._arrays
        for s, r in enumerate(stage_ranges(balance)):
            if r.stop == self.n:
                continue
            layout = _Layout.one(r.start, r.stop, policy_codes({i: p for i, p in policies.items() if i in r}, self.n))
            runs = _runs(a, layout)
            first, last = _recomputed_regions(a, layout, runs)
            stashed = _NO_REGION_INPUTS
            if first.size:
                stashed = _regions_inputs(self, layout, first, last)[1:]
            end = _held_end(a, layout, runs, stashed)
            # (a value in the graph's output waits for the merge: see merged)
            for k in np.flatnonzero((end >= r.stop) & (end < self.n) & (a.held[r.start : r.stop] > 0)):
                reader = bisect.bisect_right(cuts, min(int(end[k]), self.n - 1))
                extra = min(self.chunks - 1, reader - s) - min(1, self.chunks - 1)
                waiting[s] += max(0, extra) * int(a.held[r.start + k])
        return waiting

    def static(self, lo: int, hi: int, weight_versions: int = 1) -> int:
        """Bytes held all along: parameters, their state, borrowed copies and, with ``carry``
        (stages as processes), the buffers of carried values (allocated once, kept across
        steps), the state of the borrowed copies (each process steps its own) and the batch
        (each process loads it; the first also gathers the forward's arguments from it)."""
        held = weight_versions * self.params(lo, hi) + self._state[hi] - self._state[lo] + self.borrowed(lo, hi)
        if not self.carry:
            return held
        batch = self.batch + (self.chunks * self.profile.input_bytes if lo == 0 else 0)
        return held + self.carry * self.carried(lo, hi) + round(self.borrowed(lo, hi) * self._state_per_param) + batch

    def region_inputs(self, a: int, b: int, lo: int, hi: int, policies: Mapping[int, Policy]) -> int:
        """Bytes a recomputed region ``[a, b)`` of a stage on ``[lo, hi)`` keeps, if it saves
        anything: the storages of the values it reads from outside itself (a view's, its
        base's) that nothing else keeps as long."""
        if not self.stashed(a, b):
            return 0
        layout = _Layout.one(lo, hi, policy_codes(policies, self.n))
        return int(_regions_inputs(self, layout, np.array([a - lo]), np.array([b - lo]))[0][0])

    def depends_on(self, lo: int, hi: int) -> list[int]:
        """Nodes before ``lo`` whose policies the price of a stage on ``[lo, hi)`` depends on:
        those keeping first a storage the stage reads, and those making it. Whether such a
        node drops what it keeps or makes decides whether a recomputed region of ``[lo, hi)``
        reading it keeps it instead (:func:`_regions_inputs`)."""
        a = self._arrays
        begin, end = np.searchsorted(a.reader, [lo, hi])
        storages = a.read_base[begin:end][a.read[begin:end] < lo]
        keepers = a.held_by[storages]
        found: list[int] = np.unique(np.concatenate((keepers[(keepers >= 0) & (keepers < lo)], storages))).tolist()
        return found

    def peak(
        self,
        lo: int,
        hi: int,
        in_flight: float,
        policies: Mapping[int, Policy] = {},
        weight_versions: int = 1,
        waiting: Waiting = (0, ()),
    ) -> StagePeak:
        """Predicted peak of a stage holding nodes ``[lo, hi)``; ``policies`` maps node index
        to its non-``keep`` policy (other stages' too, when known: a value an earlier stage
        keeps first is not the stage's to keep, unless that stage drops it). ``in_flight``
        may be fractional when a planner prices a group of stages as one. ``waiting``: bytes
        that wait at the stage for other stages while it runs forwards, and at each of its
        backwards what it holds and the bytes waiting (:meth:`waiting`), known once a split
        is."""
        return self._peak(lo, hi, in_flight, self.live(lo, hi, policies), weight_versions, waiting)

    def peaks(
        self,
        lo: int,
        hi: int,
        in_flight: float,
        variants: Sequence["CodedPolicies"],
        weight_versions: int = 1,
        waiting: Waiting = (0, ()),
    ) -> list[StagePeak]:
        """:meth:`peak` under each of ``variants``, priced at once (a search's candidates)."""
        return [self._peak(lo, hi, in_flight, live, weight_versions, waiting) for live in self._lives(lo, hi, variants)]

    def _peak(
        self, lo: int, hi: int, in_flight: float, live: "LiveBytes", weight_versions: int, waiting: Waiting
    ) -> StagePeak:
        static = self.static(lo, hi, weight_versions)
        # stages as processes keep each micro-batch's outputs until its backward
        cached = live.leaving if self.carry and hi < self.n else 0
        backward = self._backward_peaks(lo, hi, in_flight, live, static, waiting[1], cached)
        if cached:  # and the step begins with no gradients
            fresh = static - self._step_grads(lo, hi)
            forward = [self._forward_peak(in_flight, live, fresh, round(in_flight * cached))]
        elif hi < self.n:
            # GPipe: outputs wait for the next stage; those in the graph's output for the merge
            outputs = min(1.0, in_flight - 1) if self.merges else 0.0
            merged = round(max(0.0, in_flight - 1 - outputs) * self.merged(lo, hi)) if self.merges else 0
            forward = [self._forward_peak(in_flight, live, static, round(outputs * live.leaving) + merged)]
        else:
            forward, loss_backward = self._last_peaks(lo, in_flight, live, static)
            if loss_backward is not None:  # it begins the stage's backward: what waits then waits with it
                backward.append(loss_backward.waiting(max((w for _, w in waiting[1]), default=0)))
        # the optimizer's step: the stage's state, the step's temporaries (the last: the batch)
        step = [StagePeak(static, 0, self.step(lo, hi), self._last_batch if hi == self.n else 0)]
        if self.replicas > 1:  # before it, the gradients' reduction over the replicas: a bucket copied flat
            step.append(StagePeak(static, 0, min(self._step_grads(lo, hi), GRADIENT_BUCKET_BYTES), 0))
        return max([p.waiting(waiting[0]) for p in forward] + backward + step, key=lambda p: p.total)

    def backward_peak_runs(self, lo: int, hi: int, policies: Mapping[int, Policy]) -> list[int]:
        """The nodes of ``[lo, hi)`` in the runs of one policy (kept runs aside) holding a node
        at whose backward one micro-batch's backward peaks (with every parameter gradient made,
        or with those made so far: what :meth:`peak` prices), or the node before it (a
        region's stash comes back at its last node's backward), in node order."""
        layout = _Layout.one(lo, hi, policy_codes(policies, self.n))
        codes, runs = layout.code, _runs(self._arrays, layout)
        found = {int(at - lo) for peak in self.live(lo, hi, policies).peaks_at for at in (peak, peak - 1)}
        chosen = {int(runs.of[k]) for k in found if 0 <= k < hi - lo and codes[k]}
        return [lo + k for run in sorted(chosen) for k in range(int(runs.starts[run]), int(runs.stops[run]))]

    def merged(self, lo: int, hi: int) -> int:
        """Bytes of one micro-batch's values nodes ``[lo, hi)`` make that are part of the
        graph's output: GPipe's merge reads them once every micro-batch's forward is done."""
        return self._to_output[hi] - self._to_output[lo]

    def _forward_peak(self, in_flight: float, live: "LiveBytes", static: int, boundary: int) -> StagePeak:
        """The peak of the forward of the last micro-batch in flight."""
        others = round((in_flight - 1) * live.stashed)
        return StagePeak(static, others + live.forward[0], live.forward[1], boundary)

    def _backward_peaks(
        self,
        lo: int,
        hi: int,
        in_flight: float,
        live: "LiveBytes",
        static: int,
        states: Sequence[tuple[float, int]],
        cached: int = 0,
    ) -> list[StagePeak]:
        """The peaks of a step's backwards: the first with the micro-batches in flight stashed
        and the gradients of the parameters made as it goes (they were freed for it), the
        later ones with all of them. ``states``: at each backward, the micro-batches held and
        the bytes of gradients waiting (:meth:`waiting`); without them (a search pricing a
        range), the first holds ``in_flight`` and the later ones one fewer, unless the
        schedule runs another forward before each (1F1B and 2BW with more micro-batches).
        ``cached``: bytes of one micro-batch's outputs kept until its backward is done."""
        gradient = self._last_backward(lo, in_flight) if hi == self.n else 0
        grads = self._step_grads(lo, hi)
        if not states:
            later = in_flight if not self.merges and self.chunks > in_flight else in_flight - 1
            states = [(in_flight, 0)] + ([(later, 0)] if later >= 1 else [])
        first_stash, first_rest = live.first_backward
        peaks = []
        for j, (held, waiting) in enumerate(states):
            others = round((held - 1) * live.stashed)
            boundary = gradient + waiting + round(held * cached)
            if j == 0:
                peaks.append(StagePeak(static - grads, others + first_stash, first_rest, boundary))
            else:
                peaks.append(StagePeak(static, others + live.backward[0], live.backward[1], boundary))
        return peaks

    def _step_grads(self, lo: int, hi: int) -> int:
        """Bytes of the gradients a step makes on a stage of nodes ``[lo, hi)`` (freed before
        its first backward; as processes, before the step, the tied copies' too)."""
        own = self._grads[hi] - self._grads[lo]
        return own + round(self.borrowed(lo, hi) * self._grads_per_param) if self.carry else own

    def _last_peaks(
        self, lo: int, in_flight: float, live: "LiveBytes", static: int
    ) -> tuple[list[StagePeak], StagePeak | None]:
        """The last stage's forward and loss peaks: it also holds the training batch, and the
        loss made from its outputs. Under GPipe every micro-batch's outputs wait for their
        merge, and the loss is the whole batch's, its backward after the gradients of the
        parameters were freed; otherwise it is one micro-batch's, the losses of the earlier
        micro-batches are kept, and the loss's backward (returned apart) begins the stage's
        backward, when gradients waiting for earlier stages during its forwards may be gone."""
        out, p = self._final_outputs(lo), self.profile
        stashed = round(in_flight * live.stashed)
        if self.merges:  # the outputs and their merge, then the loss of the merge
            grads = self._grads[self.n] - self._grads[lo]
            return [
                self._forward_peak(in_flight, live, static, round((in_flight - 1) * live.leaving) + self.batch),
                StagePeak(static, stashed, 0, round(in_flight * max(out + live.leaving, p.loss_bytes)) + self.batch),
                StagePeak(static - grads, stashed, 0, round(in_flight * p.loss_backward_bytes) + self.batch),
            ], None
        kept = (self.chunks - 1) * p.loss_kept_bytes + self._last_batch  # the earlier losses and the batch
        return [
            self._forward_peak(in_flight, live, static, kept),
            StagePeak(static, stashed, 0, live.leaving + kept + p.loss_bytes),
        ], StagePeak(static, stashed, 0, live.leaving + kept + p.loss_backward_bytes)

    def _last_backward(self, lo: int, in_flight: float) -> int:
        """What the last stage holds besides its own during its backward: the batch, the
        gradient of the outputs the loss reads and the losses; one micro-batch's output too
        when the loss's graph keeps it (per micro-batch, the loss reads the output itself). Under GPipe no
        loss: Lightning backs ``loss / accumulate_grad_batches``, a new scalar, and drops the
        returned loss (with ``F.mse_loss``, a view of every unreduced value) before it."""
        out, p = self._final_outputs(lo), self.profile
        if self.merges:
            return self.batch + round(in_flight * out)
        grads = out if p.loss_grad_bytes is None else min(out, p.loss_grad_bytes)  # of the outputs the loss reads
        return self._last_batch + out + grads + self.chunks * p.loss_kept_bytes

    def _final_outputs(self, lo: int) -> int:
        return self._to_graph_output[self.n] - self._to_graph_output[lo]

    def range_gradients(self, lo: int, hi: int) -> _Array:
        """:func:`_gradients` of ``[lo, hi)``, kept for the last range asked: a stage's
        optimisation prices one range hundreds of times, and they do not depend on policies."""
        if self._range_gradients[0] != (lo, hi):
            self._range_gradients = (lo, hi), _gradients(self._arrays, lo, hi)
        return self._range_gradients[1]

    def live(self, lo: int, hi: int, policies: Mapping[int, Policy]) -> "LiveBytes":
        """One micro-batch's live bytes through the forward and backward of nodes ``[lo, hi)``
        (cached)."""
        if policies.codes[lo:hi].any() if isinstance(policies, CodedPolicies) else any(lo <= i < hi for i in policies):
            return self._lives(lo, hi, [CodedPolicies.of(policies, self.n)])[0]
        if (lo, hi) not in self._kept:
            self._kept[lo, hi] = _live(self, lo, hi, None)[0]
        return self._kept[lo, hi]

    def _lives(self, lo: int, hi: int, variants: Sequence["CodedPolicies"]) -> list["LiveBytes"]:
        """:meth:`_live` under each of ``variants`` (cached), those not priced yet at once."""
        if (len(self._priced) + len(variants)) * self.n > _PRICED_BYTES:
            self._priced.clear()
        keys = [(lo, hi, v.codes.tobytes()) for v in variants]
        new = {key: v.codes for key, v in zip(keys, variants) if key not in self._priced}
        batch = list(new.items())
        rows = max(1, _BATCH_POSITIONS // (hi - lo))
        for k in range(0, len(batch), rows):
            part = batch[k : k + rows]
            self._priced.update(zip((key for key, _ in part), _live(self, lo, hi, np.stack([c for _, c in part]))))
        return [self._priced[key] for key in keys]


def backward_waiting(states: Sequence[BackwardState], sent: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Per backward of a stage, the micro-batches it holds and the bytes waiting at it, given
    ``(p, bytes)`` of one micro-batch's gradients it makes for each earlier stage ``p``: the
    first backward, then the later ones without repeats (only their largest peak counts)."""
    priced = [(state.held, sum(b * state.waits[p] for p, b in sent)) for state in states]
    return tuple(priced[:1]) + tuple(sorted(set(priced[1:])))


@dataclass
class LiveBytes:
    """One micro-batch on a stage: its stash, the values still to be read after its forward,
    and the most bytes alive in its forward and in its backward (each as stash, other)."""

    stashed: int
    leaving: int
    forward: tuple[int, int]
    backward: tuple[int, int]  # with every parameter gradient made earlier (counted as static)
    first_backward: tuple[int, int]  # with the parameter gradients of the nodes done so far
    peaks_at: tuple[int, int] = (0, 0)  # the nodes whose backwards reach the two above


class _NodeArrays:
    """The profile's per-node bytes as arrays, and its dataflow edges by consumer."""

    def __init__(self, profile: Profile) -> None:
        nodes = profile.nodes

        def array(values: Sequence[int]) -> _Array:
            return np.asarray(values, dtype=np.int64)

        self.saved = array([n.saved_bytes for n in nodes])
        self.saved_inputs = array([n.saved_inputs_bytes for n in nodes])
        self.saved_inputs_from = array([n.saved_inputs_from for n in nodes])
        self.made = array([n.made_bytes for n in nodes])
        self.held = array([n.held_bytes for n in nodes])
        self.held_until = array([max(k, n.held_until) for k, n in enumerate(nodes)])
        self.held_by = array([n.held_by for n in nodes])
        self.held_end = np.where(self.held_by >= 0, np.maximum(self.held_by, np.arange(len(nodes))), self.held_until)
        # the part of a node's output it keeps itself, and the last node reading its output
        self.own_output = array([max(0, min(n.output_bytes, n.made_bytes) - n.held_bytes) for n in nodes])
        self.last_reader = array([max([k, *(u if u >= 0 else len(nodes) for u in n.users)])
                                  for k, n in enumerate(nodes)])
        self.workspace = array([n.transient_bytes for n in nodes])
        self.backward = array([max(n.backward_bytes - n.grad_bytes, 0) for n in nodes])
        self.grads = array([n.grad_bytes for n in nodes])
        self.last_saver = array([max(k, n.last_saver) for k, n in enumerate(nodes)])
        self.output = array([n.output_bytes for n in nodes])
        # the node whose storage a node's value lives on: itself, or for a view its largest input's
        base = list(range(len(nodes)))
        reads = sorted((u, j) for j, n in enumerate(nodes) for u in set(n.users) if u >= 0)
        producers: list[list[int]] = [[] for _ in nodes]
        for u, j in reads:
            producers[u].append(j)
        for j, n in enumerate(nodes):
            if n.made_bytes == 0 and n.output_bytes and producers[j]:
                base[j] = base[max(producers[j], key=lambda i: nodes[i].output_bytes)]
        # every read (reader, node read, that node's storage), by reader
        self.reader = array([u for u, _ in reads])
        self.read = array([j for _, j in reads])
        self.read_base = array([base[j] for _, j in reads])
        # a reader whose value takes no gradient (a shape) gives its inputs none
        edges = sorted((u, j) for j, n in enumerate(nodes) for u in n.users if u >= 0 and nodes[u].output_grad_bytes)
        self.consumer = array([u for u, _ in edges])
        self.producer = array([j for _, j in edges])
        self.gradient = array([_edge_gradient(nodes, u, j) for u, j in edges])
        self.forwarded = np.asarray([j in nodes[u].forwarded_grads for u, j in edges], dtype=bool)
        self.first_reader = array([min((u for u in n.users if u >= 0), default=len(nodes)) for n in nodes])
        # (not counting the graph's output, gathered in a container: its values take no gradient)
        summing = [(u, j, f or nodes[u].made_bytes == 0) for (u, j), f in zip(edges, self.forwarded)
                   if nodes[u].made_bytes or any(x >= 0 for x in nodes[u].users)]
        summed = _summed_with(summing, edges)
        self.summed_at, self.summed_with = array([x for x, _ in summed]), array([y for _, y in summed])
        # per node, the gradients its backward hands the values it reads
        self.handed = np.bincount(self.consumer, weights=self.gradient, minlength=len(nodes)).astype(np.int64)


# The policy codes a cost model keeps as keys of what it priced, at most (then it starts over).
_PRICED_BYTES = 1 << 26
# The most node positions priced in one pass (:class:`_Layout`): past some 16k, arrays outgrow
# the CPU's caches and a row costs more.
_BATCH_POSITIONS = 1 << 14


def _summed_with(
    summing: Sequence[tuple[int, int, bool]], edges: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Per edge ``(reader, read)``, the value whose gradient the reader's adds to, and its last
    other reader (-1: none): ``read``, or where ``read`` has no other reader and hands its own
    gradient on as it is (a view's, an ``Identity``'s, which makes nothing), the value it hands
    it to. ``summing``: the edges whose reader hands a gradient on, with whether it hands it
    as it is."""
    readers: dict[int, list[int]] = {}
    onward: dict[int, list[int]] = {}
    for u, j, as_is in summing:
        readers.setdefault(j, []).append(u)
        if as_is:
            onward.setdefault(u, []).append(j)
    found = []
    for u, j in edges:
        while not (others := [r for r in readers.get(j, ()) if r != u]) and len(onward.get(j, ())) == 1:
            u, j = j, onward[j][0]
        found.append((j, max(others, default=-1)))
    return found


def _edge_gradient(nodes: Sequence[NodeProfile], reader: int, read: int) -> int:
    """Bytes of the gradient node ``reader``'s backward hands node ``read``. Handed over on
    its output gradient's storage (``add``: that tensor itself; ``cat``: slices of it), to
    several values, it is one storage, alive whole until the earliest of them takes it."""
    forwarded = nodes[reader].forwarded_grads
    if read not in forwarded:
        return nodes[read].output_grad_bytes
    if read != forwarded[0]:
        return 0
    return max(nodes[read].output_grad_bytes, nodes[reader].input_grad_bytes)


class _Layout:
    """Rows of policies for one stage ``[lo, hi)``, priced at once: laid end to end, position
    ``p`` is node ``lo + p % size`` of row ``p // size``. A search prices hundreds of variants
    of one stage's policies; one vectorised pass over many costs about what a pass over one
    does, which is mostly NumPy's per-call overhead."""

    def __init__(self, lo: int, hi: int, codes: _Codes2) -> None:
        self.lo, self.hi, self.size = lo, hi, hi - lo
        self.codes = codes  # (rows, every node): a row's policies, other stages' too
        self.rows = codes.shape[0]
        self.row, local = np.divmod(np.arange(self.rows * self.size), self.size)
        self.node = local + lo
        self.code = codes[:, lo:hi].ravel()
        self._reads: tuple[_Array, _Array, _Array] | None = None

    @classmethod
    def one(cls, lo: int, hi: int, codes: Codes) -> "_Layout":
        return cls(lo, hi, codes[None])

    def reads(self, a: _NodeArrays) -> tuple[_Array, _Array, _Array]:
        """Every read by a node of the stage, in each row, in position order: the reader's
        position, the node read and that node's storage (:attr:`_NodeArrays.read_base`;
        kept: the regions' pricing asks twice)."""
        if self._reads is None:
            begin, end = np.searchsorted(a.reader, [self.lo, self.hi])
            shift = (np.arange(self.rows) * self.size)[:, None]
            reader = (a.reader[begin:end] - self.lo + shift).ravel()
            self._reads = reader, np.tile(a.read[begin:end], self.rows), np.tile(a.read_base[begin:end], self.rows)
        return self._reads

    def regions(self, starts: _Array, stops: _Array) -> tuple[_Array, _Array]:
        """Per position, the index of the last of the regions ``[starts[k], stops[k])`` (in
        order) starting at or before it (-1: none), and whether it lies in that region."""
        at = np.full(self.code.size, -1)
        at[starts[0] :] = np.repeat(np.arange(starts.size), np.diff(np.append(starts, self.code.size)))
        return at, (at >= 0) & (np.arange(at.size) < stops[at])


def _live(model: CostModel, lo: int, hi: int, codes: "_Codes2 | None") -> list[LiveBytes]:
    """See :meth:`CostModel.live`, for each row of ``codes`` (every node's policy,
    :func:`_policy_codes`; ``None``: one row, all kept). Within a row, a swapped or recomputed
    run drops the stash it alone keeps, a recomputed region keeps its inputs instead, and both
    bring their stash back for their backward (:func:`_drop_stashes`)."""
    a = model._arrays
    layout = _Layout(lo, hi, np.zeros((1, model.n), dtype=np.int8) if codes is None else codes)
    rows, size, node = layout.rows, layout.size, layout.node
    stash = a.saved[node]
    back = np.zeros(stash.size, dtype=np.int64)
    stashed = _NO_REGION_INPUTS
    runs = None
    if codes is not None:
        runs = _runs(a, layout)
        if layout.code.any():
            stashed = _drop_stashes(model, layout, runs, stash, back)
    kept = np.zeros((rows, size + 1), dtype=np.int64)
    np.cumsum(stash.reshape(rows, size), axis=1, out=kept[:, 1:])
    # values a node makes and does not keep itself stay alive after it until kept, or read
    end = _held_end(a, layout, runs, stashed)
    held = np.zeros((rows, size + 1), dtype=np.int64)
    first = node - lo + 1 + layout.row * (size + 1)
    leaving = np.zeros(rows, dtype=np.int64)
    for values, until in [(a.held[node], end), *_dropped_outputs(a, layout, runs)]:
        np.add.at(held.ravel(), first, values)
        np.add.at(held.ravel(), np.maximum(first, first + np.minimum(until, hi - 1) - node), -values)
        np.add.at(leaving, layout.row, np.where(until >= hi, values, 0))
    held = np.cumsum(held, axis=1)[:, :size]
    # each node's forward, and the end of the stage's: its whole stash and what leaves it (a
    # node saving an input an earlier stage made takes it on only as it runs)
    ends = (kept[:, -1] + leaving)[:, None]
    forward = np.concatenate((kept[:, :-1] + held + a.made[lo:hi] + a.workspace[lo:hi], ends), axis=1)
    common = kept[:, 1:] + model.range_gradients(lo, hi) + a.backward[lo:hi] + back.reshape(rows, size)
    # a fresh gradient of the node's parameters, to add to theirs; under the local GPipe, whose
    # one backward sums the micro-batches' gradients before the parameter takes them, a new
    # tensor, their sum: made once the node's backward has returned, its workspace freed, with
    # what it hands its inputs and the two summed alive
    grads = a.grads[lo:hi]
    backward = common + grads
    if model.merges and model.chunks > 1 and not model.carry:
        backward += np.maximum(0, grads - np.maximum(0, a.backward[lo:hi] - a.handed[lo:hi]))
    first_backward = common + np.cumsum(grads[::-1])[::-1]  # the parameter gradients made so far
    f, b, g = (np.argmax(x, axis=1) for x in (forward, backward, first_backward))
    at = np.arange(rows)
    columns = zip(*(x.tolist() for x in (
        kept[:, -1], leaving, kept[at, f], forward[at, f] - kept[at, f], kept[at, b + 1],
        backward[at, b] - kept[at, b + 1], kept[at, g + 1], first_backward[at, g] - kept[at, g + 1], b, g)))
    return [LiveBytes(stashed=s, leaving=out, forward=(fs, fr), backward=(bs, br), first_backward=(gs, gr),
                  peaks_at=(lo + bk, lo + gk))
            for s, out, fs, fr, bs, br, gs, gr, bk, gk in columns]


def _drop_stashes(
    model: CostModel, layout: _Layout, runs: "_Runs", stash: _Array, back: _Array
) -> tuple[_Array, _Array]:
    """Take off ``stash`` (per position of ``layout``) what each swapped or recomputed run
    drops, give a recomputed region its inputs, and add to ``back`` the bytes brought back
    during each node's backward. A run drops the stash its nodes alone keep (a swapped run
    keeps on the device what it saves of values made before it); the stash comes back whole
    (a swapped run's once the backward of the segment after it begins, a recomputed one's at
    its own last node) and leaves again as each node's backward takes its part. All runs
    (``runs``) are priced at once: a stage may have hundreds. Returns the positions of the
    storages the recomputed regions keep as inputs and the first node of the region keeping
    each (:func:`_regions_inputs`)."""
    a = model._arrays
    code, node = layout.code, layout.node
    starts, segment = runs.starts, runs.of
    start, stop = node[starts][segment], runs.stop_nodes(layout)[segment]
    saver = a.last_saver[node]
    freed = np.where(runs.drops, a.saved[node], 0)
    inputs_from = a.saved_inputs_from[node]
    before = (inputs_from >= 0) & (inputs_from < start)  # saves inputs made before its segment
    freed = np.maximum(0, freed - np.where((code == 2) & before, a.saved_inputs[node], 0))
    stash -= freed
    # a recomputed node's stash a kept node after its region saves too: that one keeps it, only
    # until its own backward; the region makes its own again
    rebuilt = freed.copy()
    shared = np.flatnonzero((code == 1) & (saver >= stop) & (saver < layout.hi))
    keeper = shared + saver[shared] - node[shared]  # its position, in the row
    shared, keeper = shared[code[keeper] == 0], keeper[code[keeper] == 0]
    rebuilt[shared] = a.saved[node[shared]]
    # what comes back: a recomputed region's inputs stay (the region keeps them), not made again
    made_again = np.maximum(0, rebuilt - np.where((code == 1) & before, a.saved_inputs[node], 0))
    if shared.size:
        gone = np.zeros(node.size + 1, dtype=np.int64)
        np.add.at(gone, shared, made_again[shared])
        np.add.at(gone, keeper, -made_again[shared])
        back -= np.cumsum(gone)[:-1]
    total = np.cumsum(made_again)
    back += total - np.concatenate(([0], total))[starts][segment]
    kind = code[starts]
    dropped = np.add.reduceat(freed, starts)
    after = np.zeros(starts.size, dtype=np.int64)  # a swapped run's stash, back for the segment after it (its row's)
    swapped = np.flatnonzero((kind[:-1] == 2) & (starts[1:] % layout.size != 0))
    after[swapped + 1] = dropped[swapped]
    back += after[segment]
    first, last = _recomputed_regions(a, layout, runs)
    if not first.size:
        return _NO_REGION_INPUTS
    regions = layout.regions(first, last)
    back[last - 1] += _recomputing(a, layout, first, last, regions, made_again)
    totals, storages, since = _regions_inputs(model, layout, first, last, regions)
    stash[first] += totals
    return storages, since


@dataclass
class _Runs:
    """Maximal runs of one policy over a layout's positions (kept ones too; a row starts a
    run): their starts and stops, the run of each position, and whether its node's stash
    goes with its run (swapped or recomputed, and no node after the run saves it too)."""

    starts: _Array
    stops: _Array
    of: _Array
    drops: _Array

    def stop_nodes(self, layout: _Layout) -> _Array:
        """Per run, the node after its last."""
        return layout.node[self.stops - 1] + 1


def _runs(a: _NodeArrays, layout: _Layout) -> _Runs:
    code, node = layout.code, layout.node
    new = np.ones(code.size, dtype=bool)
    new[1:] = code[1:] != code[:-1]
    new[:: layout.size] = True
    starts = np.flatnonzero(new)
    stops, of = np.append(starts[1:], code.size), np.cumsum(new) - 1
    drops = (code != 0) & (a.last_saver[node] < node[stops - 1][of] + 1)
    return _Runs(starts, stops, of, drops)


def _recomputing(
    a: _NodeArrays, layout: _Layout, starts: _Array, stops: _Array, regions: tuple[_Array, _Array],
    made_again: _Array,
) -> _Array:
    """Per recomputed region (positions ``[starts[k], stops[k])`` of ``layout``; ``regions``:
    their :meth:`_Layout.regions`), what its forward run again, before its last node's backward,
    holds beyond what that backward is priced at (its stash back whole, its workspace and
    fresh parameter gradients): at each node the stash made again so far, the values of
    earlier nodes of the region still to be read in it (or returned, read after it), and what
    the node makes and its workspace (an attention's scores, read and freed in the region)."""
    node = layout.node
    at, region = regions
    position = np.arange(node.size)
    rebuilt = np.concatenate(([0], np.cumsum(made_again)))
    k = np.flatnonzero(region)
    # run again, a value lives until its last reader in the region, or the node saving it
    last = position.copy()
    reader, read, _ = layout.reads(a)
    read = np.where(read >= layout.lo, reader - node[reader] + read, -1)  # its position, if in the stage
    same = (read >= 0) & region[np.maximum(read, 0)] & (at[np.maximum(read, 0)] == at[reader]) & region[reader]
    np.maximum.at(last, read[same], reader[same])
    # one the run returns (read after it) lives until the run stops: at its last node saving
    # something, once every saved tensor is made again (the checkpoint's early stop)
    final = node[stops - 1]  # whose backward the region is run again for
    returned = k[a.held_until[node[k]] > final[at[k]]]
    if returned.size:
        saving = np.maximum.reduceat(np.where(a.saved[node[k]] > 0, k, -1), np.searchsorted(k, starts))
        last[returned] = np.maximum(last[returned], saving[at[returned]])
    saver = k + a.held_by[node[k]] - node[k]  # the position of the node keeping it (of its row)
    ends = np.where((saver > k) & (saver < stops[at[k]]), saver, last[k])
    held = np.zeros(node.size + 1, dtype=np.int64)
    alive = ends > k
    np.add.at(held, k[alive] + 1, a.held[node[k[alive]]])
    np.add.at(held, ends[alive] + 1, -a.held[node[k[alive]]])
    running = np.where(region, rebuilt[:-1] - rebuilt[starts[np.maximum(at, 0)]] + np.cumsum(held)[:-1]
                       + a.made[node] + a.workspace[node], 0)
    peak = np.maximum.reduceat(running, starts)
    priced = rebuilt[stops] - rebuilt[starts] + a.backward[final] + a.grads[final]
    extra: _Array = np.maximum(0, peak - priced)
    return extra


def _recomputed_regions(a: _NodeArrays, layout: _Layout, runs: _Runs) -> tuple[_Array, _Array]:
    """Start and stop positions of each recomputed region of ``layout`` that saves something."""
    region = (layout.code[runs.starts] == 1) & (np.add.reduceat(a.saved[layout.node], runs.starts) > 0)
    return runs.starts[region], runs.stops[region]


def _regions_inputs(
    model: CostModel, layout: _Layout, starts: _Array, stops: _Array, regions: tuple[_Array, _Array] | None = None
) -> tuple[_Array, _Array, _Array]:
    """Per recomputed region (positions ``[starts[k], stops[k])`` of ``layout``, in order,
    each saving something; ``regions``: their :meth:`_Layout.regions`), what it keeps: the
    storages of the values it reads from outside itself that no other node keeps as long (see
    :meth:`CostModel.region_inputs`). A storage counts at the first region of its row reading
    it; the graph input never (a micro-batch is a view of the training batch, which the last
    stage holds). Also the positions of the
    storages the stage makes that the regions keep of the values their makers hold, and the
    first node of the region keeping each: from there on they are its stash, no longer held."""
    a, lo, hi = model._arrays, layout.lo, layout.hi
    totals = np.zeros(starts.size, dtype=np.int64)
    reader, read, storage = layout.reads(a)
    at, inside = layout.regions(starts, stops) if regions is None else regions
    region = at[reader]
    start, stop = layout.node[starts], layout.node[stops - 1] + 1
    outside = inside[reader] & (read < start[region])
    row = layout.row[reader[outside]]
    _, first = np.unique(row * model.n + storage[outside], return_index=True)  # reads are in position order
    q, row, region = storage[outside][first], row[first], region[outside][first]
    start, stop = start[region], stop[region]
    keeper = a.held_by[q]
    known = keeper >= 0
    keeper_code = np.where(known, layout.codes[row, keeper], 0)
    keeper_stash = np.where(known, a.last_saver[keeper], -1)
    kept_anyway = np.where(
        ~known | (keeper >= hi), False,  # the region keeps it first
        np.where(
            keeper < lo, (keeper_code == 0) | (keeper_stash >= lo),  # an earlier stage keeps it, unless it drops it
            np.where((start <= keeper) & (keeper < stop), keeper_stash >= stop,  # a later node of the region does
                     keeper_code == 0),  # a kept node of the stage does
        ),
    )
    kept = np.where(kept_anyway, 0, a.held[q])
    dropped = (layout.codes[row, q] != 0) & (a.last_saver[q] < stop)  # its own output, dropped with its stash
    np.add.at(totals, region, kept + np.where(dropped, np.minimum(a.made[q] - a.held[q], a.output[q]), 0))
    ours = (kept > 0) & (q >= lo) & (q < hi)
    return totals, row[ours] * layout.size + q[ours] - lo, start[ours]


_NO_REGION_INPUTS: tuple[_Array, _Array] = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def _held_end(
    a: _NodeArrays, layout: _Layout, runs: _Runs | None, stashed: tuple[_Array, _Array] = _NO_REGION_INPUTS
) -> _Array:
    """Per position of ``layout``, the last node before which what its node holds is kept or
    freed: the node keeping it first, unless that one's stash is recomputed or swapped and so
    dropped (a node of the stage drops it only if no later node of its run keeps it on);
    then the last node reading it, or the first of a recomputed region keeping it as an input
    (``stashed``: positions of storages and those nodes, from :func:`_regions_inputs`). A
    stage runs each run of one policy (``runs``; ``None``: all kept) as one call, which holds
    its arguments until it returns: a value read by a later run lives until that run's last
    node."""
    node, hi = layout.node, layout.hi
    end: _Array = a.held_end[node]
    if runs is None:
        return end
    by = a.held_by[node]
    dropped = (by >= 0) & (layout.codes[layout.row, by] != 0)
    inside = np.flatnonzero(dropped & (by < hi))
    keeper = inside + by[inside] - node[inside]  # its position, in the row
    dropped[inside] = runs.drops[keeper]
    end = np.where(dropped, a.held_until[node], end)
    end = _until_run_returns(layout, runs, end, ((by < 0) | dropped) & (end < hi))  # freed once read, not stashed
    storages, since = stashed
    np.minimum.at(end, storages, since)
    return end


def _until_run_returns(layout: _Layout, runs: _Runs, end: _Array, read: _Array) -> _Array:
    """``end`` (per position, the last node reading its node's value) where the value is
    ``read`` by a later run of the stage: that run's last node (a run is one call, holding its
    arguments until it returns)."""
    node, hi = layout.node, layout.hi
    run = runs.of[np.arange(node.size) + np.minimum(end, hi - 1) - node]
    return np.where(read & (run != runs.of), node[runs.stops[run] - 1], end)


def _dropped_outputs(a: _NodeArrays, layout: _Layout, runs: "_Runs | None") -> list[tuple[_Array, _Array]]:
    """The outputs recomputed or swapped nodes keep themselves (a ReLU's) and drop with their
    stash, per position, and the node until which each lives in the forward: its last reader
    (none, or one entry: ``(bytes, end)``)."""
    if runs is None or not layout.code.any():
        return []
    node = layout.node
    own = np.where(runs.drops, a.own_output[node], 0)
    if not own.any():
        return []
    end = a.last_reader[node]
    return [(own, _until_run_returns(layout, runs, end, end < layout.hi))]


def _gradients(a: _NodeArrays, lo: int, hi: int) -> _Array:
    """Per node of ``[lo, hi)``, bytes of the gradients the range's later nodes made for values
    made up to it that are still to be taken when its backward runs (by it or an earlier node).
    One a node hands on the gradient of its output (an ``add``'s, slices of a ``cat``'s) that
    only later stages read is the storage that came from them, held where it arrived (see
    :meth:`CostModel.waiting`), not here; unless the value it goes to is made here and read on
    a later stage as well (:func:`_summed_with`): autograd adds the two into a new tensor here,
    held until the value's maker takes it."""
    edges = np.arange(*np.searchsorted(a.consumer, [lo, hi]))
    later = a.forwarded[edges] & (a.first_reader[a.consumer[edges]] >= hi)
    summed_here = (a.summed_at[edges] >= lo) & (a.summed_with[edges] >= hi)
    edges = edges[~(later & ~summed_here)]
    producers, consumers = a.producer[edges], a.consumer[edges]
    live = np.zeros(hi - lo + 1, dtype=np.int64)
    if producers.size:
        unique, index = np.unique(producers, return_inverse=True)
        latest = np.zeros(unique.size, dtype=np.int64)
        np.maximum.at(latest, index, consumers)
        gradient = np.zeros(unique.size, dtype=np.int64)
        np.maximum.at(gradient, index, a.gradient[edges])
        begin = np.maximum(unique, lo) - lo  # from the producer (or the stage start) ...
        np.add.at(live, begin, gradient)
        np.add.at(live, latest - lo, -gradient)  # ... to before its last reader in the range
    return np.cumsum(live)[:-1]


def _pooled_times(profile: Profile) -> tuple[list[float], list[float]]:
    """Forward and backward milliseconds per node, each the median over the nodes doing the
    same work: names equal but for their numbers (``blocks_3_ln1``, ``blocks_5_ln2``; ``add_7``)
    and the same byte counts, i.e. the same operation on the same shapes. Repeated blocks then
    cost exactly the same, so splits that differ only in which copy they cut tie exactly rather
    than by timing noise, and a pooled time is less noisy than one measurement."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, n in enumerate(profile.nodes):
        work = (
            re.sub(r"\d+", "#", n.name), n.output_bytes, n.saved_bytes, n.transient_bytes, n.param_bytes,
            n.backward_bytes, n.output_grad_bytes,
        )
        groups.setdefault(work, []).append(i)
    forward = [0.0] * len(profile.nodes)
    backward = [0.0] * len(profile.nodes)
    for members in groups.values():
        f = _on_grid(statistics.median(profile.nodes[i].forward_ms for i in members))
        b = _on_grid(statistics.median(profile.nodes[i].backward_ms for i in members))
        for i in members:
            forward[i], backward[i] = f, b
    return forward, backward


# Times are multiples of 2**-20 ms (about 1 ns), so that sums of them (stage times, simulated
# steps) are exact in floating point: equal work adds up to exactly equal times, whatever the
# profile's scale, and a tie between splits stays a tie instead of going by rounding.
_TICK = 2.0**-20


def _on_grid(ms: float) -> float:
    return round(ms / _TICK) * _TICK


def _range_max(table: list[list[int]], lo: int, hi: int) -> int:
    """The largest value of ``[lo, hi)`` in a :func:`_sparse_max` table."""
    level = (hi - lo).bit_length() - 1
    return max(table[level][lo], table[level][hi - (1 << level)])


def _sparse_max(values: Sequence[int]) -> list[list[int]]:
    """Sparse table: level k holds the max of every window of 2**k values (O(1) range max)."""
    levels = [np.asarray(values, dtype=np.int64)]
    while 2 ** len(levels) <= len(values):
        prev, half = levels[-1], 2 ** (len(levels) - 1)
        levels.append(np.maximum(prev[:-half], prev[half:]))
    return [level.tolist() for level in levels]
