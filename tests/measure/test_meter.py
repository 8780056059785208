import weakref

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, default_collate

from examples.models import loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.meter import MemoryMeter, StageOutOfMemoryError
from lightning_pipe.runtime.build import build
from lightning_pipe.runtime.gpipe import Pipeline
from tests.helpers import trainer
from tests.models import WIDE, Skipped, Wide, make

CPU = torch.device("cpu")


def _metered(model, balance, chunks, capacities=None):
    captured = capture(model)
    program = build(captured, model, balance, [CPU] * len(balance))
    meter = MemoryMeter(len(balance), capacities)
    for stage in program.stages:
        meter.own(stage.index, stage.owned)
    return Pipeline(program, model, chunks, CPU, meter), meter


def test_activations_parameters_gradients_and_optimizer_state_are_charged_to_their_stage():
    model = Wide()
    pipe, meter = _metered(model, [1, 3], chunks=4)
    params = [sum(p.numel() * 4 for p in m.parameters()) for m in (model.l0, nn.ModuleList([model.l1, model.l2]))]
    x = torch.randn(32, 16)
    optimizer = torch.optim.Adam(model.parameters())
    with meter, meter.saved_tensors_hooks():
        out = pipe(x)
        stage1 = meter.stages[1].current
        # 4 micro-batches of (8, WIDE) floats, and of l0's (8, 16) outputs, which l1 keeps for
        # its backward: they count on the stage keeping them, as on a device of its own
        assert stage1["activations"] == 32 * WIDE * 4 + 32 * 16 * 4
        assert meter.stages[0].current["activations"] == 0
        assert [m.current["parameters"] for m in meter.stages] == params
        out.sum().backward()
        assert stage1["activations"] == 0  # backward released every micro-batch
        assert [m.current["gradients"] for m in meter.stages] == params
        optimizer.step()
        meter.own_optimizer_state(optimizer)
        for m, p in zip(meter.stages, params):
            assert 2 * p <= m.current["optimizer"] <= 2 * p + 64  # exp_avg, exp_avg_sq (+ step counters)
    meter.close()
    assert meter.stages[1].peak >= 32 * WIDE * 4 + params[1]
    assert meter.stages[1].peak == sum(meter.stages[1].peak_by_kind.values())


def test_freed_storages_leave_the_count():
    pipe, meter = _metered(Wide(), [2, 2], chunks=2)
    with meter, meter.saved_tensors_hooks():
        with torch.no_grad():
            out = pipe(torch.randn(8, 16))
        assert meter.stages[1].current["activations"] == 0  # nothing saved without grad
        before = meter.stages[1].total
        del out
        assert meter.stages[1].total <= before
    assert meter.stages[1].peak >= 4 * WIDE * 4  # the (4, WIDE) outputs existed for a while


def test_capacity_error_names_stage_capacity_and_request():
    model = Wide()
    pipe, meter = _metered(model, [1, 3], chunks=2, capacities=[None, 600_000])
    with meter, meter.saved_tensors_hooks(), pytest.raises(StageOutOfMemoryError) as info:
        pipe(torch.randn(32, 16))
    err = info.value
    assert err.stage == 1 and err.capacity == 600_000 and err.request > 0
    assert "Stage 1 is out of memory" in str(err) and "600,000 bytes" in str(err)
    # The same run fits a capacity above what it needs.
    pipe, meter = _metered(Wide(), [1, 3], chunks=2, capacities=[None, 2_000_000])
    with meter, meter.saved_tensors_hooks():
        pipe(torch.randn(32, 16)).sum().backward()
    assert meter.stages[1].peak <= 2_000_000


def test_unrefused_refuses_nothing_inside_and_reports_its_own_peak_after():
    meter = MemoryMeter(1, [20_000])
    memory = meter.stages[0]
    with meter, meter.running(0):
        kept = torch.ones(1000)  # 4,000 bytes held throughout
        torch.ones(2000)  # 8,000 more for an instant: the stage's peak, 12,000
        by_kind = dict(memory.peak_by_kind)
        with meter.unrefused(0) as lower:
            torch.ones(1000)
        # the block's own peak, not the stage's before it; the stage's peak stands
        assert (lower.capacity, lower.held, lower.during) == (20_000, 4000, 8000)
        assert memory.peak == 12_000 and memory.peak_by_kind == by_kind
        with meter.unrefused(0) as higher:
            torch.ones(5000)  # 24,000 held: past the capacity, yet not refused
        assert (higher.held, higher.during) == (4000, 24_000)
        assert memory.peak == 24_000  # raised to the block's
        assert meter.capacities == [20_000]
        with pytest.raises(StageOutOfMemoryError):  # refused again after the block
            torch.ones(5000)
    assert kept.numel() == 1000


def test_capacities_must_match_stages():
    with pytest.raises(ValueError, match="3 capacities given for 2 stages"):
        MemoryMeter(2, [1, 2, 3])


