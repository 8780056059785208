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
long skip's values under GPipe) is known once a split is (:meth:`CostModel.waiting`). Under a
split backward (the zero-bubble and V-shape schedules) a micro-batch between its input and
weight halves keeps besides its stash the gradients at its weighted nodes' outputs
(:meth:`CostModel.weight_grads`), at each backward as many as the schedule's order has
pending then (:func:`~lightning_pipe.plan.schedule.weights_pending`).

Per node, a policy says where its saved bytes live between forward and backward: ``keep``
(on the device), ``swap`` (in host memory: no device bytes while in flight, brought back when
the backward of what follows it begins) or ``recompute`` (dropped; a maximal run of recomputed
nodes, a *region*, stashes only its inputs and rebuilds its stash before its backward).

This module composes a stage's peak from its terms; the terms of one micro-batch live apart:
its live bytes in :mod:`~lightning_pipe.plan.activations`, recomputed regions in
:mod:`~lightning_pipe.plan.recompute`, value lifetimes under policies in
:mod:`~lightning_pipe.plan.layout`, the profile as arrays in :mod:`~lightning_pipe.plan.nodes`
and node times in :mod:`~lightning_pipe.plan.times`. :class:`CostModel` holds prefix sums over
the profile so that a planner can price contiguous node ranges fast; one range's live bytes
are computed once (vectorised) and cached, under policies by only the policies they read
(:meth:`CostModel.policy_key`). Given the ``link_bandwidth`` between stage
devices, it also prices what a stage sends to the next (:meth:`CostModel.send_ms`).
"""

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import numpy as np

from lightning_pipe.plan.activations import LiveBytes, backward_gradients, kept_live_bytes, live_bytes
from lightning_pipe.plan.layout import NO_REGION_INPUTS, CodeRows, Layout, held_end, policy_runs
from lightning_pipe.plan.nodes import Array, NodeArrays
from lightning_pipe.plan.policy import CodedPolicies, Policy, policy_codes
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.recompute import recomputed_regions, regions_inputs
from lightning_pipe.plan.schedule import GRADIENT_BUCKET_BYTES, BackwardState, Pending, Schedule, TaskKind
from lightning_pipe.plan.times import WORK_BYTES, pooled_times

if TYPE_CHECKING:
    from lightning_pipe.plan.sharding import Sharding

__all__ = ["CostModel", "StagePeak", "predict_peaks", "stage_ranges"]

# bytes waiting at a stage while it runs forwards; at each of its backwards, (held, waiting)
Waiting: TypeAlias = tuple[int, Sequence[tuple[float, int]]]
# a candidate peak as :class:`StagePeak`'s fields, (static, activations, transient, boundary): a
# stage's peak is the highest of some five, made a StagePeak once known (a search composes thousands)
_Parts: TypeAlias = tuple[int, int, int, int]


@dataclass(slots=True)
class StagePeak:
    """A stage's predicted peak, split by kind (bytes)."""

    static: int
    activations: int
    transient: int
    boundary: int

    @property
    def total(self) -> int:
        return self.static + self.activations + self.transient + self.boundary


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
    return list(itertools.accumulate(values, initial=0))


