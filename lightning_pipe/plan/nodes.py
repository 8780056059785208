"""The profile as arrays: each node's bytes, and the dataflow edges between nodes.

The memory model prices many node ranges and many policy variants of each; NumPy arrays over
the nodes (and over every read and every gradient edge, by reader) let it price one stage
under hundreds of variants in one vectorised pass (:mod:`lightning_pipe.plan.layout`).
"""

import itertools
from collections.abc import Sequence
from operator import attrgetter
from typing import TypeAlias

import numpy as np

from lightning_pipe.plan.profile import NodeProfile, Profile

__all__ = ["Array", "NodeArrays"]

Array: TypeAlias = "np.ndarray[tuple[int], np.dtype[np.int64]]"


# NodeProfile's integer fields NodeArrays reads, taken from every node in one pass
_FIELDS = ("saved_bytes", "saved_inputs_bytes", "saved_inputs_from", "made_bytes", "held_bytes", "held_until",
           "held_by", "output_bytes", "transient_bytes", "backward_bytes", "grad_bytes", "last_saver",
           "output_grad_bytes", "param_bytes", "optimizer_bytes", "step_bytes")


class NodeArrays:
    """The profile's per-node bytes as arrays, and its dataflow edges by consumer. Built with
    NumPy from one pass over the nodes: a planner makes one for every profile it plans (a
    search over micro-batch sizes, one per size)."""

    def __init__(self, profile: Profile) -> None:
        nodes = profile.nodes
        n = self.n = len(nodes)
        fields = itertools.chain.from_iterable(map(attrgetter(*_FIELDS), nodes))
        table = np.fromiter(fields, dtype=np.int64, count=n * len(_FIELDS)).reshape(n, len(_FIELDS)).T.copy()
        column = dict(zip(_FIELDS, table))
        index = np.arange(n)
        self.saved = column["saved_bytes"]
        self.saved_inputs = column["saved_inputs_bytes"]
        self.saved_inputs_from = column["saved_inputs_from"]
        self.made = column["made_bytes"]
        self.held = column["held_bytes"]
        self.held_until = np.maximum(index, column["held_until"])
        self.held_by = column["held_by"]
        self.held_end = np.where(self.held_by >= 0, np.maximum(self.held_by, index), self.held_until)
        self.output = column["output_bytes"]
        # the part of a node's output it keeps itself, and the last node reading its output
        self.own_output = np.maximum(0, np.minimum(self.output, self.made) - self.held)
        users = [node.users for node in nodes]
        self.user = np.fromiter(itertools.chain.from_iterable(users), dtype=np.int64)  # every user, by node
        self.user_of = np.repeat(index, np.fromiter(map(len, users), dtype=np.int64, count=n))  # the node used
        lowest, highest = np.zeros(n, dtype=np.int64), index.copy()
        np.minimum.at(lowest, self.user_of, self.user)
        np.maximum.at(highest, self.user_of, self.user)
        self.last_reader = np.where(lowest < 0, n, highest)
        self.workspace = column["transient_bytes"]
        self.allocated = self.made + self.workspace  # what a node's forward allocates, at its peak
        self.backward = np.maximum(column["backward_bytes"] - column["grad_bytes"], 0)
        self.grads = column["grad_bytes"]
        # of those, what a backward adding them to .grad holds fresh at once (one layer's of several)
        self.fresh = np.fromiter((d.grad_bytes if d.fresh_grad_bytes is None else d.fresh_grad_bytes for d in nodes),
                                 dtype=np.int64, count=n)
        self.grads_before = np.concatenate(([0], np.cumsum(self.grads)))  # [i]: of the nodes before i
        self.last_saver = np.maximum(index, column["last_saver"])
        self.columns = column  # the rest, for the cost model's prefix sums
        # every read (reader, node read, that node's storage), by reader, each once
        read = self.user >= 0
        pairs = np.sort(self.user[read] * max(n, 1) + self.user_of[read])  # (np.unique's hashing costs more)
        first_of = np.ones(pairs.size, dtype=bool)
        first_of[1:] = pairs[1:] != pairs[:-1]
        pairs = pairs[first_of]
        self.reader, self.read = np.divmod(pairs, max(n, 1))
        # the node whose storage a node's value lives on: itself, or for a view its largest input's
        largest = np.lexsort((self.read, -self.output[self.read], self.reader))  # per reader, its largest read first
        first = largest[np.flatnonzero(np.diff(self.reader[largest], prepend=-1))]
        views = (self.made == 0) & (self.output != 0)
        self.read_base = _bases(n, self.reader[first], self.read[first], views)[self.read]
        # a reader whose value takes no gradient (a shape) gives its inputs none
        output_grad = column["output_grad_bytes"]
        taking = read.copy()
        taking[read] = output_grad[self.user[read]] != 0
        order = np.lexsort((self.user_of[taking], self.user[taking]))
        self.consumer, self.producer = self.user[taking][order], self.user_of[taking][order]
        self.gradient = output_grad[self.producer]
        self.forwarded = np.zeros(self.consumer.size, dtype=bool)
        for k in np.flatnonzero(np.isin(self.consumer, [u for u, node in enumerate(nodes) if node.forwarded_grads])):
            u, j = int(self.consumer[k]), int(self.producer[k])
            self.forwarded[k] = j in nodes[u].forwarded_grads
            self.gradient[k] = _edge_gradient(nodes, u, j)
        self.first_reader = np.full(n, n, dtype=np.int64)
        np.minimum.at(self.first_reader, self.read, self.reader)
        # (not counting the graph's output, gathered in a container: its values take no gradient)
        edges = list(zip(self.consumer.tolist(), self.producer.tolist()))
        read_by_node = np.zeros(n, dtype=bool)  # whether a node's value is read by a node
        read_by_node[self.read] = True
        made_by = (self.made != 0)[self.consumer]
        hands = made_by | read_by_node[self.consumer]
        summing = [(u, j, f or not m) for (u, j), f, m, h in
                   zip(edges, self.forwarded.tolist(), made_by.tolist(), hands.tolist()) if h]
        summed = _summed_with(summing, edges)
        self.summed_at, self.summed_with = (np.array([x for x, _ in summed], dtype=np.int64),
                                            np.array([y for _, y in summed], dtype=np.int64))
        # per node, the gradients its backward hands the values it reads
        self.handed = np.bincount(self.consumer, weights=self.gradient, minlength=n).astype(np.int64)


