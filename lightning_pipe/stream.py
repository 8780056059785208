"""Streams: CUDA streams and the CPU behind one interface, so one code path runs on both.

A CUDA device runs kernels and copies asynchronously, in order per stream; work on one stream
waits for another only where told (:func:`wait_stream`), and the caching allocator must be
told which streams use a tensor (:func:`record_stream`) before it hands its memory to another
stream. On a CPU every operation is done when it returns: :data:`CPUStream` stands in for a
stream, the calls below do nothing (or block, where a CPU waits for a CUDA stream), and a
:class:`CPUEvent` holds the wall-clock time it was recorded. As torchgpipe's ``stream.py``.

This module sits below ``measure`` and ``runtime``: both time and copy through it.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import torch
from torch import Tensor

__all__ = [
    "AbstractEvent",
    "AbstractStream",
    "CPUEvent",
    "CPUStream",
    "current_stream",
    "elapsed_ms",
    "is_cuda",
    "record_event",
    "record_stream",
    "side_stream",
    "synchronize",
    "use_stream",
    "wait_event",
    "wait_stream",
]


class CPUStreamType:
    """The stream of a CPU device: what is queued on it is done when the call returns."""


CPUStream = CPUStreamType()
AbstractStream = torch.cuda.Stream | CPUStreamType


class CPUEvent:
    """A point on a CPU stream: everything before it is done; ``time`` says when (seconds)."""

    def __init__(self) -> None:
        self.time = time.perf_counter()


AbstractEvent = torch.cuda.Event | CPUEvent

_side: dict[torch.device, torch.cuda.Stream] = {}


def is_cuda(stream: AbstractStream) -> bool:
    return stream is not CPUStream


def current_stream(device: torch.device) -> AbstractStream:
    """The stream kernels on ``device`` run on now."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.current_stream(device)


def side_stream(device: torch.device) -> AbstractStream:
    """``device``'s stream for copies beside its compute; one per device, reused (a new
    stream per copy would give the allocator a new pool each time)."""
    if device.type != "cuda":
        return CPUStream
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _side:
        _side[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return _side[device]


@contextmanager
def use_stream(stream: AbstractStream) -> Iterator[None]:
    """Queue the work (and take the allocations) of the block on ``stream``."""
    if not is_cuda(stream):
        yield
        return
    with torch.cuda.stream(cast(torch.cuda.Stream, stream)):
        yield


def wait_stream(waiting: AbstractStream, target: AbstractStream) -> None:
    """Work queued on ``waiting`` from now on runs after what ``target`` holds so far; a CPU
    waiting for a CUDA stream blocks until it is done."""
    if not is_cuda(target):
        return  # the CPU's work is already done
    if is_cuda(waiting):
        cast(torch.cuda.Stream, waiting).wait_stream(cast(torch.cuda.Stream, target))
    else:
        cast(torch.cuda.Stream, target).synchronize()


def record_stream(tensor: Tensor, stream: AbstractStream) -> None:
    """Keep ``tensor``'s memory from being reused until what ``stream`` holds so far is done
    (the allocator otherwise tracks only the stream the memory was allocated on)."""
    if is_cuda(stream) and tensor.is_cuda:
        tensor.record_stream(cast(torch.cuda.Stream, stream))


def record_event(stream: AbstractStream, timing: bool = False) -> AbstractEvent:
    """An event reached once ``stream`` has done what it holds now; ``timing`` to measure
    :func:`elapsed_ms` between two of them."""
    if not is_cuda(stream):
        return CPUEvent()
    event = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]
    event.record(cast(torch.cuda.Stream, stream))
    return event


def wait_event(stream: AbstractStream, event: AbstractEvent) -> None:
    """Work queued on ``stream`` from now on runs after ``event``."""
    if isinstance(event, CPUEvent):
        return
    if is_cuda(stream):
        cast(torch.cuda.Stream, stream).wait_event(event)
    else:
        event.synchronize()


def synchronize(event: AbstractEvent) -> None:
    """Block the host until ``event`` is reached."""
    if not isinstance(event, CPUEvent):
        event.synchronize()


def elapsed_ms(start: AbstractEvent, end: AbstractEvent) -> float:
    """Milliseconds from ``start`` to ``end`` (recorded with ``timing``); waits for ``end``."""
    if isinstance(start, CPUEvent) and isinstance(end, CPUEvent):
        return (end.time - start.time) * 1e3
    assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event), "one device's events"
    end.synchronize()
    return float(start.elapsed_time(end))
