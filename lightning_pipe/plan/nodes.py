"""The profile as arrays: each node's bytes, and the dataflow edges between nodes.

The memory model prices many node ranges and many policy variants of each; NumPy arrays over
the nodes (and over every read and every gradient edge, by reader) let it price one stage
under hundreds of variants in one vectorised pass (:mod:`lightning_pipe.plan.layout`).
"""

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np

from lightning_pipe.plan.profile import NodeProfile, Profile

__all__ = ["Array", "NodeArrays"]

Array: TypeAlias = "np.ndarray[tuple[int], np.dtype[np.int64]]"


class NodeArrays:
    """The profile's per-node bytes as arrays, and its dataflow edges by consumer."""

    def __init__(self, profile: Profile) -> None:
        nodes = profile.nodes
        self.n = len(nodes)

        def array(values: Sequence[int]) -> Array:
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
        self.last_reader = array([len(nodes) if n.users and min(n.users) < 0 else max(k, max(n.users, default=k))
                                  for k, n in enumerate(nodes)])
        self.workspace = array([n.transient_bytes for n in nodes])
        self.allocated = self.made + self.workspace  # what a node's forward allocates, at its peak
        self.backward = array([max(n.backward_bytes - n.grad_bytes, 0) for n in nodes])
        self.grads = array([n.grad_bytes for n in nodes])
        # of those, what a backward adding them to .grad holds fresh at once (one layer's of several)
        self.fresh = array([n.grad_bytes if n.fresh_grad_bytes is None else n.fresh_grad_bytes for n in nodes])
        self.grads_before = np.concatenate(([0], np.cumsum(self.grads)))  # [i]: of the nodes before i
        self.last_saver = array([max(k, n.last_saver) for k, n in enumerate(nodes)])
        self.output = array([n.output_bytes for n in nodes])
        # the node whose storage a node's value lives on: itself, or for a view its largest input's
        base = list(range(len(nodes)))
        producers: list[list[int]] = [[] for _ in nodes]  # per node, the nodes it reads, in order
        for j, n in enumerate(nodes):
            for u in set(n.users):
                if u >= 0:
                    producers[u].append(j)
        reads = [(u, j) for u, read in enumerate(producers) for j in read]  # by reader
        outputs = [n.output_bytes for n in nodes]
        for j, n in enumerate(nodes):
            if n.made_bytes == 0 and n.output_bytes and producers[j]:
                base[j] = base[max(producers[j], key=outputs.__getitem__)]
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
        first_reader = [len(nodes)] * len(nodes)
        for u, j in reversed(reads):
            first_reader[j] = u
        self.first_reader = array(first_reader)
        # (not counting the graph's output, gathered in a container: its values take no gradient)
        summing = [(u, j, f or nodes[u].made_bytes == 0) for (u, j), f in zip(edges, self.forwarded)
                   if nodes[u].made_bytes or any(x >= 0 for x in nodes[u].users)]
        summed = _summed_with(summing, edges)
        self.summed_at, self.summed_with = array([x for x, _ in summed]), array([y for _, y in summed])
        # per node, the gradients its backward hands the values it reads
        self.handed = np.bincount(self.consumer, weights=self.gradient, minlength=len(nodes)).astype(np.int64)


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