def _bases(n: int, readers: Array, widest: Array, view: "np.ndarray[tuple[int], np.dtype[np.bool_]]") -> Array:
    """Per node, the node whose storage its value lives on: for a ``view`` its ``widest`` read's
    (``readers[k]`` reads ``widest[k]``, one entry per reader), followed through views of views;
    else itself. Found by pointer doubling (each pass halves at least what is left of the
    longest chain of views), not a Python step per view: in a synthetic chain every node is one."""
    base = np.arange(n)
    viewing = view[readers]
    base[readers[viewing]] = widest[viewing]
    while not np.array_equal(further := base[base], base):
        base = further
    return base


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
    # per value, its last reader and its last other one (-1: none): a value many nodes read (a
    # mask every layer takes) would otherwise have its readers listed again for each of them
    last: dict[int, tuple[int, int]] = {}
    for j, those in readers.items():
        latest = max(those)
        last[j] = (latest, max((r for r in those if r != latest), default=-1))

    def other(u: int, j: int) -> int:
        """The last reader of ``j`` but ``u`` (-1: none)."""
        latest, before = last.get(j, (-1, -1))
        return latest if latest != u else before

    found = []
    for u, j in edges:
        while (reader := other(u, j)) < 0 and len(onward.get(j, ())) == 1:
            u, j = j, onward[j][0]
        found.append((j, reader))
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
