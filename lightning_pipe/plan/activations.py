"""Activations: one micro-batch's live bytes through a stage's forward and backward.

Per node: what the nodes before it stashed, the values still to be read, its own allocations
and workspace; in the backward, the stash still held, the gradients not yet taken and the
backward's growth. Per-node policies change the stash: a swapped or recomputed run drops what
it alone keeps and brings it back for its backward; a recomputed region keeps its inputs
instead (:mod:`lightning_pipe.plan.recompute`).
"""

from dataclasses import dataclass

import numpy as np

from lightning_pipe.plan.layout import (
    NO_REGION_INPUTS,
    CodeRows,
    Layout,
    Runs,
    held_end,
    policy_runs,
    until_run_returns,
)
from lightning_pipe.plan.nodes import Array, NodeArrays
from lightning_pipe.plan.recompute import recomputed_regions, recomputing, regions_inputs

__all__ = ["LiveBytes", "backward_gradients", "kept_live_bytes", "live_bytes"]


@dataclass(slots=True)
class LiveBytes:
    """One micro-batch on a stage: its stash, the values still to be read after its forward,
    and the most bytes alive in its forward and in its backward (each as stash, other)."""

    stashed: int
    leaving: int
    forward: tuple[int, int]
    backward: tuple[int, int]  # with every parameter gradient made earlier (counted as static)
    first_backward: tuple[int, int]  # with the parameter gradients of the nodes done so far
    peaks_at: tuple[int, int] = (0, 0)  # the nodes whose backwards reach the two above


def live_bytes(
    a: NodeArrays,
    lo: int,
    hi: int,
    codes: CodeRows,
    gradients: Array,
    *,
    summed_parameter_grads: bool = False,
    received: "Array | None" = None,
) -> list[LiveBytes]:
    """One micro-batch's live bytes through the forward and backward of nodes ``[lo, hi)``, for
    each row of ``codes`` (every node's policy, :func:`~lightning_pipe.plan.policy.policy_codes`;
    all kept: :func:`kept_live_bytes`). ``gradients``: :func:`backward_gradients` of the range.
    ``summed_parameter_grads``: the backward sums every micro-batch's parameter gradients into
    a new tensor (the local GPipe with more than one micro-batch). ``received``: per node, bytes
    it saves that its stage holds anyway (receive buffers of stages as processes), not stashed
    again. Within a row, a swapped or
    recomputed run drops the stash it alone keeps, a recomputed region keeps its inputs
    instead, and both bring their stash back for their backward (:func:`drop_stashes`)."""
    layout = Layout(lo, hi, codes)
    rows, size, node = layout.rows, layout.size, layout.node
    stash = a.saved[node] if received is None else np.maximum(0, a.saved[node] - received[node])
    back = np.zeros(stash.size, dtype=np.int64)
    stashed = NO_REGION_INPUTS
    runs = policy_runs(a, layout)
    if layout.code.any():
        stashed = drop_stashes(a, layout, runs, stash, back)
    kept = np.zeros((rows, size + 1), dtype=np.int64)
    stash.reshape(rows, size).cumsum(axis=1, out=kept[:, 1:])
    # values a node makes and does not keep itself stay alive after it until kept, or read
    end = held_end(a, layout, runs, stashed)
    held = np.zeros((rows, size + 1), dtype=np.int64)
    first = node - lo + 1 + layout.row * (size + 1)
    leaving = np.zeros(rows, dtype=np.int64)
    for values, until in [(a.held[node], end), *dropped_outputs(a, layout, runs)]:
        np.add.at(held.ravel(), first, values)
        np.add.at(held.ravel(), np.maximum(first, first + np.minimum(until, hi - 1) - node), -values)
        np.add.at(leaving, layout.row, np.where(until >= hi, values, 0))
    held = held.cumsum(axis=1)[:, :size]
    # each node's forward, and the end of the stage's: its whole stash and what leaves it (a
    # node saving an input an earlier stage made takes it on only as it runs)
    ends = (kept[:, -1] + leaving)[:, None]
    forward = np.concatenate((kept[:, :-1] + held + a.allocated[lo:hi], ends), axis=1)
    common = kept[:, 1:] + gradients + a.backward[lo:hi] + back.reshape(rows, size)
    # a fresh gradient of the node's parameters, to add to theirs; under the local GPipe, whose
    # one backward sums the micro-batches' gradients before the parameter takes them, a new
    # tensor, their sum: made once the node's backward has returned, its workspace freed, with
    # what it hands its inputs and the two summed alive
    fresh = a.fresh[lo:hi]
    backward = common + fresh
    if summed_parameter_grads:
        backward += np.maximum(0, fresh - np.maximum(0, a.backward[lo:hi] - a.handed[lo:hi]))
    first_backward = common + a.grads[lo:hi][::-1].cumsum()[::-1]  # the parameter gradients made so far
    if rows == 1:  # (a search's check of its choices: picked one by one, cheaper than by fancy indexing)
        k, f, b, g = kept[0], int(forward[0].argmax()), int(backward[0].argmax()), int(first_backward[0].argmax())
        fs, bs, gs = int(k[f]), int(k[b + 1]), int(k[g + 1])
        return [LiveBytes(stashed=int(k[-1]), leaving=int(leaving[0]), forward=(fs, int(forward[0, f]) - fs),
                          backward=(bs, int(backward[0, b]) - bs), first_backward=(gs, int(first_backward[0, g]) - gs),
                          peaks_at=(lo + b, lo + g))]
    f, b, g = (x.argmax(axis=1) for x in (forward, backward, first_backward))
    at = np.arange(rows)
    columns = zip(*(x.tolist() for x in (
        kept[:, -1], leaving, kept[at, f], forward[at, f] - kept[at, f], kept[at, b + 1],
        backward[at, b] - kept[at, b + 1], kept[at, g + 1], first_backward[at, g] - kept[at, g + 1], b, g)))
    return [LiveBytes(stashed=s, leaving=out, forward=(fs, fr), backward=(bs, br), first_backward=(gs, gr),
                  peaks_at=(lo + bk, lo + gk))
            for s, out, fs, fr, bs, br, gs, gr, bk, gk in columns]