class CostModel:
    """A profile's per-node costs, indexed for pricing node ranges ``[lo, hi)`` fast."""

    def __init__(
        self, profile: Profile, link_bandwidth: float | None = None, *, schedule: Schedule = "1f1b", chunks: int = 1,
        carry: int = 0, replicas: int = 1, sharding: "Sharding | None" = None,
    ) -> None:
        nodes = profile.nodes
        self.profile = profile
        self.carry = carry  # micro-batches whose carried values a stage holds (see carried, static)
        self.replicas = replicas  # data-parallel copies of each stage, which reduce its gradients
        self.sharding = sharding  # FSDP over the replicas (None: each holds a whole copy)
        self.link_bandwidth = link_bandwidth  # bytes per second between stage devices
        self.n = len(nodes)
        # GPipe: a stage's outputs wait for the next stage, the last stage's for the merge
        # (stages as processes run a loss and a backward per micro-batch, as 1F1B does).
        self.merges = schedule == "gpipe" and not carry
        self.chunks = chunks
        self.batch = chunks * (profile.batch_bytes or profile.input_bytes)  # the training batch
        # on the last stage's device; stages as processes each load it (see static)
        self._last_batch = 0 if carry else self.batch
        self._arrays = NodeArrays(profile)
        self._kept: dict[tuple[int, int], LiveBytes] = {}
        self._priced: dict[tuple[int, int, bytes], LiveBytes] = {}  # with policies; a search prices many twice
        self._borrowed: dict[tuple[int, int], int] = {}
        self._depends: dict[tuple[int, int], list[int]] = {}
        self._outsides: dict[tuple[int, int], Array] = {}
        self._received: dict[int, Array] = {}
        self._input_half: dict[tuple[int, int], int] = {}
        self._range_gradients: tuple[tuple[int, int], Array] = ((0, 0), np.zeros(0, dtype=np.int64))
        self._kept_bounds: _KeptBounds | None = None  # made when first asked (capslog's search)
        self._gradient_bytes: tuple[tuple[int, ...], list[list[int]]] = ((), [])  # the last split's
        self.forward_ms, self.backward_ms = pooled_times(profile, [self._arrays.columns[f] for f in WORK_BYTES])
        a, n, column, index = self._arrays, self.n, self._arrays.columns, np.arange(self.n)
        self.saved: list[int] = a.saved.tolist()
        self._saved_array, self._forward_array = a.saved, np.asarray(self.forward_ms, dtype=np.float64)
        self.last_saver: list[int] = column["last_saver"].tolist()
        self.output: list[int] = a.output.tolist()
        self.users = [node.users for node in nodes]
        self._params: list[int] = _prefix(column["param_bytes"].tolist())
        self._state: list[int] = _prefix((a.grads + column["optimizer_bytes"]).tolist())
        self._grads: list[int] = _prefix(a.grads.tolist())
        # gradient and optimizer-state bytes per parameter byte (tied copies have the same)
        self._state_per_param = self._state[-1] / self._params[-1] if self._params[-1] else 0.0
        self._grads_per_param = self._grads[-1] / self._params[-1] if self._params[-1] else 0.0
        self._saved: list[int] = _prefix(self.saved)
        in_output = np.zeros(n, dtype=bool)  # read by the graph's output
        in_output[a.user_of[a.user == -1]] = True
        self._to_graph_output: list[int] = _prefix(np.where(in_output, a.output, 0).tolist())
        # storages a node makes that end up in the graph's output and no later node keeps:
        # under GPipe they wait on its stage for the merge, every micro-batch's
        to_output = (column["held_until"] >= n) & (a.held_by < 0)
        self._to_output: list[int] = _prefix(np.where(to_output, a.held, 0).tolist())
        # the gradients at the outputs of the nodes reading a trainable parameter (a tied copy
        # too): a split backward's input half keeps them for its weight half (weight_grads)
        weighted = a.grads > 0
        weighted[[u for p in profile.shared for u in p.users[1:]]] = True
        self._weight_grads: list[int] = _prefix(np.where(weighted, column["output_grad_bytes"], 0).tolist())
        forward, backward = self.forward_ms, self.backward_ms
        if sharding is not None:  # a stage's all-gathers and reduce-scatters take its time, not a recompute's
            gathers, reductions = sharding.collective_ms()
            forward, backward = [f + g for f, g in zip(forward, gathers)], [b + r for b, r in zip(backward, reductions)]
        self._forward = _prefix(forward)
        self._compute = _prefix([f + b for f, b in zip(forward, backward)])
        self._transient = _RangeMax(np.maximum(a.workspace, column["backward_bytes"] - a.grads))
        self._step_sum: list[int] = _prefix(column["step_bytes"].tolist())
        self._step_max = _RangeMax(column["step_bytes"])
        self.reads_input = set(profile.input_users)
        # Values leaving a range [lo, hi): node i < hi whose last reader is at or after hi
        # (or the graph output). _leaving(hi) lists those i, descending.
        self._last_reader: list[int] = a.last_reader.tolist()  # n: the graph output; a node unread: itself
        stop = a.last_reader + 1
        span = np.maximum(0, stop - (index + 1))  # the cuts each value crosses: from after its maker to its last reader
        self._spans = span
        self._makers: tuple[Array, list[int]] | None = None  # made when first asked (_cut_makers)
        self._leaving_at: dict[int, list[int]] = {}  # made when first asked: a search asks some cuts
        # crossing[c]: bytes of the values made before node c and read from it on
        crossing = np.zeros(n + 2, dtype=np.int64)  # its changes, cut by cut
        np.add.at(crossing, index[span > 0] + 1, a.output[span > 0])
        np.add.at(crossing, stop[span > 0], -a.output[span > 0])
        self.crossing: list[int] = np.cumsum(crossing[: n + 1]).tolist()
        # per cut, of the values leaving it, latest first: their makers (negated, ascending) and
        # their bytes summed so far, so that send_ms finds what a range sends by bisection
        leaving = [self._leaving(c) for c in range(n + 1)] if link_bandwidth else []
        self._senders = [[-i for i in entry] for entry in leaving]
        self._sent = [list(itertools.accumulate(self.output[i] for i in entry)) for entry in leaving]

    def _leaving(self, cut: int) -> list[int]:
        """The nodes before ``cut`` whose values are read from it on (or by the graph output),
        latest first (cached)."""
        if (found := self._leaving_at.get(cut)) is None:
            makers, bounds = self._cut_makers()
            found = self._leaving_at[cut] = makers[bounds[cut] : bounds[cut + 1]].tolist()
        return found

    def _cut_makers(self) -> tuple[Array, list[int]]:
        """The makers of the values crossing each cut, by cut and latest first, and where each
        cut's begin: made when first asked, as only stages as processes, gradients waiting for
        earlier stages and a link between stages ask (a search of 1F1B on one device each
        does not)."""
        if self._makers is None:
            span = self._spans
            maker = np.repeat(np.arange(self.n), span)
            cut = maker + 1 + np.arange(maker.size) - np.repeat(np.cumsum(span) - span, span)
            order = np.lexsort((-maker, cut))
            self._makers = maker[order], np.searchsorted(cut[order], np.arange(self.n + 2)).tolist()
        return self._makers

    def params(self, lo: int, hi: int) -> int:
        return self._params[hi] - self._params[lo]

    def stashed(self, lo: int, hi: int) -> int:
        """Saved bytes of one micro-batch when every node is kept."""
        return self._saved[hi] - self._saved[lo]

    def compute_ms(self, lo: int, hi: int) -> float:
        """Forward plus backward time of one micro-batch."""
        return self._compute[hi] - self._compute[lo]

    @property
    def compute_prefix(self) -> list[float]:
        """Per ``i``, the forward plus backward time of nodes ``[0, i)``: :meth:`compute_ms` of
        ``[lo, hi)`` is ``compute_prefix[hi] - compute_prefix[lo]``."""
        return self._compute

    def recompute_costs(self, lo: int, hi: int) -> tuple[Array, "np.ndarray[tuple[int], np.dtype[np.float64]]", Array]:
        """The nodes of ``[lo, hi)`` that save bytes, each one's forward milliseconds per byte
        saved (what recomputing it costs per byte it frees) and its saved bytes."""
        nodes = lo + (self._saved_array[lo:hi] > 0).nonzero()[0]
        saved = self._saved_array[nodes]
        return nodes, self._forward_array[nodes] / saved, saved

    def forward_time(self, lo: int, hi: int) -> float:
        return self._forward[hi] - self._forward[lo]

    def transient(self, lo: int, hi: int) -> int:
        """Largest workspace of a node's forward or backward growth in the range."""
        return self._transient(lo, hi)

    def step(self, lo: int, hi: int) -> int:
        """What the optimizer's step holds for a while on a stage of nodes ``[lo, hi)``
        besides parameters, gradients and state: its temporaries (:attr:`NodeProfile.step_bytes`)."""
        if self.profile.step_grouped:
            return self._step_sum[hi] - self._step_sum[lo]
        return self._step_max(lo, hi)

    def boundary(self, lo: int, hi: int) -> int:
        """Bytes of one micro-batch's values nodes ``[lo, hi)`` made that later stages read
        and no node of the range keeps: alive once the range's forward is done."""
        return self.live(lo, hi, {}).leaving

    def carried(self, lo: int, hi: int) -> int:
        """Bytes of the distributed runtime's buffers a stage of nodes ``[lo, hi)`` holds per
        micro-batch, from its first step on: one for every value it receives (made before it,
        read by it or a later stage: a U-Net skip, an encoder output, the graph inputs), saved
        by one of its nodes or not (the buffer is the saved tensor: :meth:`received_kept`),
        and one for the gradient coming back of every value it sends (read after it)."""
        total = self.profile.input_bytes if lo > 0 and any(u >= lo for u in self.reads_input) else 0
        total += sum(self.output[i] for i in self._leaving(lo))
        return total + (self.input_grads(hi) if hi < self.n else 0)

    def passed_on(self, lo: int, hi: int) -> int:
        """Bytes of one micro-batch's values a stage of nodes ``[lo, hi)`` receives and sends
        on as they are: made before ``lo`` (a graph input counts, from the second stage on)
        and read from ``hi`` on. Handed to a next stage on its own process, such a value is
        the storage of the stage's own receive buffer."""
        total = self.profile.input_bytes if lo > 0 and any(u >= hi for u in self.reads_input) else 0
        return total + sum(self.output[i] for i in self._leaving(hi) if i < lo)

    def input_grads(self, lo: int) -> int:
        """Bytes of the gradients one micro-batch's backward of a stage from node ``lo`` on sends
        back (and the stage before receives): one for every value it receives (none on the first
        stage)."""
        return sum(self.profile.nodes[i].output_grad_bytes for i in self._leaving(lo)) if lo else 0

    def made_sent(self, lo: int, hi: int) -> int:
        """Bytes of one micro-batch's values nodes ``[lo, hi)`` make that a later stage reads."""
        return sum(self.output[i] for i in self._leaving(hi) if i >= lo)

    def received_kept(self, lo: int) -> Array:
        """Per node, the bytes it keeps first of values made before ``lo`` (see
        :attr:`NodeProfile.held_by`): with stages as processes they are receive buffers,
        allocated for every micro-batch once and counted by :meth:`carried`, not stashed
        again by the node that saves them (cached)."""
        if (found := self._received.get(lo)) is None:
            found = np.zeros(self.n, dtype=np.int64)
            for i in self._leaving(lo):
                if (keeper := self.profile.nodes[i].held_by) >= lo:
                    found[keeper] += self._arrays.held[i]
            self._received[lo] = found
        return found

    def send_ms(self, lo: int, hi: int) -> float:
        """Milliseconds to send one micro-batch's values leaving nodes ``[lo, hi)`` for later
        stages over the link (their gradients take as long back); 0 without a link, and for
        the last stage, whose outputs stay on its device."""
        if not self.link_bandwidth or hi == self.n:
            return 0.0
        made = bisect.bisect_right(self._senders[hi], -lo)  # how many were made from lo on
        return 1e3 * (self._sent[hi][made - 1] if made else 0) / self.link_bandwidth

    def borrowed(self, lo: int, hi: int) -> int:
        """Bytes of the parameters nodes ``[lo, hi)`` read whose first user comes earlier:
        the stage keeps a copy of each."""
        if not self.profile.shared:
            return 0
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
        stage waits for nothing, so only the values crossing a cut are visited. Kept for the
        last split asked: pricing a split asks it up to four times."""
        if self._gradient_bytes[0] == tuple(balance):
            return self._gradient_bytes[1]
        sent = [[0] * len(balance) for _ in balance]
        cuts = list(itertools.accumulate(balance))[:-1]
        slicers: set[int] = set()
        for p, cut in enumerate(cuts):
            start = cuts[p - 1] if p else 0
            for i in self._leaving(cut):  # i descending: stop at the first made before stage p
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
        self._gradient_bytes = tuple(balance), sent
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
        a, codes = self._arrays, policy_codes(policies, self.n)
        for s, r in enumerate(stage_ranges(balance)):
            if r.stop == self.n:
                continue
            ours = np.zeros(self.n, dtype=np.int8)  # the stage's own policies
            ours[r.start : r.stop] = codes[r.start : r.stop]
            layout = Layout.one(r.start, r.stop, ours)
            runs = policy_runs(a, layout)
            first, last = recomputed_regions(a, layout, runs)
            stashed = NO_REGION_INPUTS
            if first.size:
                stashed = regions_inputs(a, layout, first, last)[1:]
            end = held_end(a, layout, runs, stashed)
            # (a value in the graph's output waits for the merge: see merged)
            for k in np.flatnonzero((end >= r.stop) & (end < self.n) & (a.held[r.start : r.stop] > 0)):
                reader = bisect.bisect_right(cuts, min(int(end[k]), self.n - 1))
                extra = min(self.chunks - 1, reader - s) - min(1, self.chunks - 1)
                waiting[s] += max(0, extra) * int(a.held[r.start + k])
        return waiting

    def weight_grads(self, lo: int, hi: int) -> int:
        """Bytes one micro-batch of a stage on nodes ``[lo, hi)`` keeps from the input half of
        a split backward to its weight half beyond its stash: torch.distributed.pipelining's
        ``stage_backward_input`` keeps the gradient at the output of each node whose
        parameters' gradients ``stage_backward_weight`` makes from it (measured on the GPT: each
        stage but the first keeps exactly these). The first stage's input half makes nothing
        (its inputs need no gradient): its weight half is the whole backward."""
        return self._weight_grads[hi] - self._weight_grads[lo] if lo else 0

    def static(self, lo: int, hi: int, weight_versions: int = 1) -> int:
        """Bytes held all along: parameters, their state, borrowed copies and, with ``carry``
        (stages as processes), the buffers of carried values (allocated once, kept across
        steps), the state of the borrowed copies (each process steps its own) and the batch
        (each process loads it; the first also gathers the forward's arguments from it)."""
        held = weight_versions * (self._params[hi] - self._params[lo]) + self._state[hi] - self._state[lo]
        if self.profile.shared:
            held += self.borrowed(lo, hi)
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
        layout = Layout.one(lo, hi, policy_codes(policies, self.n))
        return int(regions_inputs(self._arrays, layout, np.array([a - lo]), np.array([b - lo]))[0][0])

    def depends_on(self, lo: int, hi: int) -> list[int]:
        """Nodes before ``lo`` whose policies the price of a stage on ``[lo, hi)`` depends on:
        those keeping first a storage the stage reads, and those making it. Whether such a
        node drops what it keeps or makes decides whether a recomputed region of ``[lo, hi)``
        reading it keeps it instead (:func:`~lightning_pipe.plan.recompute.regions_inputs`).
        Cached: a search asks for the same ranges over and over."""
        if (found := self._depends.get((lo, hi))) is None:
            a = self._arrays
            begin, end = a.reader.searchsorted([lo, hi])
            storages = a.read_base[begin:end][a.read[begin:end] < lo]
            keepers = a.held_by[storages]
            # (a set sorted: np.unique costs more on arrays this short)
            found = sorted(set(keepers[(keepers >= 0) & (keepers < lo)].tolist()) | set(storages.tolist()))
            self._depends[lo, hi] = found
        return found

    def policy_key(self, lo: int, hi: int, policies: CodedPolicies) -> bytes:
        """The codes of ``policies`` that :meth:`peak` of ``[lo, hi)`` reads (the range's and
        :meth:`_outside`'s; none where the range chooses nothing: its live bytes are then the
        range's all kept, whatever the others choose): policies with the same key price the
        range alike."""
        own = policies.codes[lo:hi]
        if not np.count_nonzero(own):
            return b""
        return own.tobytes() + policies.codes[self._outside(lo, hi)].tobytes()

    def _outside(self, lo: int, hi: int) -> Array:
        """The nodes outside ``[lo, hi)`` whose policies the range's live bytes read: those of
        :meth:`depends_on`, and the later nodes keeping first what a node of the range makes
        (:func:`~lightning_pipe.plan.layout.held_end`; cached)."""
        if (found := self._outsides.get((lo, hi))) is None:
            by = self._arrays.held_by[lo:hi]
            found = np.array(sorted(set(self.depends_on(lo, hi)) | set(by[by >= hi].tolist())), dtype=np.int64)
            self._outsides[lo, hi] = found
        return found

    def peak(
        self,
        lo: int,
        hi: int,
        in_flight: float,
        policies: Mapping[int, Policy] = {},
        weight_versions: int = 1,
        waiting: Waiting = (0, ()),
        pending: Pending | None = None,
    ) -> StagePeak:
        """Predicted peak of a stage holding nodes ``[lo, hi)``; ``policies`` maps node index
        to its non-``keep`` policy (other stages' too, when known: a value an earlier stage
        keeps first is not the stage's to keep, unless that stage drops it). ``in_flight``
        may be fractional when a planner prices a group of stages as one. ``waiting``: bytes
        that wait at the stage for other stages while it runs forwards, and at each of its
        backwards what it holds and the bytes waiting (:meth:`waiting`), known once a split
        is. ``pending``: under a split backward, its micro-batches between the halves, each
        keeping :meth:`weight_grads` (:func:`~lightning_pipe.plan.schedule.weights_pending`;
        ``None``: its backwards are whole)."""
        return self._peak(lo, hi, in_flight, self.live(lo, hi, policies), weight_versions, waiting, pending)

    def task_peak(
        self, lo: int, hi: int, in_flight: float, task: TaskKind, policies: Mapping[int, Policy] = {},
        pending: Pending | None = None,
    ) -> StagePeak:
        """:meth:`peak` at one kind of the stage's tasks: a process holding several stages runs
        one stage's forward, or weight half, while another's fullest moment may come elsewhere
        (a weight half does not run an input half's, whose stash is whole while its gradients flow)."""
        return self._peak(lo, hi, in_flight, self.live(lo, hi, policies), 1, (0, ()), pending, task)

    def kept_peak_at_most(
        self, lo: int, hi: int, in_flight: float, weight_versions: int = 1, pending: Pending | None = None
    ) -> int:
        """An upper bound of :meth:`peak`'s total on ``[lo, hi)`` keeping every node with nothing
        waiting, from prefix sums and range maxima (:class:`_KeptBounds`), a few times cheaper:
        a fill-first search asks mostly whether a range is within a limit it is well under.
        Exact for stages as processes (their receive buffers change the stash)."""
        if self.carry:
            return self.peak(lo, hi, in_flight, {}, weight_versions, pending=pending).total
        if self._kept_bounds is None:
            self._kept_bounds = _KeptBounds(self._arrays, self._summed)
        return self._peak(lo, hi, in_flight, self._kept_bounds.live(lo, hi), weight_versions, (0, ()), pending).total

    def peaks(
        self,
        lo: int,
        hi: int,
        in_flight: float,
        variants: Sequence[CodedPolicies],
        weight_versions: int = 1,
        waiting: Waiting = (0, ()),
        pending: Pending | None = None,
    ) -> list[StagePeak]:
        """:meth:`peak` under each of ``variants``, priced at once (a search's candidates)."""
        return [self._peak(lo, hi, in_flight, live, weight_versions, waiting, pending)
                for live in self._lives(lo, hi, variants)]

    def _peak(
        self, lo: int, hi: int, in_flight: float, live: LiveBytes, weight_versions: int, waiting: Waiting,
        pending: Pending | None, task: TaskKind | None = None,
    ) -> StagePeak:
        static = forward_static = backward_static = self.static(lo, hi, weight_versions)
        first = 0  # what the first backward holds beyond the later ones
        if self.sharding is not None:  # what FSDP holds gathered while the stage computes
            # (its sharded gradients are made at the step's end: in forward it holds unsharded ones)
            gathered, regathered, first_gathered = self.sharding.gathered_bytes(lo, hi)
            forward_static = static - self.step_grads(lo, hi) + gathered
            backward_static, first = static + regathered, first_gathered - regathered
        # stages as processes keep each micro-batch's outputs until its backward
        cached = live.leaving if self.carry and hi < self.n else 0
        states = waiting[1]
        kept = self.weight_grads(lo, hi) if pending is not None else 0
        if pending is not None and kept:  # stages as processes: nothing else waits
            states = [(held, count * kept) for held, count in pending.backward]
        backward = self._backward_peaks(lo, hi, in_flight, live, backward_static, states, cached, first)
        held_last = self._last_held(lo) if hi == self.n and kept else 0
        if cached:  # and the step begins with no gradients
            fresh = forward_static - (self.step_grads(lo, hi) if self.sharding is None else 0)
            forward = [self._forward_peak(in_flight, live, fresh, round(in_flight * cached))]
        elif hi < self.n:
            boundary = 0
            if self.merges:  # GPipe: outputs wait for the next stage; those in the graph's output for the merge
                outputs = min(1.0, in_flight - 1)
                boundary = (round(outputs * live.leaving)
                            + round(max(0.0, in_flight - 1 - outputs) * self.merged(lo, hi)))
            forward = [self._forward_peak(in_flight, live, forward_static, boundary)]
        else:
            forward, loss_backward = self._last_peaks(lo, in_flight, live, forward_static)
            if loss_backward is not None:  # it begins the stage's backward: what waits then waits with it
                backward.append(_waiting(loss_backward, max((w for _, w in states), default=0)))
        if pending is not None and kept:
            forward = [_waiting(p, pending.forward * kept) for p in forward]
            # an input half frees no stash as a whole backward does (it keeps the graph for the
            # weight half): its micro-batch's whole stash while it runs (:meth:`input_half`) and
            # at its end, with the gradients it keeps and those pending before it
            running = self.input_half(lo, hi)
            inputs = [(backward_static, round(held * live.stashed), running,
                       held_last + round(held * cached) + count * kept) for held, count in pending.backward]
            backward += [(backward_static, round(held * live.stashed), 0, round(held * cached) + (count + 1) * kept)
                         for held, count in pending.backward]
        else:
            inputs = []
        if waiting[0]:
            forward = [_waiting(p, waiting[0]) for p in forward]
        if task == "forward":
            return _highest(forward)
        peaks = backward if task in ("weight", "backward") else backward + inputs
        peaks = peaks if task else forward + peaks
        # the optimizer's step: the stage's state, the step's temporaries (the last: the batch)
        peaks.append((static, 0, self.step(lo, hi), self._last_batch if hi == self.n else 0))
        if self.replicas > 1 and self.sharding is None:  # before it, the gradients' reduction: a bucket copied flat
            peaks.append((static, 0, min(self.step_grads(lo, hi), GRADIENT_BUCKET_BYTES), 0))
        return _highest(peaks)

    def backward_peak_runs(self, lo: int, hi: int, policies: Mapping[int, Policy]) -> list[int]:
        """The nodes of ``[lo, hi)`` in the runs of one policy (kept runs aside) holding a node
        at whose backward one micro-batch's backward peaks (with every parameter gradient made,
        or with those made so far: what :meth:`peak` prices), or the node before it (a
        region's stash comes back at its last node's backward), in node order."""
        layout = Layout.one(lo, hi, policy_codes(policies, self.n))
        codes, runs = layout.code, policy_runs(self._arrays, layout)
        found = {int(at - lo) for peak in self.live(lo, hi, policies).peaks_at for at in (peak, peak - 1)}
        chosen = {int(runs.of[k]) for k in found if 0 <= k < hi - lo and codes[k]}
        return [lo + k for run in sorted(chosen) for k in range(int(runs.starts[run]), int(runs.stops[run]))]

    def merged(self, lo: int, hi: int) -> int:
        """Bytes of one micro-batch's values nodes ``[lo, hi)`` make that are part of the
        graph's output: GPipe's merge reads them once every micro-batch's forward is done."""
        return self._to_output[hi] - self._to_output[lo]

    def _forward_peak(self, in_flight: float, live: LiveBytes, static: int, boundary: int) -> _Parts:
        """The peak of the forward of the last micro-batch in flight."""
        stash, rest = live.forward
        return static, round((in_flight - 1) * live.stashed) + stash, rest, boundary

    def _backward_peaks(
        self,
        lo: int,
        hi: int,
        in_flight: float,
        live: LiveBytes,
        static: int,
        states: Sequence[tuple[float, int]],
        cached: int = 0,
        first: int = 0,
    ) -> list[_Parts]:
        """The peaks of a step's backwards: the first with the micro-batches in flight stashed
        and the gradients of the parameters made as it goes (they were freed for it), the
        later ones with all of them. ``states``: at each backward, the micro-batches held and
        the bytes of gradients waiting (:meth:`waiting`); without them (a search pricing a
        range), the first holds ``in_flight`` and the later ones one fewer, unless the
        schedule runs another forward before each (1F1B and 2BW with more micro-batches).
        ``cached``: bytes of one micro-batch's outputs kept until its backward is done; ``first``:
        bytes the first backward holds beyond ``static`` less the gradients (FSDP's, gathered)."""
        gradient = self._last_backward(lo, in_flight) if hi == self.n else 0
        if not states:
            later = in_flight if not self.merges and self.chunks > in_flight else in_flight - 1
            states = ((in_flight, 0), (later, 0)) if later >= 1 else ((in_flight, 0),)
        stashed, (held, waiting) = live.stashed, states[0]
        stash, rest = live.first_backward
        peaks = [(static - self.step_grads(lo, hi) + first, round((held - 1) * stashed) + stash, rest,
                  gradient + waiting + round(held * cached))]
        stash, rest = live.backward
        for held, waiting in states[1:]:
            peaks.append((static, round((held - 1) * stashed) + stash, rest, gradient + waiting + round(held * cached)))
        return peaks

    def step_grads(self, lo: int, hi: int) -> int:
        """Bytes of the gradients a step makes on a stage of nodes ``[lo, hi)`` (freed before
        its first backward; as processes, before the step, the tied copies' too)."""
        own = self._grads[hi] - self._grads[lo]
        return own + round(self.borrowed(lo, hi) * self._grads_per_param) if self.carry else own

    def _last_peaks(
        self, lo: int, in_flight: float, live: LiveBytes, static: int
    ) -> tuple[list[_Parts], _Parts | None]:
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
                (static, stashed, 0, round(in_flight * max(out + live.leaving, p.loss_bytes)) + self.batch),
                (static - grads, stashed, 0, round(in_flight * p.loss_backward_bytes) + self.batch),
            ], None
        kept = (self.chunks - 1) * p.loss_kept_bytes + self._last_batch  # the earlier losses and the batch
        return [
            self._forward_peak(in_flight, live, static, kept),
            (static, stashed, 0, live.leaving + kept + p.loss_bytes),
        ], (static, stashed, 0, live.leaving + kept + p.loss_backward_bytes)

    def last_stage_least_peak(self, in_flight: float) -> int:
        """A lower bound of the last stage's peak whatever its first node and policies: under
        GPipe it holds the batch and ``in_flight`` micro-batches' graph outputs (the last node's
        at least) or losses, which no recompute or swap frees (:meth:`_last_peaks`); 0 where
        not known (other schedules, FSDP). Over its capacity, no split fits, and proving that
        by searching costs a largest-micro-batch search most of its time."""
        if not self.merges or self.sharding is not None:
            return 0
        p = self.profile
        return round(in_flight * max(self._final_outputs(self.n - 1), p.loss_bytes, p.loss_backward_bytes)) + self.batch

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
        return self._last_held(lo) + grads

    def _last_held(self, lo: int) -> int:
        """What the last stage holds besides its own through a micro-batch's backward once the
        gradient of its outputs is taken: the batch, the output, the losses."""
        return self._last_batch + self._final_outputs(lo) + self.chunks * self.profile.loss_kept_bytes

    def _final_outputs(self, lo: int) -> int:
        return self._to_graph_output[self.n] - self._to_graph_output[lo]

    def input_half(self, lo: int, hi: int) -> int:
        """The most bytes beside its stash one micro-batch's input half of a split backward holds
        on a stage of nodes ``[lo, hi)``, all kept: at a node, the gradients in flight there, its
        backward's growth, and the gradients kept so far for the weight half (at the outputs of
        the weighted nodes after it); no parameter gradient (cached)."""
        if (found := self._input_half.get((lo, hi))) is None:
            kept = self._weight_grads[hi] - np.asarray(self._weight_grads[lo + 1 : hi + 1], dtype=np.int64)
            level = self.range_gradients(lo, hi) + self._arrays.backward[lo:hi] + kept
            found = self._input_half[lo, hi] = int(level.max())
        return found

    def range_gradients(self, lo: int, hi: int) -> Array:
        """:func:`~lightning_pipe.plan.activations.backward_gradients` of ``[lo, hi)``, kept for
        the last range asked: a stage's optimisation prices one range hundreds of times, and they
        do not depend on policies."""
        if self._range_gradients[0] != (lo, hi):
            self._range_gradients = (lo, hi), backward_gradients(self._arrays, lo, hi)
        return self._range_gradients[1]

    def live(self, lo: int, hi: int, policies: Mapping[int, Policy]) -> LiveBytes:
        """One micro-batch's live bytes through the forward and backward of nodes ``[lo, hi)``
        (cached)."""
        if policies and np.count_nonzero((coded := CodedPolicies.of(policies, self.n)).codes[lo:hi]):
            return self._lives(lo, hi, [coded])[0]
        if (lo, hi) not in self._kept:
            self._kept[lo, hi] = kept_live_bytes(self._arrays, lo, hi, self.range_gradients(lo, hi),
                                                 summed_parameter_grads=self._summed, received=self._receiving(lo))
        return self._kept[lo, hi]

    def _lives(self, lo: int, hi: int, variants: Sequence[CodedPolicies]) -> list[LiveBytes]:
        """:meth:`live` under each of ``variants`` (cached by the policies it reads,
        :meth:`policy_key`), those not priced yet at once."""
        if (len(self._priced) + len(variants)) * self.n > _PRICED_BYTES:
            self._priced.clear()
        keys = [(lo, hi, self.policy_key(lo, hi, v)) for v in variants]
        new = {key: v.codes for key, v in zip(keys, variants) if key not in self._priced}
        batch = list(new.items())
        rows = max(1, _BATCH_POSITIONS // (hi - lo))
        for k in range(0, len(batch), rows):
            part = batch[k : k + rows]
            self._priced.update(zip((key for key, _ in part), self._live_bytes(lo, hi, np.stack([c for _, c in part]))))
        return [self._priced[key] for key in keys]

    def _live_bytes(self, lo: int, hi: int, codes: CodeRows) -> list[LiveBytes]:
        return live_bytes(self._arrays, lo, hi, codes, self.range_gradients(lo, hi),
                          summed_parameter_grads=self._summed, received=self._receiving(lo))

    @property
    def _summed(self) -> bool:
        """Whether the backward sums the micro-batches' parameter gradients into a new tensor
        (the local GPipe's one backward)."""
        return self.merges and self.chunks > 1

    def _receiving(self, lo: int) -> "Array | None":
        """:meth:`received_kept` of a stage starting at ``lo``, where stages are processes."""
        return self.received_kept(lo) if self.carry else None


class _KeptBounds:
    """Upper bounds of a range's live bytes, all kept, at each of its nodes, through prefix sums
    and range maxima of what the whole graph holds there: a range holds the part its own nodes
    made (:func:`~lightning_pipe.plan.activations.kept_live_bytes`), never more, as every term
    is non-negative. :meth:`CostModel._peak` grows with each live byte count, so it prices
    them into a bound of the range's peak."""

    def __init__(self, a: NodeArrays, summed_parameter_grads: bool) -> None:
        n = a.n
        stash = np.concatenate(([0], np.cumsum(a.saved)))  # [p]: of the nodes before p
        # [p]: values made before node p that live through it (made by the range or before it)
        held = np.zeros(n + 2, dtype=np.int64)
        held[1:-1] = a.held
        np.subtract.at(held, a.held_end + 1, a.held)
        held = np.cumsum(held)[: n + 1]
        # [p]: the gradients awaited at p, each value's largest from its maker to its last
        # reader (a range awaits some of them, those made before it from its first node)
        latest, largest = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        np.maximum.at(latest, a.producer, a.consumer)
        np.maximum.at(largest, a.producer, a.gradient)
        awaited = np.zeros(n + 1, dtype=np.int64)
        awaited[:-1] = largest
        np.subtract.at(awaited, latest, largest)
        awaiting = np.cumsum(awaited)[:n]
        backward = stash[1:] + awaiting + a.backward
        if summed_parameter_grads:
            backward += np.maximum(0, a.fresh - np.maximum(0, a.backward - a.handed))
        self.stash, self.held, self.grads_before = stash.tolist(), held.tolist(), a.grads_before.tolist()
        self.forward = _RangeMax(stash[:-1] + held[:-1] + a.allocated)
        self.backward = _RangeMax(backward + a.fresh)
        self.first_backward = _RangeMax(backward - a.grads_before[:-1])

    def live(self, lo: int, hi: int) -> LiveBytes:
        """Bounds of each of :func:`~lightning_pipe.plan.activations.kept_live_bytes`'s sums
        on ``[lo, hi)`` (its stash exact)."""
        before, stashed, leaving = self.stash[lo], self.stash[hi] - self.stash[lo], self.held[hi]
        forward = max(self.forward(lo, hi) - before, stashed + leaving)
        backward = self.backward(lo, hi) - before
        first = self.first_backward(lo, hi) - before + self.grads_before[hi]
        return LiveBytes(stashed, leaving, (0, forward), (0, backward), (0, first))


def backward_waiting(states: Sequence[BackwardState], sent: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Per backward of a stage, the micro-batches it holds and the bytes waiting at it, given
    ``(p, bytes)`` of one micro-batch's gradients it makes for each earlier stage ``p``: the
    first backward, then the later ones without repeats (only their largest peak counts)."""
    priced = [(state.held, sum(b * state.waits[p] for p, b in sent)) for state in states]
    return tuple(priced[:1]) + tuple(sorted(set(priced[1:])))


# The policy codes a cost model keeps as keys of what it priced, at most (then it starts over).
_PRICED_BYTES = 1 << 26
# The most node positions priced in one pass (:class:`Layout`): past some 16k, arrays outgrow
# the CPU's caches and a row costs more.
_BATCH_POSITIONS = 1 << 14


def _highest(peaks: Sequence[_Parts]) -> StagePeak:
    """The first of ``peaks`` with the largest total (``max`` by total, without a key function:
    a search composes thousands of peaks)."""
    highest, most = peaks[0], sum(peaks[0])
    for peak in peaks[1:]:
        if (total := sum(peak)) > most:
            highest, most = peak, total
    return StagePeak(*highest)


def _waiting(peak: _Parts, gradients: int) -> _Parts:
    """``peak`` with ``gradients`` bytes of waiting gradients added to the boundary."""
    static, activations, transient, boundary = peak
    return static, activations, transient, boundary + gradients


class _RangeMax:
    """The largest of any range ``[lo, hi)`` of values in O(1): a sparse table, level k holding
    the max of every window of 2**k values. A level becomes a list (fast to index) when first
    asked: a search asks ranges of a few lengths, and converting every level of a large model
    cost more than its search asked of them."""

    def __init__(self, values: "Sequence[int] | Array") -> None:
        levels = [np.asarray(values, dtype=np.int64)]
        while 2 ** len(levels) <= len(values):
            prev, half = levels[-1], 2 ** (len(levels) - 1)
            levels.append(np.maximum(prev[:-half], prev[half:]))
        self._levels = levels
        self._lists: list[list[int] | None] = [None] * len(levels)

    def __call__(self, lo: int, hi: int) -> int:
        level = (hi - lo).bit_length() - 1
        if (table := self._lists[level]) is None:
            table = self._lists[level] = self._levels[level].tolist()
        left, right = table[lo], table[hi - (1 << level)]
        return left if left >= right else right  # (max() is a call: a search asks thousands)
