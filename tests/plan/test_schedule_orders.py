"""The multi-stage schedules' orders against torch.distributed.pipelining's own (built without
a process group: its schedules compute every rank's order when made), and what they cost."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from lightning_pipe.plan.schedule import Action, Pending, actions, in_flight, placement, weights_pending
from lightning_pipe.plan.simulate import StageTime, simulate

_CLASSES = {
    "interleaved-1f1b": torch_schedules.ScheduleInterleaved1F1B,
    "interleaved-zb": torch_schedules.ScheduleInterleavedZeroBubble,
    "zbv": torch_schedules.ScheduleZBVZeroBubble,
    "dualpipev": torch_schedules.ScheduleDualPipeV,
}
_KINDS = {"FORWARD": "forward", "FULL_BACKWARD": "backward", "BACKWARD_INPUT": "input", "BACKWARD_WEIGHT": "weight"}


def _torch_order(schedule, processes, virtual, chunks):
    """torch's ``pipeline_order``, made from stand-in stages (what its constructor reads of them)."""
    stages = [SimpleNamespace(group_size=processes, group_rank=0, num_stages=processes * virtual,
                              submod=torch.nn.Module()) for _ in range(virtual)]
    order = _CLASSES[schedule](stages, chunks).pipeline_order
    flat = {}
    for rank, tasks in order.items():
        flat[rank] = [
            Action(_KINDS[a.computation_type.name], a.microbatch_index, a.stage_index)
            for task in tasks if task is not None
            for a in (task.sub_actions or (task,))
        ]
    return flat


CASES = [(s, p, v, m) for s in ("interleaved-1f1b", "interleaved-zb") for p in (2, 3, 4) for v in (1, 2, 3)
         for m in (1, 2, p, 2 * p, 3 * p)]
CASES += [(s, p, 2, m) for s in ("zbv", "dualpipev") for p in (2, 3, 4) for m in (2 * p, 2 * p + 1, 4 * p)]
CASES += [("zbv", p, 2, m) for p in (2, 4) for m in (1, p)]


@pytest.mark.parametrize("schedule,processes,virtual,chunks", CASES)
def test_orders_equal_torch_pipeline_order(schedule, processes, virtual, chunks):
    ours = actions(schedule, chunks, processes * virtual, virtual)
    theirs = _torch_order(schedule, processes, virtual, chunks)
    where = placement(schedule, processes, virtual)
    for rank, order in enumerate(ours):
        assert [a for a in order if a.kind != "update"] == theirs[rank]
        assert [a.stage for a in order if a.kind == "update"] == [s for s, r in enumerate(where) if r == rank]


def _step(schedule, processes, virtual, chunks, forward=1.0, backward=2.0):
    """Simulated step of equal stages whose work per process is ``forward``/``backward`` per micro-batch."""
    times = [StageTime(forward / virtual, backward / virtual)] * (processes * virtual)
    return simulate(times, actions(schedule, chunks, processes * virtual, virtual))


def test_zero_bubble_splits_the_backward_to_fill_1f1bs_bubble_at_its_memory():
    one, zb = _step("1f1b", 4, 1, 8), _step("interleaved-zb", 4, 1, 8)
    # (m + p - 1) slots of f + b for 1F1B; the weight halves fill the cool-down's idle slots
    assert one.step_ms == pytest.approx((8 + 3) * 3) and one.bubble == pytest.approx(9 / 33)
    assert zb.step_ms == pytest.approx(27) and zb.bubble == pytest.approx(1 / 9)
    assert max(in_flight("interleaved-zb", 8, 4)) == max(in_flight("1f1b", 8, 4)) == 4


def test_weight_halves_trail_as_the_order_has_them_pending():
    """ZB1P's weight halves trail its input halves by the process's rank: the last of 4 stages
    holds 4 micro-batches with 3 between their halves at once, the first none; whole backwards
    keep none."""
    zb = weights_pending("interleaved-zb", 8, 4)
    assert zb[0] == Pending(0, ((4, 0), (4, 0))) and zb[3] == Pending(3, ((1, 0), (4, 3)))
    assert weights_pending("interleaved-1f1b", 8, 4, 2) == [None] * 4


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"])
def test_two_stages_per_process_shrink_the_bubble(schedule):
    assert _step(schedule, 4, 2, 8).bubble < _step("1f1b", 4, 1, 8).bubble


def test_a_process_runs_its_stages_one_task_at_a_time():
    # two stages of one process each take the whole forward and backward time: the step doubles
    assert _step("interleaved-1f1b", 1, 2, 4, 2.0, 4.0).step_ms == pytest.approx(2 * _step("1f1b", 1, 1, 4).step_ms)
