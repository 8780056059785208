"""Swap: keep the tensors autograd saves in host memory until backward needs them.

Inside :func:`to_host`, every tensor autograd saves (except parameters, which stay) is
copied to a host buffer and the device copy is dropped; backward copies it back. On CUDA the
host buffers are pinned and reused from a pool, both copies run on a side stream, and
:func:`prefetch` starts the copies back as soon as a segment's backward begins. The host
buffers are not charged to any stage by the meter: they are not device memory.
"""

from collections import defaultdict
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from lightning_pipe.meter import not_charged

__all__ = ["Swapped", "prefetch", "to_host"]

_streams: dict[torch.device, "torch.cuda.Stream"] = {}
_pool: dict[tuple, list[tuple[Tensor, Optional[Any]]]] = defaultdict(list)  # reusable host buffers


class Swapped:
    """A saved tensor living in host memory, with what it takes to bring it back."""

    def __init__(self, tensor: Tensor) -> None:
        self.device = tensor.device
        self.shape, self.stride, self.offset = tensor.shape, tensor.stride(), tensor.storage_offset()
        flat = tensor.as_strided((tensor.untyped_storage().nbytes() // tensor.element_size(),), (1,), 0)
        self.key = (flat.numel(), flat.dtype, self.device.type == "cuda")
        self.host = _host_buffer(self.key)
        self.event: Optional[Any] = None
        self.loaded: Optional[Tensor] = None
        self.loaded_event: Optional[Any] = None
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

    def load(self) -> Tensor:
        """The tensor back on its device, with its original view."""
        self.prefetch()
        assert self.loaded is not None
        if self.loaded_event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.loaded_event)
            self.loaded.record_stream(current)
        return self.loaded.as_strided(self.shape, self.stride, self.offset)

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


class _Hooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self) -> None:
        self.swapped: list[Swapped] = []
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        with not_charged():
            s = Swapped(t)
        self.swapped.append(s)
        return s

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.load() if isinstance(packed, Swapped) else packed


def to_host() -> _Hooks:
    """A context in which autograd saves tensors to host memory; its ``swapped`` list holds
    what was sent, for :func:`prefetch`."""
    return _Hooks()


def prefetch(outputs: Any, swapped: list[Swapped]) -> None:
    """Start loading ``swapped`` back as soon as backward reaches ``outputs``."""
    if not swapped:
        return

    def start(grad_outputs: Any) -> None:
        for s in swapped:
            s.prefetch()

    for t in tree_flatten(outputs)[0]:
        if isinstance(t, Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(start)
            return
