"""Which process runs which stage, and how many micro-batches each distributed schedule needs:
what ``torch.distributed.pipelining`` 2.13 does (its ``generate_stage_to_rank_mapping`` and
its schedules' constructors and action orders, probed for 1 to 16 micro-batches at 2 and 4
processes)."""

import pytest

from lightning_pipe.plan.schedule import check_schedule, placement, process_stages, stages_per_process


def test_interleaved_schedules_loop_over_the_processes_and_v_shapes_fold_back():
    assert placement("gpipe", 4, 1) == [0, 1, 2, 3]
    for loop in ("1f1b", "interleaved-1f1b", "interleaved-zb"):
        assert placement(loop, 2, 3) == [0, 1, 0, 1, 0, 1]
    for v in ("zbv", "dualpipev"):  # process r: stages r and 2p - 1 - r; the first and last on process 0
        assert placement(v, 2, 2) == [0, 1, 1, 0]
        assert placement(v, 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
        assert process_stages(v, 4, 2) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert process_stages("interleaved-zb", 2, 2) == [[0, 2], [1, 3]]


def test_stages_per_process_default_to_two_for_the_interleaved_and_are_two_for_a_v():
    defaults = [stages_per_process(s, None) for s in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb")]
    assert defaults == [1, 1, 2, 2]
    assert stages_per_process("interleaved-zb", 3) == 3 and stages_per_process("1f1b", 2) == 2
    assert stages_per_process("zbv", None) == stages_per_process("dualpipev", 2) == 2


@pytest.mark.parametrize(
    ("schedule", "chunks", "processes", "virtual", "message"),
    [
        ("1f1b", 3, 4, 1, r"at least one micro-batch per stage: chunks=3 < 4 stages .* Use chunks >= 4"),
        ("dualpipev", 7, 4, 2, r"at least one micro-batch per stage: chunks=7 < 8 stages .* Use chunks >= 8"),
        ("dualpipev", 3, 2, 2, r"chunks=3 < 4 stages"),
        ("interleaved-1f1b", 5, 2, 2, r"rounds of chunks // processes = 2, which must divide chunks=5 .* "
                                      r"use chunks=4, any multiple of 2, or fewer than 4"),
        ("interleaved-zb", 9, 4, 2, r"rounds of chunks // processes = 2, which must divide chunks=9"),
        ("1f1b", 14, 4, 2, r"schedule='1f1b' runs micro-batches in rounds"),  # interleaved
        ("zbv", 8, 4, 3, r"schedule='zbv' holds exactly 2 stages per process"),
        ("gpipe", 8, 4, 2, r"schedule='gpipe' runs one stage per process, got virtual_stages=2"),
        ("interleaved-1f1b", 8, 2, 0, r"virtual_stages must be >= 1"),
    ],
)
def test_too_few_or_uneven_micro_batches_are_named_with_the_fix(schedule, chunks, processes, virtual, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(schedule, chunks, processes * virtual, virtual, distributed=True)


@pytest.mark.parametrize(
    ("schedule", "chunks", "processes", "virtual"),
    [("gpipe", 1, 4, 1), ("1f1b", 4, 4, 1), ("zbv", 1, 4, 2), ("zbv", 5, 2, 2), ("dualpipev", 4, 2, 2),
     ("interleaved-1f1b", 3, 2, 2), ("interleaved-zb", 7, 4, 2), ("interleaved-zb", 12, 4, 3)],
)
def test_micro_batch_counts_torch_runs_pass(schedule, chunks, processes, virtual):
    check_schedule(schedule, chunks, processes * virtual, virtual, distributed=True)


def test_the_local_runtimes_1f1b_takes_fewer_micro_batches_than_stages():
    check_schedule("1f1b", 3, 4, 1)


def test_virtual_stages_that_do_not_divide_the_stages_are_named():
    with pytest.raises(ValueError, match="virtual_stages=4 does not divide the 6 stages"):
        check_schedule("interleaved-1f1b", 8, 6, 4)
