"""Memory model: predict each stage's peak bytes from a profile, a split and a schedule.

    peak(stage) = static + in_flight * stashed + transient + boundary

static: parameters (one copy per weight version the schedule keeps), gradients and optimizer
state the stage owns, and the one copy per batch of each parameter it borrows (a tied weight
whose first user is on an earlier stage); stashed: activation bytes one micro-batch leaves for backward;
in_flight: micro-batches whose activations a schedule holds at once (GPipe: all of them);
transient: the largest workspace of a node's forward or backward, plus the largest set of
bytes brought back at once for the backward of a recomputed region or a swapped node;
boundary: the stage's outputs of one micro-batch that are not already stashed, plus the
gradients waiting at the stage (see :meth:`CostModel.waiting_gradients`).

Per node, a policy says where its saved bytes live between forward and backward: ``keep``
(on the device), ``swap`` (in host memory: no device bytes while in flight) or ``recompute``
(dropped; a maximal run of recomputed nodes, a *region*, stashes only its inputs and runs its
forward again before its backward).

:class:`CostModel` holds prefix sums over the profile so that a planner can price any
contiguous node range in O(1) when every node is kept. Given the ``link_bandwidth`` between
stage devices, it also prices what a stage sends to the next (:meth:`CostModel.send_ms`).
"""

import bisect
import itertools
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import numpy as np

from lightning_pipe.plan.profile import Profile

__all__ = ["CostModel", "Policy", "StagePeak", "predict_peaks", "stage_ranges"]

