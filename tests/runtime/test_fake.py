import dataclasses
import gc
from functools import partial

import pytest
import torch
from torch.utils.data import default_collate

import lightning_pipe.lightning.local as strategy_module
from examples.hf_gpt2 import GPT2LM
from examples.models import GPT, loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.meter import StageOutOfMemoryError
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.plan import make_plan, planning_stages
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.runtime import swap
from lightning_pipe.runtime.fake import fake_training, meta_copy
from tests.helpers import trainer
from tests.models import FlashGPT, make

STAGES, CHUNKS, BATCH = 3, 4, 8
# memopt on: keep, recompute and swap in turn along the graph, two nodes each
POLICIES = ["keep", "keep", "recompute", "recompute", "swap", "swap"]


def _real_run(monkeypatch, family, schedule, memopt):
    """Two Lightning training steps on a uniform split with the given policies (the plan is
    chosen here, not by the planner, so that it neither depends on predictions nor can be
    all keep); the metered peaks and the plan."""

    def chosen(profile, request):
        plan = make_plan(profile, PlanRequest([1 << 40] * len(request.capacities), "uniform", request.schedule,
                                              request.chunks))
        if memopt:
            plan = dataclasses.replace(plan, policies=[POLICIES[i % 6] for i in range(len(plan.policies))])
        return plan

    monkeypatch.setattr(strategy_module, "make_plan", chosen)
    monkeypatch.setattr(strategy_module, "profile_graph", partial(profile_graph, fake=True))  # fast, unused
    model, data = _model(family)
    # A logged loss is a tensor on the last stage that Lightning keeps until the next step: the fake step logs none.
    model.training_step = lambda batch, batch_idx: model.loss(batch)
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, measure_memory=True)
    trainer(strategy, STAGES, max_steps=2).fit(model, loader(data, BATCH))
    return strategy.meter.peaks(), strategy.plan


def _model(family):
    if family == "flash":
        torch.manual_seed(0)
        return FlashGPT(optimizer="adam"), make("gpt")[1]
    model, data = make(family, optimizer="adam")
    if family == "unet":
        # The CPU's mse_loss returns its mean inside the storage of the elementwise losses, a
        # fake one in a storage of its own size: the same loss, computed without that quirk.
        model.criterion = lambda output, batch: (output - batch["target"]).square().mean()
    return model, data


