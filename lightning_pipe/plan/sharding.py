"""Pipeline x FSDP: what sharding each stage over its data-parallel replicas saves and costs.

With ``data_parallel="fsdp"`` every stage is split by FSDP2 (``fully_shard``) over its ``R``
replicas: a rank holds ``1/R`` of the stage's parameters, gradients and optimizer state, and
all-gathers a *unit*'s parameters whole around its use. Units are the stage's blocks (nodes
named alike up to their first layer index, ``model_layers_3``), each its own ``fully_shard``;
the stage's other parameters (embeddings, final norm, head) belong to the stage's own unit,
which FSDP2 keeps gathered from its forward to its backward. A stage whose parameters gather in
one gradient bucket's bytes or less is one unit.

The runtime, ``torch.distributed.pipelining``, runs every backward of a step without
reducing: ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``
(``backward_maybe_with_nosync``), then at the step's end resharding each unit and
reduce-scattering its gradients (``perform_reduce_grad``). So from a unit's first backward to
the step's end it holds its parameters gathered and its gradients unsharded, accumulated in
the reduce dtype (fp32 under bf16-mixed): near a step's last backward a rank holds its whole
stage gathered and every gradient of it whole, as DDP would, whatever is chosen; sharding
saves the parameters' and optimizer state's share between steps and in the forwards.
Per stage the planner chooses ``reshard_after_forward``:

- ``True`` (memory): a forward gathers each block and frees it after (1F1B's forwards after a
  backward find the blocks gathered by it, and free them), a backward gathers them again:
  about one all-gather per micro-batch; the warm-up forwards hold one block at a time.
- ``False`` (time): the stage stays gathered from its first forward to the step's end: one
  all-gather per step.

Either way, one reduce-scatter per step.

The planned profile is a rank's: parameters, gradients, optimizer state and the step's
temporaries divided by the replicas; :meth:`Sharding.gathered_bytes` adds what is gathered at
each peak, as FSDP2 allocates it (the last all-gather's output kept until the next one in
forward, the last reduce-scatter's input until the next one). Under mixed
precision (the profile holds autocast's copies, ``cast_bytes``) FSDP2 gathers in the compute
dtype, half the bytes, and reduces in fp32; autocast then makes no copies, so the planned
profile drops them. Collectives are priced by the link bandwidth as a ring, ``(R - 1) / R``
of the bytes each way, added to the stage's forward and backward time (not overlapped: an
upper bound).
"""

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from lightning_pipe.plan.nodes import Array
from lightning_pipe.plan.profile import NodeProfile, Profile, block_of
from lightning_pipe.plan.schedule import GRADIENT_BUCKET_BYTES

if TYPE_CHECKING:
    from lightning_pipe.plan.optimize import StageOptimum
    from lightning_pipe.plan.stages import Stages

__all__ = ["DATA_PARALLEL", "DataParallel", "Sharding", "choose_resharding"]

