"""Pipeline x FSDP: what sharding each stage over its data-parallel replicas saves and costs.

With ``data_parallel="fsdp"`` every stage is split by FSDP2 (``fully_shard``) over its ``R``
replicas: a rank holds ``1/R`` of the stage's parameters, gradients and optimizer state, and
all-gathers a *unit*'s parameters whole around its use. Units are the stage's blocks (nodes
named alike up to their first layer index, ``model_layers_3``), each its own ``fully_shard``;
the stage's other parameters (embeddings, final norm, head) belong to the stage's own unit,
which FSDP2 keeps gathered from its forward to its backward. A stage whose parameters gather in
one gradient bucket's bytes or less is one unit. Per stage the planner chooses
``reshard_after_forward``:

- ``True`` (memory): every micro-batch all-gathers each block before its forward and again
  before its backward (the block before it prefetched), frees it after each, and
  reduce-scatters its gradients after its backward.
- ``False`` (time): the stage stays gathered from its first forward to the step's last backward
  and its gradients accumulate unsharded (FSDP2's ``set_requires_gradient_sync(False)`` and
  ``set_reshard_after_backward(False)`` but at the last micro-batch), reduce-scattered once by
  that backward: one all-gather and one reduce-scatter per step.

The planned profile is a rank's: parameters, gradients, optimizer state and the step's
temporaries divided by the replicas; :meth:`Sharding.gathered_bytes` adds what is gathered at
each peak, as FSDP2 allocates it (the last all-gather's output kept until the next one in
forward, the last reduce-scatter's input until the next one in backward). Under mixed
precision (the profile holds autocast's copies, ``cast_bytes``) FSDP2 gathers in the compute
dtype, half the bytes, and reduces in fp32; autocast then makes no copies, so the planned
profile drops them. Collectives are priced by the link bandwidth as a ring, ``(R - 1) / R``
of the bytes each way, added to the stage's forward and backward time (not overlapped: an
upper bound).
"""

import copy
import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from lightning_pipe.plan.nodes import Array
from lightning_pipe.plan.profile import NodeProfile, Profile
from lightning_pipe.plan.schedule import GRADIENT_BUCKET_BYTES

if TYPE_CHECKING:
    from lightning_pipe.plan.optimize import StageOptimum
    from lightning_pipe.plan.stages import Stages

__all__ = ["DATA_PARALLEL", "DataParallel", "Sharding", "block_of", "choose_resharding"]

DataParallel = Literal["ddp", "fsdp"]
DATA_PARALLEL: tuple[DataParallel, ...] = ("ddp", "fsdp")

_BLOCK = re.compile(r"^(.*?_\d+)_")  # a node name's prefix up to its first layer index


def block_of(name: str) -> str | None:
    """The block a node belongs to by its name (``model_layers_3_mlp_up_proj`` ->
    ``model_layers_3``); ``None``: none (``add_1``'s index only tells apart nodes alike)."""
    match = _BLOCK.match(name)
    return match.group(1) if match else None


@dataclass(frozen=True)
class _Stage:
    """One stage's FSDP bytes: its own unit's gathered parameters and fp32 gradients, and per
    block unit, in order, its node range and those bytes."""

    own: tuple[int, int]
    units: tuple[tuple[int, int, int, int], ...]  # (start, stop, gathered, gradients)


