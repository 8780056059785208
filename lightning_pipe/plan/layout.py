"""Where policies put a stage's nodes, and how long each value lives under them.

A :class:`Layout` lays rows of per-node policies for one stage end to end, so that one
vectorised pass prices every row; :func:`policy_runs` finds the maximal runs of one policy
(the runtime calls each run as one function); :func:`held_end` says until which node each
value stays alive.
"""

from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from lightning_pipe.plan.nodes import Array, NodeArrays
from lightning_pipe.plan.policy import Codes

__all__ = ["NO_REGION_INPUTS", "CodeRows", "Layout", "Runs", "held_end", "policy_runs", "until_run_returns"]

CodeRows: TypeAlias = "np.ndarray[tuple[int, int], np.dtype[np.int8]]"  # rows of Codes


class Layout:
    """Rows of policies for one stage ``[lo, hi)``, priced at once: laid end to end, position
    ``p`` is node ``lo + p % size`` of row ``p // size``. A search prices hundreds of variants
    of one stage's policies; one vectorised pass over many costs about what a pass over one
    does, which is mostly NumPy's per-call overhead."""

    def __init__(self, lo: int, hi: int, codes: CodeRows) -> None:
        self.lo, self.hi, self.size = lo, hi, hi - lo
        self.codes = codes  # (rows, every node): a row's policies, other stages' too
        self.rows = codes.shape[0]
        if self.rows == 1:  # (most often one row: a search's check of its choices; divmod costs more)
            self.row, self.node = np.zeros(self.size, dtype=np.int64), np.arange(lo, hi)
        else:
            self.row, local = np.divmod(np.arange(self.rows * self.size), self.size)
            self.node = local + lo
        self.code = codes[:, lo:hi].ravel()
        self._reads: tuple[Array, Array, Array] | None = None

    @classmethod
    def one(cls, lo: int, hi: int, codes: Codes) -> "Layout":
        return cls(lo, hi, codes[None])

    def reads(self, a: NodeArrays) -> tuple[Array, Array, Array]:
        """Every read by a node of the stage, in each row, in position order: the reader's
        position, the node read and that node's storage (:attr:`NodeArrays.read_base`;
        kept: the regions' pricing asks twice)."""
        if self._reads is None:
            begin, end = a.reader.searchsorted([self.lo, self.hi])
            shift = (np.arange(self.rows) * self.size)[:, None]
            reader = (a.reader[begin:end] - self.lo + shift).ravel()
            read, base = a.read[begin:end], a.read_base[begin:end]  # (np.tile costs more than a pass for one row)
            self._reads = (reader, read, base) if self.rows == 1 else (reader, np.tile(read, self.rows),
                                                                      np.tile(base, self.rows))
        return self._reads

    def regions(self, starts: Array, stops: Array) -> tuple[Array, Array]:
        """Per position, the index of the last of the regions ``[starts[k], stops[k])`` (in
        order) starting at or before it (-1: none), and whether it lies in that region."""
        positions = np.arange(self.code.size)
        at = np.full(self.code.size, -1)
        at[:] = starts.searchsorted(positions, side="right") - 1
        return at, (at >= 0) & (positions < stops[at])


@dataclass
class Runs:
    """Maximal runs of one policy over a layout's positions (kept ones too; a row starts a
    run): their starts and stops, the run of each position, and whether its node's stash
    goes with its run (swapped or recomputed, and no node after the run saves it too)."""

    starts: Array
    stops: Array
    of: Array
    drops: Array

    def stop_nodes(self, layout: Layout) -> Array:
        """Per run, the node after its last."""
        return layout.node[self.stops - 1] + 1


def policy_runs(a: NodeArrays, layout: Layout) -> Runs:
    code, node = layout.code, layout.node
    new = np.ones(code.size, dtype=bool)
    new[1:] = code[1:] != code[:-1]
    new[:: layout.size] = True
    starts = new.nonzero()[0]
    stops, of = np.concatenate((starts[1:], [code.size])), new.cumsum() - 1
    drops = (code != 0) & (a.last_saver[node] < node[stops - 1][of] + 1)
    return Runs(starts, stops, of, drops)


NO_REGION_INPUTS: tuple[Array, Array] = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def held_end(
    a: NodeArrays, layout: Layout, runs: Runs | None, stashed: tuple[Array, Array] = NO_REGION_INPUTS
) -> Array:
    """Per position of ``layout``, the last node before which what its node holds is kept or
    freed: the node keeping it first, unless that one's stash is recomputed or swapped and so
    dropped (a node of the stage drops it only if no later node of its run keeps it on);
    then the last node reading it, or the first of a recomputed region keeping it as an input
    (``stashed``: positions of storages and those nodes, from :func:`regions_inputs`). A
    stage runs each run of one policy (``runs``; ``None``: all kept) as one call, which holds
    its arguments until it returns: a value read by a later run lives until that run's last
    node."""
    node, hi = layout.node, layout.hi
    end: Array = a.held_end[node]
    if runs is None:
        return end
    by = a.held_by[node]
    dropped = (by >= 0) & (layout.codes[layout.row, by] != 0)
    inside = (dropped & (by < hi)).nonzero()[0]
    keeper = inside + by[inside] - node[inside]  # its position, in the row
    dropped[inside] = runs.drops[keeper]
    end = np.where(dropped, a.held_until[node], end)
    end = until_run_returns(layout, runs, end, ((by < 0) | dropped) & (end < hi))  # freed once read, not stashed
    storages, since = stashed
    np.minimum.at(end, storages, since)
    return end


def until_run_returns(
    layout: Layout, runs: Runs, end: Array, read: "np.ndarray[tuple[int], np.dtype[np.bool_]]"
) -> Array:
    """``end`` (per position, the last node reading its node's value) where the value is
    ``read`` by a later run of the stage: that run's last node (a run is one call, holding its
    arguments until it returns)."""
    node, hi = layout.node, layout.hi
    run = runs.of[np.arange(node.size) + np.minimum(end, hi - 1) - node]
    return np.where(read & (run != runs.of), node[runs.stops[run] - 1], end)