DataParallel = Literal["ddp", "fsdp"]
DATA_PARALLEL: tuple[DataParallel, ...] = ("ddp", "fsdp")

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
    ``reshard_after_forward`` (one value: every node's; by default kept gathered)."""

    def __init__(
        self, profile: Profile, replicas: int, chunks: int, link_bandwidth: float | None,
        resharded: bool | Sequence[bool] = False, *, accumulates_in_forward: bool = True,
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
        mixed precision (the gathered parameters are in the compute dtype already); the
        gradients a backward makes before adding them are whole (in the compute dtype)."""
        grads, cast = self.held(node.grad_bytes), node.cast_bytes if self.mixed else 0
        fresh = node.grad_bytes if node.fresh_grad_bytes is None else node.fresh_grad_bytes
        return replace(
            node, param_bytes=self.held(node.param_bytes), grad_bytes=grads, optimizer_bytes=self.held(
                node.optimizer_bytes), step_bytes=self.held(node.step_bytes),
            backward_bytes=max(0, node.backward_bytes - node.grad_bytes) + grads,
            fresh_grad_bytes=fresh // 2 if self.mixed else fresh,
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
        """Bytes a stage on ``[lo, hi)`` holds gathered beyond its shards, as
        ``torch.distributed.pipelining`` drives FSDP2: every backward of a step runs with
        ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``, so a
        unit's parameters stay gathered and its unsharded gradients (in the reduce dtype,
        fp32) accumulate from its first backward to the step's end, when each unit in turn is
        resharded and reduce-scattered (its gradients copied into one flat input, kept until
        the next unit's; its output the sharded gradients). Returns the bytes at the forward
        peak (1F1B's forwards after a backward hold the step's gradients), at a step's later
        backwards and its end (the whole stage gathered, every gradient, the reductions), and
        at its first backward net of the sharded gradients the profile makes there (that
        backward's peak, priced from the rank's profile, holds them: here they are added as far
        as the backward has gone, where what is gathered peaks)."""
        found, r = self.stage(lo, hi), self.replicas
        # the stage's own unit, gathered from its forward to its backward, and the block units
        # (a stage of one unit: that unit alone)
        (own, own_grads), units = (found.own, found.units) if found.units else ((0, 0), ((lo, hi, *found.own),))
        made = np.concatenate(([0], np.cumsum(self.grads[lo:hi][::-1])))  # [k]: of the last k nodes
        sharded = self.held(int(made[-1]))
        params = own + sum(u[2] for u in units)
        grads = own_grads + sum(u[3] for u in units)
        cast = 1 if self.mixed else 0  # a micro-batch's gradients come in the compute dtype, then are added

        def after(stop: int) -> int:  # sharded gradients a backward made before a unit ending at stop
            return self.held(int(made[hi - stop]))

        # the reductions, the stage's own unit first: each unit resharded, its gradients copied flat,
        # the flat input of the unit before still held, the sharded outputs so far
        reduce = gathered = params + grads
        retained = outputs = 0
        for unit, h in [(own, own_grads), *((u[2], u[3]) for u in units)]:
            gathered -= unit
            reduce = max(reduce, gathered + h + retained + outputs)
            gathered, retained, outputs = gathered - h, h, outputs + math.ceil(h / r)
        if not found.units or not self.resharded[lo]:
            forward = params
            later = max(params + grads + cast * max(u[2] for u in units), reduce)
            # the first backward: the stage gathered, the gradients made so far, unit by unit
            first = max(params + own_grads + sum(v[3] for v in units if v[1] >= stop) + cast * g
                        + after(stop) for _, stop, g, _ in units)
        else:
            # an all-gather's output (its input is a slice of it), the last one's kept until then
            forward = own + max(before + g for before, (_, _, g, _) in zip([0, *(u[2] for u in units)], units))
            # backward, last block first, each gathered again (the forward freed it) and kept: at
            # each all-gather, the blocks after it, the last all-gather's output, its own, and the
            # gradients (a later backward: all of them; the first: those made so far)
            later = first = 0
            for k, (_, stop, g, _) in reversed(list(enumerate(units))):
                after_k = units[k + 1:]
                kept = after_k[0][2] if after_k else 0
                gathered = own + sum(v[2] for v in after_k) + kept + g
                later = max(later, gathered + grads)
                first = max(first, gathered + own_grads + sum(v[3] for v in after_k) + after(stop))
            later = max(later, reduce)
        later -= sharded
        first -= sharded
        if self.chunks == 1:  # the first backward is the last: the reductions follow it
            first = max(first, later)
        held = grads if self.accumulates_in_forward else 0
        return forward + held, later, first

    def collective_ms(self) -> tuple[list[float], list[float]]:
        """Per node, the milliseconds its all-gathers and reduce-scatters add to each
        micro-batch's forward and backward. Resharded after forward: a forward gathers the
        block (GPipe's every forward; 1F1B's find it gathered by the backward before and free
        it), and a backward gathers it again, then keeps it: about one all-gather a micro-batch
        and one more a step. Kept gathered: one all-gather a step. Either way the gradients
        are reduce-scattered once a step. A step's once is spread over its micro-batches."""
        if not self.link_bandwidth or self.replicas == 1:
            zero = [0.0] * len(self.gathered)
            return zero, list(zero)
        per_byte = 1e3 * (self.replicas - 1) / self.replicas / self.link_bandwidth
        once = self.gathered / self.chunks
        forward = np.where(self.resharded, self.gathered, once) * per_byte
        backward = (np.where(self.resharded, once, 0) + self.grads / self.chunks) * per_byte
        return forward.tolist(), backward.tolist()


def choose_resharding(
    stages: "Stages", balance: Sequence[int], optima: "list[StageOptimum]", planned: Callable[[Sharding], "Stages"],
) -> "tuple[Stages, list[StageOptimum]]":
    """Each stage's ``reshard_after_forward``: ``stages`` price ``balance`` kept gathered (one
    all-gather a step; as pipelining keeps every block gathered from its first backward on,
    resharding after forward rarely lowers a peak, and gathering again raises the later
    backwards'); a stage reshards instead where it fits only so, or fits so in less time
    (where kept gathered it recomputes more than the all-gathers cost). ``planned``: the
    stages of a sharding. Returns the stages of the choice and their optima (``stages``' own
    where no stage gains)."""
    sharding = stages.model.sharding
    assert sharding is not None
    resharded = planned(sharding.with_resharded(balance, [True] * len(balance)))
    again = resharded.pruned(balance)

    def busy(found: "Stages") -> list[float]:
        return [t.forward + t.backward + t.recompute + t.swap for t in found.times(balance)]

    choice = [a.fits and (not k.fits or r < g) for k, a, g, r in zip(optima, again, busy(stages), busy(resharded))]
    if not any(choice):
        return stages, optima
    if all(choice):
        return resharded, again
    mixed = planned(sharding.with_resharded(balance, choice))
    return mixed, mixed.pruned(balance)