class Sharding:
    """A profile's FSDP costs per node range, for :class:`~lightning_pipe.plan.memory.CostModel`:
    the bytes a rank holds sharded, the bytes gathered at a stage's forward and backward peaks,
    and each node's collective milliseconds. ``resharded``: per node, its stage's
    ``reshard_after_forward`` (one value: every node's)."""

    def __init__(
        self, profile: Profile, replicas: int, chunks: int, link_bandwidth: float | None,
        resharded: bool | Sequence[bool] = True, *, accumulates_in_forward: bool = True,
    ) -> None:
        nodes = profile.nodes
        self.source = profile
        self.replicas, self.chunks, self.link_bandwidth = replicas, chunks, link_bandwidth
        self.mixed = any(n.cast_bytes for n in nodes)  # gathered in the compute dtype, half the bytes
        self.profile = replace(profile, nodes=[self._shard(n) for n in nodes])
        count = len(nodes)
        self.gathered: Array = np.array([n.param_bytes // 2 if self.mixed else n.param_bytes for n in nodes],
                                        dtype=np.int64)
        self.grads: Array = np.array([n.grad_bytes for n in nodes], dtype=np.int64)
        self.resharded = np.full(count, resharded, dtype=bool) if isinstance(resharded, bool) else np.array(
            resharded, dtype=bool)
        keys = [block_of(n.name) if n.param_bytes else None for n in nodes]
        ids = {k: i for i, k in enumerate(dict.fromkeys(k for k in keys if k is not None))}
        self.block: Array = np.array([-1 if k is None else ids[k] for k in keys], dtype=np.int64)
        # grads accumulate unsharded while later forwards run (1F1B); GPipe's forwards come first
        self.accumulates_in_forward = accumulates_in_forward and chunks > 1
        self._stages: dict[tuple[int, int], _Stage] = {}
        self._gathered: dict[tuple[int, int, bool], tuple[int, int, int]] = {}

    def with_resharded(self, balance: Sequence[int], choice: Sequence[bool]) -> "Sharding":
        """This sharding with stage ``s`` of ``balance`` resharding after forward as ``choice[s]``."""
        other = copy.copy(self)  # (units and what a range gathers, by its choice, are the same: caches shared)
        other.resharded = np.repeat(np.array(choice, dtype=bool), balance)
        return other

    def held(self, nbytes: int) -> int:
        """A rank's share of ``nbytes`` sharded over the replicas."""
        return -(-nbytes // self.replicas)

    def _shard(self, node: NodeProfile) -> NodeProfile:
        """``node`` as one rank holds it: its parameters, gradients (those its backward adds
        too), optimizer state and the step's temporaries sharded, and no autocast copies under
        mixed precision (the gathered parameters are in the compute dtype already)."""
        grads, cast = self.held(node.grad_bytes), node.cast_bytes if self.mixed else 0
        return replace(
            node, param_bytes=self.held(node.param_bytes), grad_bytes=grads, optimizer_bytes=self.held(
                node.optimizer_bytes), step_bytes=self.held(node.step_bytes),
            backward_bytes=max(0, node.backward_bytes - node.grad_bytes) + grads,
            fresh_grad_bytes=None if node.fresh_grad_bytes is None else self.held(node.fresh_grad_bytes),
            saved_bytes=node.saved_bytes - cast, made_bytes=max(0, node.made_bytes - cast),
            cast_bytes=node.cast_bytes - cast)

    def stage(self, lo: int, hi: int) -> _Stage:
        """The units of a stage on nodes ``[lo, hi)`` (cached)."""
        if (found := self._stages.get((lo, hi))) is None:
            gathered, grads, block = self.gathered[lo:hi], self.grads[lo:hi], self.block[lo:hi]
            if int(gathered.sum()) <= GRADIENT_BUCKET_BYTES or not (block >= 0).any():
                found = _Stage((int(gathered.sum()), int(grads.sum())), ())
            else:
                own = block < 0
                at = np.flatnonzero(~own)
                ids, first, inverse = np.unique(block[at], return_index=True, return_inverse=True)
                last = np.zeros(ids.size, dtype=np.int64)
                np.maximum.at(last, inverse, at)
                sums = [np.bincount(inverse, weights=v[at], minlength=ids.size) for v in (gathered, grads)]
                units = sorted((lo + int(at[f]), lo + int(e) + 1, int(g), int(h))
                               for f, e, g, h in zip(first, last, *sums))
                found = _Stage((int(gathered[own].sum()), int(grads[own].sum())), tuple(units))
            self._stages[lo, hi] = found
        return found

    def units(self, lo: int, hi: int) -> list[list[int]]:
        """The node ranges ``[start, stop)`` of a stage's block units (none: the stage is one)."""
        return [[start, stop] for start, stop, _, _ in self.stage(lo, hi).units]

    def gathered_bytes(self, lo: int, hi: int) -> tuple[int, int, int]:
        """:meth:`_gathered_bytes` (cached: a search prices one range many times)."""
        key = (lo, hi, bool(self.resharded[lo]))
        if (found := self._gathered.get(key)) is None:
            found = self._gathered[key] = self._gathered_bytes(lo, hi)
        return found

    def _gathered_bytes(self, lo: int, hi: int) -> tuple[int, int, int]:
        """Bytes a stage on ``[lo, hi)`` holds gathered beyond its shards: unsharded parameters,
        unsharded gradients, the reduce-scatter's input and output and the all-gathers in flight
        (their sharded input beside their output). At its forward peak, at a step's later
        backwards, and at its first backward net of the sharded gradients it makes (that
        backward's peak, priced from the rank's profile, holds all of them: here they are
        added as far as the backward has gone, where what is gathered peaks)."""
        found, r = self.stage(lo, hi), self.replicas
        # the stage's own unit, gathered from its forward to its backward, and the block units
        # (a stage of one unit: that unit alone)
        (own, own_grads), units = (found.own, found.units) if found.units else ((0, 0), ((lo, hi, *found.own),))
        made = np.concatenate(([0], np.cumsum(self.grads[lo:hi][::-1])))  # [k]: of the last k nodes
        sharded = self.held(int(made[-1]))

        def reduced(gathered: int, grads: int, retained: int) -> int:
            """At a unit's backward: its gathered parameters and fresh gradients with the last
            unit's reduce-scatter input (kept until the next reduce-scatter), or its fresh
            gradients with its reduce-scatter's input and output."""
            return max(2 * gathered + retained, gathered + grads + math.ceil(grads / r))

        def after(stop: int) -> int:  # sharded gradients a backward made before a unit ending at stop
            return self.held(int(made[hi - stop]))

        if not found.units or not self.resharded[lo]:
            params = own + sum(u[2] for u in units)
            grads = own_grads + sum(u[3] for u in units)
            held = grads if self.accumulates_in_forward else 0
            later = params + held + max(reduced(u[2], u[3], u[3]) - u[2] for u in units)
            if self.chunks > 1:  # the first backward is not the step's last: it only accumulates
                return params + held, later, params + grads - sharded
            # the step's last backward reshards each unit and reduces its gradients once done with it
            gathered = list(itertools.accumulate(u[2] for u in units))
            first, retained = 0, 0
            for g, (_, stop, unit, h) in zip(reversed(gathered), reversed(units)):
                first = max(first, own + own_grads + g - unit + reduced(unit, h, retained) + after(stop))
                retained = h
            return params + held, later, first - sharded
        # an all-gather's input and output, the last one's output (kept until then), or it copied out
        forward = own + max(max(before + g + math.ceil(g / r), 2 * g)
                            for before, (_, _, g, _) in zip([0, *(u[2] for u in units)], units))
        later = first = retained = 0
        # backward, last block first: the block before prefetched (its input and output) while one runs
        for before, (_, stop, g, h) in reversed(list(zip([0, *(u[2] for u in units)], units))):
            here = before + math.ceil(before / r) + reduced(g, h, retained)
            later, first, retained = max(later, here), max(first, here + after(stop)), h
        return forward, own + own_grads + later, own + own_grads + first - sharded

    def collective_ms(self) -> tuple[list[float], list[float]]:
        """Per node, the milliseconds its all-gathers and reduce-scatters add to each
        micro-batch's forward and backward (a step's once, spread over its micro-batches,
        where its stage is not resharded after forward)."""
        if not self.link_bandwidth or self.replicas == 1:
            zero = [0.0] * len(self.gathered)
            return zero, list(zero)
        per_byte = 1e3 * (self.replicas - 1) / self.replicas / self.link_bandwidth
        block = self.block >= 0
        forward = np.where(self.resharded, self.gathered, self.gathered / self.chunks) * per_byte
        backward = np.where(self.resharded, np.where(block, self.gathered, 0) + self.grads,
                            self.grads / self.chunks) * per_byte
        return forward.tolist(), backward.tolist()


def choose_resharding(
    stages: "Stages", balance: Sequence[int], optima: "list[StageOptimum]", planned: Callable[[Sharding], "Stages"],
) -> "tuple[Stages, list[StageOptimum]]":
    """Each stage's ``reshard_after_forward``: ``stages`` price ``balance`` resharded (least
    memory); a stage keeps its parameters gathered instead where it fits so and takes less
    time (one all-gather per step against two per micro-batch, against any recompute the
    memory costs). ``planned``: the stages of a sharding. Returns the stages of the choice and
    their optima (``stages``' own where the mixed choice does not fit)."""
    sharding = stages.model.sharding
    assert sharding is not None
    gathered = planned(sharding.with_resharded(balance, [False] * len(balance)))
    kept = gathered.pruned(balance)

    def busy(found: "Stages") -> list[float]:
        return [t.forward + t.backward + t.recompute + t.swap for t in found.times(balance)]

    choice = [not (k.fits and g < r) for k, g, r in zip(kept, busy(gathered), busy(stages))]
    if all(choice):
        return stages, optima
    if not any(choice):
        return gathered, kept
    mixed = planned(sharding.with_resharded(balance, choice))
    placed = mixed.pruned(balance)
    return (mixed, placed) if all(o.fits for o in placed) else (stages, optima)