@pytest.mark.cuda
def test_cuda_peaks_per_device():
    assert MemoryMeter.cuda_peaks([torch.device("cuda", 0)]) is not None
    assert MemoryMeter.cuda_peaks([torch.device("cuda", 0), CPU]) is None


def _allocator_peak(prof: torch.profiler.profile) -> int:
    """The most bytes the CPU allocator had handed out at once while ``prof`` ran, counting
    the blocks allocated inside it. Frees of older blocks are left out: the allocator's running
    total also drops for blocks an earlier profiler session saw made (garbage collection can
    free those at any moment), which would lower the peak by bytes this session never counted."""
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr))
    live: dict[int, int] = {}
    now = peak = 0
    for _, size, ptr in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = size
            now += size
            peak = max(peak, now)
        else:
            now -= live.pop(ptr, 0)
    return peak


@pytest.mark.parametrize(("family", "schedule"), [("gpt", "1f1b"), ("unet", "gpipe")])
def test_the_process_peak_is_the_allocator_s(family, schedule):
    """Every byte the CPU allocator hands out while training is charged to a stage (operators'
    scratch, the batch, the merged output, the loss included): the meter's process-wide peak
    is the allocator's, counted from torch.profiler's memory events, which the meter does not
    read while training. The model and its parameters are made while profiling, the data before."""
    data = make(family)[1]

    def fit():
        strategy = MemoryPipeStrategy(chunks=2, schedule=schedule, planner=None, measure_memory=True)
        trainer(strategy, 2, max_steps=2).fit(make(family)[0], loader(data, 8))
        return strategy

    fit()  # the meter observes each operator's scratch once, in a profiler session of its own
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        strategy = fit()
    assert strategy.meter.process_peak == pytest.approx(_allocator_peak(prof), rel=0.03)


@pytest.mark.slow
@pytest.mark.parametrize("held", [False, True], ids=["fresh batches", "held batches"])
def test_with_the_planner_on_the_process_peak_is_the_allocator_s_over_five_steps(held):
    """Planning profiles and probes inside the first step, charged to no stage: nothing it
    made may outlive it (a tensor autograd saved as its own output did, through the meter's
    hook: the meter was 20% under the allocator). A batch the loader keeps alive is charged for
    its step only (it was charged again each step and never released): held batches were made
    before the profiler session, so the allocator never sees the one a step holds, which the
    meter charges. Within 1%. (The planner splits by parameter bytes: a split by measured
    times changes with the machine's load, and with it the peak.)"""
    data = make("unet")[1]  # images: a batch is a tenth of a stage's peak
    batches = [default_collate([data[i] for i in range(4 * k, 4 * k + 4)]) for k in range(5)]

    def fit():
        strategy = MemoryPipeStrategy(chunks=2, schedule="1f1b", planner="params", measure_memory=True)
        trainer(strategy, 2, max_steps=5).fit(make("unet")[0], DataLoader(batches, batch_size=None) if held
                                              else loader(data, 4))
        return strategy

    fit()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        strategy = fit()
    unseen = sum(t.untyped_storage().nbytes() for t in tree_flatten(batches[0])[0]) if held else 0
    assert strategy.meter.process_peak == pytest.approx(_allocator_peak(prof) + unseen, rel=0.01)


def test_an_optimizer_steps_temporaries_are_charged_to_the_stage_of_their_parameter():
    """Wide linear layers and a small batch: the peak is Adam's step (its temporaries for the
    largest weight, beside every parameter's gradient and state), outside any stage; the
    meter's process-wide peak is still the allocator's."""
    data = torch.utils.data.TensorDataset(torch.randn(16, 512))

    def fit():
        model = Skipped(512, "add")
        model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), foreach=False)
        strategy = MemoryPipeStrategy(chunks=2, schedule="1f1b", planner=None, measure_memory=True)
        trainer(strategy, 2, max_steps=2).fit(model, loader(data, 8))
        return strategy

    fit()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        strategy = fit()
    assert strategy.meter.process_peak == pytest.approx(_allocator_peak(prof), rel=0.03)
    weight = 512 * 512 * 4
    assert all(m.peak_by_kind["transient"] >= 2 * weight for m in strategy.meter.stages)


def test_a_tensor_saved_as_its_own_output_dies_with_its_last_reference_without_a_backward():
    # exp saves its output: kept by the hook itself, it would keep its grad_fn, and so itself
    # (a profiler's timing forward is never backwarded: its activations stayed for the run)
    meter = MemoryMeter(1)
    x = torch.randn(1000, requires_grad=True)
    with meter, meter.saved_tensors_hooks(), meter.running(0):
        y = x.exp()
    assert meter.stages[0].current["activations"] == 4000
    alive = weakref.ref(y)
    del y
    assert alive() is None and meter.stages[0].current["activations"] == 0
    with meter, meter.saved_tensors_hooks(), meter.running(0):
        y = x.exp()
    y.sum().backward()  # what the hook kept still serves the backward
    torch.testing.assert_close(x.grad, x.detach().exp())
