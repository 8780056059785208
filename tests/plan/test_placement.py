"""Which process runs which stage, and how many micro-batches each distributed schedule needs:
what ``torch.distributed.pipelining`` 2.13 does (its ``generate_stage_to_rank_mapping`` and
its schedules' constructors and action orders, probed for 1 to 16 micro-batches at 2 and 4
processes)."""

import pytest

from lightning_pipe.plan.schedule import (
    check_microbatches,
    placement,
    planned_order,
    process_stages,
    stages_per_process,
)


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


def test_the_multi_stage_schedules_are_planned_by_the_1f1b_stand_in():
    assert [planned_order(s) for s in ("gpipe", "1f1b", "2bw")] == ["gpipe", "1f1b", "2bw"]
    assert {planned_order(s) for s in ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")} == {"1f1b"}


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
    ],
)
def test_too_few_or_uneven_micro_batches_are_named_with_the_fix(schedule, chunks, processes, virtual, message):
    with pytest.raises(ValueError, match=message):
        check_microbatches(schedule, chunks, processes, virtual)


@pytest.mark.parametrize(
    ("schedule", "chunks", "processes", "virtual"),
    [("gpipe", 1, 4, 1), ("1f1b", 4, 4, 1), ("zbv", 1, 4, 2), ("zbv", 5, 2, 2), ("dualpipev", 4, 2, 2),
     ("interleaved-1f1b", 3, 2, 2), ("interleaved-zb", 7, 4, 2), ("interleaved-zb", 12, 4, 3)],
)
def test_micro_batch_counts_torch_runs_pass(schedule, chunks, processes, virtual):
    check_microbatches(schedule, chunks, processes, virtual)
