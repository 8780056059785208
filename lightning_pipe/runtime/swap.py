"""Swap: keep the tensors autograd saves in host memory until backward needs them.

Inside :func:`to_host`, every tensor autograd saves that was made inside (not the region's
inputs or parameters, which live on anyway) is copied to a host buffer and the device copy
is dropped; backward copies it back. On CUDA the
host buffers are pinned and reused from a pool, both copies run on a side stream, and
:func:`prefetch` starts the copies back as soon as a segment's backward begins. The host
buffers are not charged to any stage by the meter: they are not device memory.
"""

from collections import defaultdict
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from lightning_pipe.measure.meter import not_charged

__all__ = ["Swapped", "prefetch", "to_host"]

_streams: dict[torch.device, "torch.cuda.Stream"] = {}
_pool: dict[tuple, list[tuple[Tensor, Any | None]]] = defaultdict(list)  # reusable host buffers


class Swapped:
    """A saved tensor's whole storage living in host memory, with what it takes to bring it
    back; every view autograd saved of that storage shares it."""

    def __init__(self, tensor: Tensor) -> None:
        self.device = tensor.device
        flat = tensor.as_strided((tensor.untyped_storage().nbytes() // tensor.element_size(),), (1,), 0)
        self.key = (flat.numel(), flat.dtype, self.device.type == "cuda")
        self.host = _host_buffer(self.key)
        self.event: Any | None = None
        self.views = 0  # saved views still to be loaded; the device copy goes with the last
        self.loaded: Tensor | None = None
        self.loaded_event: Any | None = None
        if self.device.type == "cuda":
            stream = _stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.host.copy_(flat, non_blocking=True)
            flat.record_stream(stream)  # keep the device memory until the copy has read it
            self.event = stream.record_event()
        else:
            self.host.copy_(flat)
        self.nbytes = flat.numel() * flat.element_size()

    def prefetch(self) -> None:
        """Start copying back to the device (on CUDA, on the side stream)."""
        if self.loaded is not None:
            return
        self.loaded = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        if self.device.type == "cuda":
            stream = _stream(self.device)
            with torch.cuda.stream(stream):
                stream.wait_event(self.event)
                self.loaded.copy_(self.host, non_blocking=True)
            self.loaded_event = stream.record_event()
        else:
            self.loaded.copy_(self.host)

    def load(self, like: "_View") -> Tensor:
        """The view ``like`` of the storage, back on its device."""
        self.prefetch()
        assert self.loaded is not None
        if self.loaded_event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.loaded_event)
            self.loaded.record_stream(current)
        view = self.loaded.as_strided(like.shape, like.stride, like.offset)
        self.views -= 1
        if self.views == 0:
            self.loaded = None  # the views handed out keep the memory while backward uses them
        return view

    def __del__(self) -> None:
        _pool[self.key].append((self.host, self.loaded_event or self.event))


def _host_buffer(key: tuple) -> Tensor:
    free = _pool[key]
    if free:
        buffer, event = free.pop()
        if event is not None:
            event.synchronize()  # its last copy must be done before reuse
        return buffer
    numel, dtype, pinned = key
    with not_charged():
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)


def _stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class _View(NamedTuple):
    storage: Swapped
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Hooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, inputs: Any) -> None:
        self.swapped: list[Swapped] = []
        self._by_storage = WeakIdKeyDictionary()  # storage -> its one host copy, however many views
        # Inputs live on outside the segment; a host copy of them would free nothing.
        self.inputs = {id(t.untyped_storage()) for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)}
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta" or id(t.untyped_storage()) in self.inputs:
            return t
        storage = t.untyped_storage()
        stored = self._by_storage.get(storage)
        if stored is None:
            with not_charged():
                stored = self._by_storage[storage] = Swapped(t)
            self.swapped.append(stored)
        stored.views += 1
        return _View(stored, t.shape, t.stride(), t.storage_offset())

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.storage.load(packed) if isinstance(packed, _View) else packed


def to_host(inputs: Any = ()) -> _Hooks:
    """A context in which autograd saves the tensors made inside it (not ``inputs``, nor
    parameters) to host memory; its ``swapped`` list holds what was sent, for :func:`prefetch`."""
    return _Hooks(inputs)


def prefetch(outputs: Any, swapped: list[Swapped]) -> None:
    """Start loading ``swapped`` back as soon as backward reaches ``outputs``."""
    if not swapped:
        return

    def start(grad_outputs: Any) -> None:
        for s in swapped:
            s.prefetch()
        swapped.clear()  # the autograd graph outlives this hook; do not keep the copies alive

    for t in tree_flatten(outputs)[0]:
        if isinstance(t, Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(start)
            return
