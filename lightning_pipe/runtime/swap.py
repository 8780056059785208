"""Swap: keep the tensors autograd saves in host memory until backward needs them.

Inside :func:`to_host`, every tensor autograd saves that was made inside (not the region's
inputs or parameters, which live on anyway) is copied to a host buffer and the device copy
is dropped; backward copies it back. Both copies run on the device's side stream
(:mod:`lightning_pipe.stream`; on the CPU they are plain copies), and :func:`prefetch` starts
the copy back when the backward of what follows the segment begins, so that it overlaps
that backward, as the planner's cost model assumes. Host buffers (pinned on CUDA) come from
:data:`pool`. The meter charges them to no stage: they are not device memory.
"""

import threading
from collections import Counter
from collections.abc import Callable, MutableMapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from lightning_pipe.internals import outer_saved_tensors_hooks, tree_flatten, view_base
from lightning_pipe.measure.meter import not_charged
from lightning_pipe.stream import (
    AbstractEvent,
    AbstractStream,
    current_stream,
    record_event,
    record_stream,
    side_stream,
    use_stream,
    wait_event,
    wait_stream,
)

__all__ = ["HostPool", "Swapped", "pool", "prefetch", "to_host"]

Key = tuple[int, torch.dtype, bool]  # a host buffer's elements, dtype and whether it is pinned


class HostPool:
    """Host buffers for swapped tensors, kept for reuse (pinning memory is slow).

    Whenever every buffer is back (after each step's backward at the latest), the pool keeps
    of each size only as many as were out at once since the last such time and releases the
    rest: it holds at most what one step needs at once, and sizes a step no longer uses
    (a sequence length that changed) do not pile up.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device  # where its buffers are made (None: host memory); meta for a fake run's
        self._free: dict[Key, list[tuple[Tensor, AbstractEvent]]] = {}
        self._out: Counter[Key] = Counter()
        self._peak: Counter[Key] = Counter()
        self._lock = threading.Lock()  # CUDA backward frees saved tensors on one thread per device

    def take(self, key: Key, stream: AbstractStream) -> Tensor:
        """A buffer that ``stream`` may write once it is done with its last copy."""
        with self._lock:
            self._out[key] += 1
            self._peak[key] = max(self._peak[key], self._out[key])
            free = self._free.get(key)
            reused = free.pop() if free else None
        if reused is None:
            numel, dtype, pinned = key
            with not_charged():
                return torch.empty(numel, dtype=dtype, pin_memory=pinned, device=self.device)
        buffer, last_copy = reused
        wait_event(stream, last_copy)
        return buffer

    def give(self, key: Key, buffer: Tensor, last_copy: AbstractEvent) -> None:
        """Take back ``buffer``, in use by copies until ``last_copy``."""
        with self._lock:
            self._free.setdefault(key, []).append((buffer, last_copy))
            self._out[key] -= 1
            if sum(self._out.values()) == 0:
                for k, free in list(self._free.items()):
                    del free[self._peak[k] :]
                    if not free:
                        del self._free[k]
                self._out.clear()
                self._peak.clear()

    def nbytes(self) -> int:
        """Bytes of the buffers kept for reuse."""
        with self._lock:
            return sum(b.numel() * b.element_size() for free in self._free.values() for b, _ in free)


pool = HostPool()


class Swapped:
    """A saved tensor's whole storage living in host memory, with what it takes to bring it
    back; every view autograd saved of that storage shares it."""

    def __init__(self, tensor: Tensor) -> None:
        self.device = tensor.device
        flat = tensor.as_strided((tensor.untyped_storage().nbytes() // tensor.element_size(),), (1,), 0)
        self.key: Key = (flat.numel(), flat.dtype, self.device.type == "cuda")
        side = side_stream(self.device)
        self.pool = pool  # the buffer goes back where it came from, whichever pool is current then
        self.host = self.pool.take(self.key, side)
        wait_stream(side, current_stream(self.device))  # the tensor is written on the compute stream
        with use_stream(side):
            self.host.copy_(flat, non_blocking=True)
        record_stream(flat, side)  # keep the device memory until the copy has read it
        self.event = record_event(side)  # the last copy touching the host buffer
        self.views = 0  # saved views still to be loaded; the device copy goes with the last
        self.loaded: Tensor | None = None
        self.nbytes = flat.numel() * flat.element_size()

    def prefetch(self) -> None:
        """Start copying back to the device, on its side stream."""
        if self.loaded is not None:
            return
        side = side_stream(self.device)
        with use_stream(side):
            # Allocated on the stream that writes it: memory freed on the compute stream may
            # still be read there by kernels queued before.
            self.loaded = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
            self.loaded.copy_(self.host, non_blocking=True)
        self.event = record_event(side)

    def load(self, like: "_View") -> Tensor:
        """The view ``like`` of the storage, back on its device."""
        self.prefetch()
        assert self.loaded is not None
        compute = current_stream(self.device)
        wait_event(compute, self.event)
        record_stream(self.loaded, compute)  # the compute stream uses it from now on
        view = self.loaded.as_strided(like.shape, like.stride, like.offset)
        self.views -= 1
        if self.views == 0:
            self.loaded = None  # the views handed out keep the memory while backward uses them
        return view

    def __del__(self) -> None:
        self.pool.give(self.key, self.host, self.event)


class _View(NamedTuple):
    storage: Swapped
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Kept(NamedTuple):
    """A saved tensor left on the device, packed by the hooks the segment runs inside."""

    packed: Any
    unpack: Callable[[Any], Tensor]


class _Hooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, inputs: Any) -> None:
        self.swapped: list[Swapped] = []
        # storage -> its one host copy, however many views
        self._by_storage: MutableMapping[torch.UntypedStorage, Swapped] = WeakIdKeyDictionary()
        # Inputs live on outside the segment; a host copy of them would free nothing.
        self.inputs = {id(t.untyped_storage()) for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)}
        # What stays on the device goes through the enclosing hooks (the memory meter's).
        self._outer = outer_saved_tensors_hooks()
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> Any:
        parameter = isinstance(t, torch.nn.Parameter) or isinstance(view_base(t), torch.nn.Parameter)  # W.t() in linear
        if parameter or id(t.untyped_storage()) in self.inputs:
            return t if self._outer is None else _Kept(self._outer[0](t), self._outer[1])
        storage = t.untyped_storage()
        stored = self._by_storage.get(storage)
        if stored is None:
            with not_charged():
                stored = self._by_storage[storage] = Swapped(t)
            self.swapped.append(stored)
        stored.views += 1
        return _View(stored, t.shape, t.stride(), int(t.storage_offset()))

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        if isinstance(packed, _Kept):
            return packed.unpack(packed.packed)
        return packed.storage.load(packed) if isinstance(packed, _View) else packed


def to_host(inputs: Any = ()) -> _Hooks:
    """A context in which autograd saves the tensors made inside it (not ``inputs``, nor
    parameters) to host memory; its ``swapped`` list holds what was sent, for :func:`prefetch`."""
    return _Hooks(inputs)


def prefetch(when: Any, swapped: list[Swapped]) -> None:
    """Start loading ``swapped`` back as soon as backward reaches any tensor of ``when``
    (what was computed after them, so that the copies overlap its backward)."""
    if not swapped:
        return
    pending = list(swapped)

    def start(grad_outputs: Any) -> None:
        for s in pending:
            s.prefetch()
        pending.clear()  # the autograd graph outlives this hook; do not keep the copies alive

    for t in tree_flatten(when)[0]:
        if isinstance(t, Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(start)