Policy = Literal["keep", "recompute", "swap"]


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
        return replace(self, boundary=self.boundary + gradients)


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
) -> list[StagePeak]:
    """Predicted peak of every stage; ``in_flight[s]`` micro-batches hold activations at once.

    ``policies`` gives one policy per node (all kept when empty); ``weight_versions`` is the
    number of parameter copies the schedule keeps (2 for PipeDream-2BW); ``waits`` is the
    schedule's :func:`~lightning_pipe.plan.schedule.gradient_waits` (none wait when empty).
    """
    model = CostModel(profile)
    chosen = {i: p for i, p in enumerate(policies) if p != "keep"}
    waiting = model.waiting_gradients(balance, waits)
    return [
        model.peak(r.start, r.stop, in_flight[s], {i: chosen[i] for i in r if i in chosen}, weight_versions)
        .waiting(waiting[s])
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

    def __init__(self, profile: Profile, link_bandwidth: float | None = None) -> None:
        nodes = profile.nodes
        self.profile = profile
        self.link_bandwidth = link_bandwidth  # bytes per second between stage devices
        self.n = len(nodes)
        self.forward_ms, self.backward_ms = _pooled_times(profile)
        self.saved = [n.saved_bytes for n in nodes]
        self.last_saver = [n.last_saver for n in nodes]
        self.output = [n.output_bytes for n in nodes]
        self.users = [n.users for n in nodes]
        self._params = _prefix([n.param_bytes for n in nodes])
        self._state = _prefix([n.grad_bytes + n.optimizer_bytes for n in nodes])
        self._saved = _prefix(self.saved)
        self._forward = _prefix(self.forward_ms)
        self._compute = _prefix([f + b for f, b in zip(self.forward_ms, self.backward_ms)])
        # A stage's backward runs with its micro-batches still stashed, so a node's backward
        # growth (fresh gradients, workspace) counts as much as its forward workspace.
        self._transient = _sparse_max([max(n.transient_bytes, n.backward_bytes) for n in nodes])
        self.producers: list[list[int]] = [[] for _ in nodes]
        for j, n in enumerate(nodes):
            for u in n.users:
                if u >= 0:
                    self.producers[u].append(j)
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

    def freeable(self, a: int, b: int) -> int:
        """Saved bytes that recomputing or swapping nodes ``[a, b)`` takes off the device:
        those of a node whose stashed storages no node after ``b - 1`` keeps too."""
        return sum(self.saved[k] for k in range(a, b) if self.last_saver[k] < b)

    def compute_ms(self, lo: int, hi: int) -> float:
        """Forward plus backward time of one micro-batch."""
        return self._compute[hi] - self._compute[lo]

    def forward_time(self, lo: int, hi: int) -> float:
        return self._forward[hi] - self._forward[lo]

    def transient(self, lo: int, hi: int) -> int:
        """Largest workspace of a node's forward or backward in the range."""
        level = (hi - lo).bit_length() - 1
        table = self._transient[level]
        return max(table[lo], table[hi - (1 << level)])

    def boundary(self, lo: int, hi: int) -> int:
        total = 0
        for i, sent in self._leaving[hi]:
            if i < lo:
                break
            total += sent
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
        return sum(p.nbytes for p in self.profile.shared if p.users[0] < lo and any(lo <= u < hi for u in p.users))

    def waiting_gradients(self, balance: Sequence[int], waits: Sequence[Sequence[int]]) -> list[int]:
        """Per stage, bytes of gradients computed for earlier stages that wait there for their
        producer's backward. A schedule that runs backward stage by stage (1F1B, 2BW) completes
        a value's gradient in the backward of the last stage reading it, ``s``, and keeps it on
        that stage's device until its producer ``p`` runs that micro-batch's backward: up to
        ``waits[p][s]`` micro-batches at once. Only a whole split determines this, so the
        partitioners' search leaves it out and checks it once a split is chosen. A value read
        only on its own stage waits for nothing, so only the values crossing a cut are visited."""
        waiting = [0] * len(balance)
        if not waits:
            return waiting
        cuts = list(itertools.accumulate(balance))[:-1]
        for p, cut in enumerate(cuts):
            start = cuts[p - 1] if p else 0
            for i, _ in self._leaving[cut]:  # i descending: stop at the first made before stage p
                if i < start:
                    break
                last = bisect.bisect_right(cuts, self._last_reader[i])
                waiting[last] += self.output[i] * waits[p][last]
        return waiting

    def static(self, lo: int, hi: int, weight_versions: int = 1) -> int:
        return weight_versions * self.params(lo, hi) + self._state[hi] - self._state[lo] + self.borrowed(lo, hi)

    def region_inputs(self, a: int, b: int, lo: int, policies: Mapping[int, Policy]) -> int:
        """Bytes a recomputed region ``[a, b)`` of a stage starting at ``lo`` must stash: the
        values it reads from outside itself, except what a kept producer stashes anyway."""
        total = self.profile.input_bytes if any(i in self.reads_input for i in range(a, b)) else 0
        seen = set()
        for i in range(a, b):
            for j in self.producers[i]:
                if j < a and j not in seen:
                    seen.add(j)
                    kept = j >= lo and policies.get(j, "keep") == "keep"
                    total += max(0, self.output[j] - self.saved[j]) if kept else self.output[j]
        return total

    def peak(
        self,
        lo: int,
        hi: int,
        in_flight: float,
        policies: Mapping[int, Policy] = {},
        weight_versions: int = 1,
    ) -> StagePeak:
        """Predicted peak of a stage holding nodes ``[lo, hi)``; ``policies`` maps node index
        to its non-``keep`` policy. ``in_flight`` may be fractional when a planner prices a
        group of stages as one."""
        stashed = self.stashed(lo, hi)
        restore = 0
        for a, b in regions(policies, "swap"):  # a run of swapped nodes is loaded back at once
            stashed -= self.freeable(a, b)
            restore = max(restore, self._saved[b] - self._saved[a])
        for a, b in regions(policies):
            stashed += self.region_inputs(a, b, lo, policies) - self.freeable(a, b)
            restore = max(restore, self._saved[b] - self._saved[a])
        return StagePeak(
            static=self.static(lo, hi, weight_versions),
            activations=round(in_flight * stashed),
            transient=self.transient(lo, hi) + restore,
            boundary=self.boundary(lo, hi),
        )


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
        f = statistics.median(profile.nodes[i].forward_ms for i in members)
        b = statistics.median(profile.nodes[i].backward_ms for i in members)
        for i in members:
            forward[i], backward[i] = f, b
    return forward, backward


def regions(policies: Mapping[int, Policy], policy: Policy = "recompute") -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of consecutive nodes with ``policy``."""
    runs: list[tuple[int, int]] = []
    for i in sorted(i for i, p in policies.items() if p == policy):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _sparse_max(values: Sequence[int]) -> list[list[int]]:
    """Sparse table: level k holds the max of every window of 2**k values (O(1) range max)."""
    levels = [np.asarray(values, dtype=np.int64)]
    while 2 ** len(levels) <= len(values):
        prev, half = levels[-1], 2 ** (len(levels) - 1)
        levels.append(np.maximum(prev[:-half], prev[half:]))
    return [level.tolist() for level in levels]
