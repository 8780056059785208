"""What PyTorch's CUDA caching allocator reserves for a sequence of allocations and frees.

A stage on a GPU runs out of memory when the allocator cannot get another segment from the
device, and the allocator holds more than the tensors do: it rounds every request up, carves
small ones out of 2 MiB segments, and keeps freed blocks cached for reuse, where fragmentation
can leave a request with no block that fits. ``torch.cuda.max_memory_reserved`` shows those
segments, ``max_memory_allocated`` the blocks handed out. :func:`replay` plays a trace (a fake
training step's, :meth:`~lightning_pipe.measure.meter.MemoryMeter.allocator_peaks`) through
the allocator's rules and reports both peaks, so a plan is checked against what the device will
hold.

Modelled, with the default settings of ``c10/cuda/CUDACachingAllocator.cpp``:

- a request is rounded up to a multiple of 512 bytes (at least 512; none for zero bytes);
- requests up to 1 MiB come from the small pool, larger ones from the large pool, each reusing
  its smallest cached free block that fits (the lowest address among equal sizes);
- where none fits, a new segment: 2 MiB for a small request, 20 MiB for one under 10 MiB, else
  the request rounded up to 2 MiB;
- a block larger than the request is split, the request taking its start, when what remains
  is at least 512 bytes (small pool) or more than 1 MiB (large pool); else the whole block is
  handed out and counts as allocated;
- a freed block merges with free neighbours of its segment;
- segments are never returned to the device.

Left out: streams (a block freed on one stream serves only that stream, and
``record_stream`` delays its reuse: the pipeline's copies on side streams may cache blocks
this replay reuses), the retry that frees cached segments when the device is full
(``empty_cache`` on the way to an out-of-memory error: a stage whose reserved peak passes its
limit may still fit, so the figure errs high), and the opt-in settings of
``PYTORCH_CUDA_ALLOC_CONF`` (``max_split_size_mb``, ``roundup_power2_divisions``,
``expandable_segments``, garbage collection), which change these rules. Memory no storage
holds (cuBLAS and cuDNN workspaces taken from the allocator, the CUDA context) is not in a
trace.
"""

from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["AllocatorPeaks", "CachingAllocator", "replay", "round_size", "segment_size"]

_MIN_BLOCK = 512  # kMinBlockSize
_SMALL_REQUEST = 1 << 20  # kSmallSize: up to this, the small pool
_SMALL_SEGMENT = 2 << 20  # kSmallBuffer
_MID_SEGMENT = 20 << 20  # kLargeBuffer: for large requests under _LARGE_REQUEST
_LARGE_REQUEST = 10 << 20  # kMinLargeAlloc
_ROUND_LARGE = 2 << 20  # kRoundLarge


@dataclass(frozen=True)
class AllocatorPeaks:
    """The most bytes handed out (``max_memory_allocated``) and held in segments
    (``max_memory_reserved``) at any moment of a trace."""

    allocated: int
    reserved: int


def round_size(nbytes: int) -> int:
    """The block size a request of ``nbytes`` (> 0) asks the pools for."""
    return max(_MIN_BLOCK, -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment the device is asked for when no cached block fits a block of ``size``."""
    if size <= _SMALL_REQUEST:
        return _SMALL_SEGMENT
    if size < _LARGE_REQUEST:
        return _MID_SEGMENT
    return -(-size // _ROUND_LARGE) * _ROUND_LARGE


@dataclass(eq=False)
class _Block:
    """A span of a segment: handed out or cached; ``before``/``after``: its segment neighbours."""

    address: int
    size: int
    small: bool
    free: bool = True
    before: "_Block | None" = None
    after: "_Block | None" = None


class CachingAllocator:
    """One device's caching allocator, by the rules in this module's docstring, with its
    running totals and peaks in bytes."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self._pools: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # small? -> (size, address) free
        self._cached: dict[int, _Block] = {}  # free blocks by address
        self._live: dict[Hashable, _Block] = {}
        self._end = 0  # where the next segment starts: addresses order blocks of equal size

    def malloc(self, key: Hashable, nbytes: int) -> None:
        """Hand out a block for a request of ``nbytes`` (> 0), freed by ``free(key)``."""
        size = round_size(nbytes)
        small = size <= _SMALL_REQUEST
        pool = self._pools[small]
        i = bisect_left(pool, (size,))
        if i < len(pool):
            block = self._cached.pop(pool.pop(i)[1])
        else:
            block = _Block(self._end, segment_size(size), small)
            self._end += block.size
            self.reserved += block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if remaining >= _MIN_BLOCK if small else remaining > _SMALL_REQUEST:
            rest = _Block(block.address + size, remaining, small, before=block, after=block.after)
            if block.after is not None:
                block.after.before = rest
            block.after, block.size = rest, size
            self._cache(rest)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        """Return ``key``'s block to its pool, merged with the free blocks beside it."""
        block = self._live.pop(key)
        self.allocated -= block.size
        block.free = True
        before, after = block.before, block.after
        if before is not None and before.free:
            self._uncache(before)
            block.address, block.size, block.before = before.address, before.size + block.size, before.before
            if before.before is not None:
                before.before.after = block
        if after is not None and after.free:
            self._uncache(after)
            block.size, block.after = block.size + after.size, after.after
            if after.after is not None:
                after.after.before = block
        self._cache(block)

    def _cache(self, block: _Block) -> None:
        insort(self._pools[block.small], (block.size, block.address))
        self._cached[block.address] = block

    def _uncache(self, block: _Block) -> None:
        pool = self._pools[block.small]
        del pool[bisect_left(pool, (block.size, block.address))]
        del self._cached[block.address]


def replay(events: Iterable[tuple[Hashable, int]]) -> AllocatorPeaks:
    """The peaks of a trace on one fresh allocator: ``(key, nbytes)`` allocates ``nbytes`` as
    ``key`` where ``nbytes > 0``, and frees ``key``'s block where it is negative."""
    allocator = CachingAllocator()
    for key, nbytes in events:
        if nbytes > 0:
            allocator.malloc(key, nbytes)
        else:
            allocator.free(key)
    return AllocatorPeaks(allocator.peak_allocated, allocator.peak_reserved)