def kept_live_bytes(
    a: NodeArrays, lo: int, hi: int, gradients: Array, *, summed_parameter_grads: bool = False,
    received: "Array | None" = None,
) -> LiveBytes:
    """:func:`live_bytes` of nodes ``[lo, hi)`` all kept: what a search prices most, a few
    times cheaper without the layout and runs that rows of policies need (NumPy's per-call
    overhead is most of a range's price)."""
    size = hi - lo
    stash = a.saved[lo:hi] if received is None else np.maximum(0, a.saved[lo:hi] - received[lo:hi])
    kept = np.zeros(size + 1, dtype=np.int64)
    stash.cumsum(out=kept[1:])
    # a value a node makes and does not keep itself stays alive after it until kept, or read
    values, end = a.held[lo:hi], a.held_end[lo:hi]
    held = np.zeros(size + 1, dtype=np.int64)
    held[1:] = values
    np.subtract.at(held, np.minimum(end, hi - 1) - (lo - 1), values)  # (an end is never before its node)
    leaving = int(values[end >= hi].sum())
    forward = kept[:-1] + held[:-1].cumsum() + a.allocated[lo:hi]
    f = int(forward.argmax())
    stashed, through = int(kept[-1]), int(forward[f])
    # the stage's forward ends holding its whole stash and what leaves it (the later peak
    # only where higher, as live_bytes's argmax over both takes the first)
    forward_peak = (stashed, leaving) if stashed + leaving > through else (int(kept[f]), through - int(kept[f]))
    common = kept[1:] + gradients + a.backward[lo:hi]
    fresh = a.fresh[lo:hi]
    backward = common + fresh
    if summed_parameter_grads:
        backward += np.maximum(0, fresh - np.maximum(0, a.backward[lo:hi] - a.handed[lo:hi]))
    first_backward = common + (a.grads_before[hi] - a.grads_before[lo:hi])  # the parameter gradients made so far
    b, g = int(backward.argmax()), int(first_backward.argmax())
    kb, kg = int(kept[b + 1]), int(kept[g + 1])
    return LiveBytes(stashed=stashed, leaving=leaving, forward=forward_peak,
                     backward=(kb, int(backward[b]) - kb), first_backward=(kg, int(first_backward[g]) - kg),
                     peaks_at=(lo + b, lo + g))