@pytest.mark.slow
@pytest.mark.parametrize("memopt", [False, True], ids=["memopt_off", "memopt_on"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
@pytest.mark.parametrize("family", ["gpt", "unet", "encdec"])
def test_fake_run_meters_the_same_peaks_as_a_real_run(monkeypatch, family, schedule, memopt):
    real, plan = _real_run(monkeypatch, family, schedule, memopt)
    model, data = _model(family)
    captured = capture(model)
    policies = {n.name: p for n, p in zip(captured.nodes, plan.policies) if p != "keep"}
    assert bool(policies) == memopt
    batch = default_collate([data[i] for i in range(BATCH)])
    meter = fake_training(model, captured, batch, lambda forward, mb: model.criterion(forward(*model.inputs(mb)), mb),
                          model.configure_optimizers(), plan.balance, policies, schedule=schedule, chunks=CHUNKS)
    assert meter.peaks() == real
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.slow
def test_fake_tensors_on_the_cpu_run_the_attention_kernel_the_cpu_runs(monkeypatch):
    """``scaled_dot_product_attention`` picks its kernel by device: flash on the CPU, the math
    one on ``meta`` tensors, which keeps other tensors. Fake tensors standing on the CPU pick
    flash, as training does: their peaks are the real run's; meta tensors' are not."""
    real, plan = _real_run(monkeypatch, "flash", "1f1b", False)
    model, data = _model("flash")
    captured = capture(model)
    batch = default_collate([data[i] for i in range(BATCH)])

    def peaks(tensors):
        copy, graph = meta_copy(model, captured)
        step = lambda forward, mb: copy.criterion(forward(*copy.inputs(mb)), mb)  # noqa: E731
        return fake_training(copy, graph, batch, step, copy.configure_optimizers(), plan.balance, schedule="1f1b",
                             chunks=CHUNKS, tensors=tensors).peaks()

    assert peaks("cpu") == real
    assert peaks("meta") != real


@pytest.mark.slow
def test_fake_run_enforces_capacities_and_leaves_the_host_pool_alone(monkeypatch):
    gc.collect()  # swapped tensors of earlier tests give their buffers back to the pool of the day
    pool = swap.HostPool()
    monkeypatch.setattr(swap, "pool", pool)
    model, data = make("gpt")
    captured = capture(model)
    batch = default_collate([data[i] for i in range(BATCH)])
    balance = [len(captured.nodes) // 2, len(captured.nodes) - len(captured.nodes) // 2]
    policies = {n.name: "swap" for n in captured.nodes[:10]}

    def run(**capped):  # a model runs fake once: each run on a copy
        copy, graph = meta_copy(model, captured)
        return fake_training(copy, graph, batch, lambda forward, mb: copy.criterion(forward(*copy.inputs(mb)), mb),
                             copy.configure_optimizers(), balance, policies, chunks=2, **capped)

    peaks = run().peaks()
    with pytest.raises(StageOutOfMemoryError) as error:
        run(capacities=[peaks[0] - 1, None])
    assert error.value.stage == 0
    run(capacities=peaks)
    gc.collect()  # swapped fake tensors freed late give their buffers back to their own pool
    assert swap.pool is pool and pool.nbytes() == 0  # fake host buffers never enter the real pool


def test_a_model_runs_fake_once_and_its_copies_meter_alike():
    # a second run on a model already fake lost one of 2BW's weight versions from the meter:
    # it is refused, and runs on fresh copies meter the same peaks, both weight versions in them
    model, data = make("gpt")
    captured = capture(model)
    batch = default_collate([data[i] for i in range(BATCH)])
    balance = [len(captured.nodes) // 2, len(captured.nodes) - len(captured.nodes) // 2]
    params, buffers = (sum(t.nbytes for t in kind()) for kind in (model.parameters, model.buffers))

    def run(root, graph):
        meter = fake_training(root, graph, batch, lambda forward, mb: root.criterion(forward(*root.inputs(mb)), mb),
                              root.configure_optimizers(), balance, schedule="2bw", chunks=2)
        return meter.peaks(), [m.peak_by_kind["parameters"] for m in meter.stages]

    first, second = run(*meta_copy(model, captured)), run(*meta_copy(model, captured))
    assert first == second and sum(first[1]) == 2 * params + buffers  # at every stage's peak
    run(model, captured)
    with pytest.raises(ValueError, match=r"earlier fake run.*meta_copy"):
        run(model, captured)


def test_a_meta_model_runs_fake_at_sizes_that_would_not_fit_the_host():
    with torch.device("meta"):
        model = GPT(vocab=50_000, dim=4096, heads=32, layers=2, context=1024)  # 1.2 GB of fp32 weights
    captured = capture(model)
    ids = torch.zeros(64, 1024, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    meter = fake_training(model, captured, batch, lambda forward, mb: model.criterion(forward(mb), mb),
                          torch.optim.SGD(model.parameters(), lr=0.1), [len(captured.nodes)], chunks=4)
    logits = 16 * 1024 * 50_000 * 4  # one micro-batch's logits, kept for backward
    assert meter.peaks()[0] > 4 * logits


def test_the_lm_heads_stage_is_checked_as_predicted_once_the_outputs_live_on_the_last_stage():
    """A language model's logits, part of the graph's output, live on the last stage's device
    (the loss holds them there, and the stage making them frees its own), and a micro-batch's
    weighted loss lets them go after its backward. A fake 1F1B step on one device charged them
    to the stage making them, through the next micro-batch's forward: 24-31% over its predicted
    peak in the GPT-2 large dry run (`lightning-pipe plan`), which planned that stage again."""
    torch.manual_seed(0)
    model = GPT2LM(layers=1, dim=16, heads=2, vocab=8192, context=64)  # the logits dominate
    ids = torch.randint(8192, (4 * 4, 64))
    batch = {"input_ids": ids, "labels": ids}
    sample = {"input_ids": ids[:4], "labels": ids[:4]}
    captured = capture(model.train(), example_inputs=((), sample))
    profile = profile_graph(captured, (), sample, optimizer=model.configure_optimizers(), fake=True)
    names = [n.name for n in profile.nodes]
    head, loss = names.index("model_lm_head_linear") + 1, names.index("model_cross_entropy_loss") + 1
    balance = [head, loss - head, len(names) - loss]  # the body and the LM head, the loss, the output
    stages = planning_stages(profile, PlanRequest([1 << 40] * 3, schedule="1f1b", chunks=4)).kept()
    predicted = [o.peak.total for o in stages.placed(balance)]
    copy, graph = meta_copy(model, captured)

    def step(forward, microbatch):  # the dry run's loss without a training batch: the outputs' sum
        output = forward(**microbatch)
        return output["loss"] + output["logits"].sum()

    # the attention kernel of the A100 profiled
    meter = fake_training(copy, graph, batch, step, copy.configure_optimizers(), balance, schedule="1f1b", chunks=4,
                          cuda=True)
    assert meter.peaks() == pytest.approx(predicted, rel=0.05)
