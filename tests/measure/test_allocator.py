"""The CUDA caching allocator's rules, replayed on hand-computed traces (no GPU needed), and
the meter's trace that feeds them."""

import pytest
import torch

from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.allocator import AllocatorPeaks, CachingAllocator, replay, round_size, segment_size
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.runtime.build import build
from lightning_pipe.runtime.gpipe import Pipeline
from tests.models import Wide

KiB, MiB = 1 << 10, 1 << 20
CPU = torch.device("cpu")


def test_requests_are_rounded_to_512_bytes_and_segments_by_pool():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # the small pool's segments
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # shared by mid-sized requests
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(10 * MiB + 512) == 12 * MiB  # rounded to 2 MiB


def test_small_blocks_share_a_segment():
    assert replay([("a", 1000), ("b", 3000), ("c", 1)]) == AllocatorPeaks(1024 + 3072 + 512, 2 * MiB)


def test_a_freed_block_is_reused_and_segments_are_kept():
    # a and b fill a segment; c needs a second; b's block, freed, takes d
    trace = [("a", MiB), ("b", MiB), ("c", 512), ("b", -MiB), ("d", 1000 * KiB)]
    assert replay(trace) == AllocatorPeaks(2 * MiB + 512, 4 * MiB)
    # nothing freed goes back to the device: the reserved peak stays
    allocator = CachingAllocator()
    for key, nbytes in trace:
        allocator.malloc(key, nbytes) if nbytes > 0 else allocator.free(key)
    for key in "acd":
        allocator.free(key)
    assert (allocator.allocated, allocator.reserved) == (0, 4 * MiB)


def test_fragmentation_makes_a_new_segment():
    # a | b | c | 48 KiB free: with a and c freed, 700 + 648 KiB are free, but not in one block
    trace = [("a", 700 * KiB), ("b", 700 * KiB), ("c", 600 * KiB), ("a", -700 * KiB), ("c", -600 * KiB)]
    assert replay([*trace, ("d", 1000 * KiB)]) == AllocatorPeaks(2000 * KiB, 4 * MiB)
    # with b freed too, the three merge into the whole segment again, which d fits
    assert replay([*trace, ("b", -700 * KiB), ("d", 1000 * KiB)]) == AllocatorPeaks(2000 * KiB, 2 * MiB)


def test_large_requests_are_rounded_to_2_mib_and_split_only_for_more_than_1_mib():
    # 11 MiB and 512 bytes: a 12 MiB segment, whose remaining 1 MiB - 512 is not split off, so
    # the whole block counts as allocated
    assert replay([("a", 11 * MiB + 1)]) == AllocatorPeaks(12 * MiB, 12 * MiB)
    # 3 MiB: a 20 MiB segment, split; 5 MiB more come from the rest of it
    assert replay([("a", 3 * MiB), ("b", 5 * MiB)]) == AllocatorPeaks(8 * MiB, 20 * MiB)
    # small and large requests never share a segment
    assert replay([("a", 3 * MiB), ("b", 512)]) == AllocatorPeaks(3 * MiB + 512, 22 * MiB)


def test_a_freed_large_block_is_reused_best_fit():
    # the 12 MiB request takes the 12 MiB block, not (split) the 16 MiB one, which the 16 MiB request then fits
    trace = [("x", 12 * MiB), ("y", 16 * MiB), ("x", -12 * MiB), ("y", -16 * MiB), ("a", 12 * MiB), ("b", 16 * MiB)]
    assert replay(trace) == AllocatorPeaks(28 * MiB, 28 * MiB)


def test_the_meter_records_a_trace_whose_replay_holds_at_least_the_metered_bytes():
    with pytest.raises(ValueError, match="keeps no trace"):
        MemoryMeter(1).allocator_peaks([0])
    model = Wide()
    program = build(capture(model), model, [1, 3], [CPU, CPU])
    meter = MemoryMeter(2, trace=True)
    for stage in program.stages:
        meter.own(stage.index, stage.owned)
    pipe = Pipeline(program, model, 4, CPU, meter)
    with meter, meter.saved_tensors_hooks():
        pipe(torch.randn(32, 16)).sum().backward()
    assert meter.trace
    for stage, peak in enumerate(meter.peaks()):
        peaks = meter.allocator_peaks([stage])
        assert peak <= peaks.allocated <= peaks.reserved and peaks.reserved % (2 * MiB) == 0
    # every storage charged was released or is still charged: what the replay still holds
    live: dict[int, int] = {}
    for _, key, nbytes in meter.trace:
        live[key] = live.get(key, 0) + nbytes
    assert sum(live.values()) == sum(m.total for m in meter.stages)
    # the stages on one device: at least the process's metered peak
    both = meter.allocator_peaks([0, 1])
    assert meter.process_peak <= both.allocated <= both.reserved


def test_a_storage_moving_between_stages_is_released_from_one_and_charged_to_the_other():
    meter = MemoryMeter(2, trace=True)
    with meter, meter.running(0):
        t = torch.ones(256)  # made by stage 0
    meter.mark([t], "boundary")  # on its way to stage 1: another kind on the same stage, no allocation
    meter.keep(1, [t])  # kept by stage 1 for its backward: it moves there
    key = meter.trace[0][1]
    assert meter.trace == [(0, key, 1024), (0, key, -1024), (1, key, 1024)]
    assert meter.allocator_peaks([0]) == meter.allocator_peaks([1]) == AllocatorPeaks(1024, 2 * MiB)
