"""Recomputed regions: what a maximal run of recomputed nodes keeps, and what running it again holds.

A region stashes only the storages of the values it reads from outside itself (unless another
node keeps them as long); before its last node's backward it runs its forward again, holding
its stash as it is made again, the values it passes between its nodes, and each node's workspace.
"""

import numpy as np

from lightning_pipe.plan.layout import Layout, Runs
from lightning_pipe.plan.nodes import Array, NodeArrays

__all__ = ["recomputed_regions", "recomputing", "regions_inputs"]


def recomputing(
    a: NodeArrays, layout: Layout, starts: Array, stops: Array, regions: tuple[Array, Array],
    made_again: Array,
) -> Array:
    """Per recomputed region (positions ``[starts[k], stops[k])`` of ``layout``; ``regions``:
    their :meth:`Layout.regions`), what its forward run again, before its last node's backward,
    holds beyond what that backward is priced at (its stash back whole, its workspace and
    fresh parameter gradients): at each node the stash made again so far, the values of
    earlier nodes of the region still to be read in it (or returned, read after it), and what
    the node makes and its workspace (an attention's scores, read and freed in the region)."""
    node = layout.node
    at, region = regions
    position = np.arange(node.size)
    rebuilt = np.concatenate(([0], made_again.cumsum()))
    k = region.nonzero()[0]
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
        saving = np.maximum.reduceat(np.where(a.saved[node[k]] > 0, k, -1), k.searchsorted(starts))
        last[returned] = np.maximum(last[returned], saving[at[returned]])
    saver = k + a.held_by[node[k]] - node[k]  # the position of the node keeping it (of its row)
    ends = np.where((saver > k) & (saver < stops[at[k]]), saver, last[k])
    held = np.zeros(node.size + 1, dtype=np.int64)
    alive = ends > k
    np.add.at(held, k[alive] + 1, a.held[node[k[alive]]])
    np.add.at(held, ends[alive] + 1, -a.held[node[k[alive]]])
    running = np.where(region, rebuilt[:-1] - rebuilt[starts[np.maximum(at, 0)]] + held.cumsum()[:-1]
                       + a.made[node] + a.workspace[node], 0)
    peak = np.maximum.reduceat(running, starts)
    priced = rebuilt[stops] - rebuilt[starts] + a.backward[final] + a.fresh[final]
    extra: Array = np.maximum(0, peak - priced)
    return extra


def recomputed_regions(a: NodeArrays, layout: Layout, runs: Runs) -> tuple[Array, Array]:
    """Start and stop positions of each recomputed region of ``layout`` that saves something."""
    region = (layout.code[runs.starts] == 1) & (np.add.reduceat(a.saved[layout.node], runs.starts) > 0)
    return runs.starts[region], runs.stops[region]


def regions_inputs(
    a: NodeArrays, layout: Layout, starts: Array, stops: Array, regions: tuple[Array, Array] | None = None
) -> tuple[Array, Array, Array]:
    """Per recomputed region (positions ``[starts[k], stops[k])`` of ``layout``, in order,
    each saving something; ``regions``: their :meth:`Layout.regions`), what it keeps: the
    storages of the values it reads from outside itself that no other node keeps as long (see
    :meth:`~lightning_pipe.plan.memory.CostModel.region_inputs`). A storage counts at the first
    region of its row reading it; the graph input never (a micro-batch is a view of the training
    batch, which the last stage holds). Also the positions of the storages the stage makes that
    the regions keep of the values their makers hold, and the first node of the region keeping
    each: from there on they are its stash, no longer held."""
    lo, hi = layout.lo, layout.hi
    totals = np.zeros(starts.size, dtype=np.int64)
    reader, read, storage = layout.reads(a)
    at, inside = layout.regions(starts, stops) if regions is None else regions
    region = at[reader]
    start, stop = layout.node[starts], layout.node[stops - 1] + 1
    outside = inside[reader] & (read < start[region])
    row = layout.row[reader[outside]]
    # each storage's first read in its row (reads are in position order), as np.unique's return_index
    keys = row * a.n + storage[outside]
    order = keys.argsort(kind="stable")
    ordered = keys[order]
    new = np.ones(keys.size, dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    first = order[new]
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