def drop_stashes(
    a: NodeArrays, layout: Layout, runs: Runs, stash: Array, back: Array
) -> tuple[Array, Array]:
    """Take off ``stash`` (per position of ``layout``) what each swapped or recomputed run
    drops, give a recomputed region its inputs, and add to ``back`` the bytes brought back
    during each node's backward. A run drops the stash its nodes alone keep (a swapped run
    keeps on the device what it saves of values made before it); the stash comes back whole
    (a swapped run's once the backward of the segment after it begins, a recomputed one's at
    its own last node) and leaves again as each node's backward takes its part. All runs
    (``runs``) are priced at once: a stage may have hundreds. Returns the positions of the
    storages the recomputed regions keep as inputs and the first node of the region keeping
    each (:func:`~lightning_pipe.plan.recompute.regions_inputs`)."""
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
    shared = ((code == 1) & (saver >= stop) & (saver < layout.hi)).nonzero()[0]
    keeper = shared + saver[shared] - node[shared]  # its position, in the row
    shared, keeper = shared[code[keeper] == 0], keeper[code[keeper] == 0]
    rebuilt[shared] = a.saved[node[shared]]
    # what comes back: a recomputed region's inputs stay (the region keeps them), not made again
    made_again = np.maximum(0, rebuilt - np.where((code == 1) & before, a.saved_inputs[node], 0))
    if shared.size:
        gone = np.zeros(node.size + 1, dtype=np.int64)
        np.add.at(gone, shared, made_again[shared])
        np.add.at(gone, keeper, -made_again[shared])
        back -= gone.cumsum()[:-1]
    total = made_again.cumsum()
    back += total - np.concatenate(([0], total))[starts][segment]
    kind = code[starts]
    dropped = np.add.reduceat(freed, starts)
    after = np.zeros(starts.size, dtype=np.int64)  # a swapped run's stash, back for the segment after it (its row's)
    swapped = ((kind[:-1] == 2) & (starts[1:] % layout.size != 0)).nonzero()[0]
    after[swapped + 1] = dropped[swapped]
    back += after[segment]
    first, last = recomputed_regions(a, layout, runs)
    if not first.size:
        return NO_REGION_INPUTS
    regions = layout.regions(first, last)
    back[last - 1] += recomputing(a, layout, first, last, regions, made_again)
    totals, storages, since = regions_inputs(a, layout, first, last, regions)
    stash[first] += totals
    return storages, since


def dropped_outputs(a: NodeArrays, layout: Layout, runs: Runs | None) -> list[tuple[Array, Array]]:
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
    return [(own, until_run_returns(layout, runs, end, end < layout.hi))]


def backward_gradients(a: NodeArrays, lo: int, hi: int) -> Array:
    """Per node of ``[lo, hi)``, bytes of the gradients the range's later nodes made for values
    made up to it that are still to be taken when its backward runs (by it or an earlier node).
    One a node hands on the gradient of its output (an ``add``'s, slices of a ``cat``'s) that
    only later stages read is the storage that came from them, held where it arrived (see
    :meth:`~lightning_pipe.plan.memory.CostModel.waiting`), not here; unless the value it goes
    to is made here and read on a later stage as well (:attr:`NodeArrays.summed_with`): autograd
    adds the two into a new tensor here, held until the value's maker takes it."""
    edges = slice(*a.consumer.searchsorted([lo, hi]).tolist())  # (sliced: views, not copies)
    consumers = a.consumer[edges]
    later = a.forwarded[edges] & (a.first_reader[consumers] >= hi)
    summed_here = (a.summed_at[edges] >= lo) & (a.summed_with[edges] >= hi)
    taken = ~(later & ~summed_here)
    producers, consumers, gradients = a.producer[edges][taken], consumers[taken], a.gradient[edges][taken]
    live = np.zeros(hi - lo + 1, dtype=np.int64)
    if producers.size:  # per value made from the first read on (indexed so, not by np.unique's sort: 4x faster)
        first = min(lo, int(producers.min()))
        latest = np.zeros(hi - first, dtype=np.int64)  # its last reader in the range
        np.maximum.at(latest, producers - first, consumers - lo)
        gradient = np.zeros(hi - first, dtype=np.int64)
        np.maximum.at(gradient, producers - first, gradients)
        live[0] += gradient[: lo - first].sum()  # from the stage start, or its producer, ...
        live[:-1] += gradient[lo - first :]
        np.subtract.at(live, latest, gradient)  # ... to before its last reader in the range
    return live.cumsum()[:-1]
