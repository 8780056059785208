"""The strategy checks a plan near the memory limit by a fake training step of the module."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import lightning_pipe.lightning.strategy as strategy_module
from examples.models import GPT, TokenDataset, loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.lightning.check import fake_peaks
from lightning_pipe.measure.meter import StageOutOfMemoryError
from tests.helpers import trainer

STAGES, CHUNKS, BATCH = 2, 4, 16


class KeepsLogits(GPT):
    """Keeps each micro-batch's logits until the next batch (an epoch-end metric's inputs):
    bytes of the user's step that the memory model, which sees one micro-batch's loss, does
    not predict."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.kept: list[torch.Tensor] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.kept.clear()

    def training_step(self, batch, batch_idx):
        logits = self(*self.inputs(batch))
        self.kept.append(logits.detach().clone())
        loss = self.criterion(logits, batch)
        self.log("train_loss", loss)
        return loss


def _fit(strategy, steps=2):
    torch.manual_seed(0)
    model = KeepsLogits()
    trainer(strategy, STAGES, max_steps=steps).fit(model, loader(TokenDataset(BATCH * steps), BATCH))
    return strategy


def _limits():
    """Per-stage limits: ample for the first stage; for the last, which holds the kept logits,
    2% over what the plan for ample memory predicts for it, which the logits take it past."""
    ample = _fit(MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", measure_memory=True))
    predicted, metered = ample.plan.stages[-1].peak.total, ample.meter.peaks()[-1]
    limits = [4 * max(ample.meter.peaks()), int(1.02 * predicted)]
    assert metered > limits[-1]  # the step holds more than predicted
    return limits


def test_a_plan_that_a_fake_step_finds_over_the_limit_is_made_again_below_it():
    limits = _limits()
    checks = []

    def spied(*args, **kwargs):
        checks.append((args[-1], fake_peaks(*args, **kwargs)))
        return checks[-1][1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(strategy_module, "fake_peaks", spied)
        strategy = _fit(MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", memory_limit=limits, measure_memory=True))
    first_plan, first_peaks = checks[0]
    assert first_plan.targets == limits and first_peaks[-1] > limits[-1]  # planned to the limits, it went over
    plan, metered = strategy.plan, strategy.meter.peaks()
    assert plan.targets[-1] < limits[-1]  # planned again below the limit, by the error measured
    assert all(m <= limit for m, limit in zip(metered, limits))  # it trains (the meter enforces the limits)
    # the error the check measured on the last stage, no less, is what the plan left below the limit
    error = first_peaks[-1] / first_plan.stages[-1].peak.total - 1
    assert plan.targets[-1] <= limits[-1] / (1 + error)
    # checked too (a measured error is no flat one), and as trained to the byte, but for one micro-batch's
    # logits on the last stage: no hook empties the list between the fake run's two steps
    checked_plan, peaks = checks[-1]
    logits = (BATCH // CHUNKS) * 16 * 96 * 4  # micro-batch x context x vocabulary x fp32
    assert checked_plan is plan and peaks[:-1] == metered[:-1] and peaks[-1] == metered[-1] + logits


def test_without_the_check_the_same_limits_run_out_of_memory(monkeypatch):
    limits = _limits()
    monkeypatch.setattr(strategy_module, "fake_peaks", lambda *args: [s.peak.total for s in args[-1].stages])
    with pytest.raises(StageOutOfMemoryError):
        _fit(MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", memory_limit=limits, measure_memory=True))


def test_the_check_leaves_the_module_as_it_was():
    strategy = _fit(MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b"), steps=1)
    module = strategy.lightning_module
    module.forward = strategy._forward  # as during training (teardown gave the module its own back)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    logged = dict(module.trainer.callback_metrics)
    kept = list(module.kept)
    batch = next(iter(loader(TokenDataset(BATCH), BATCH)))
    optimizer = strategy.optimizers[0]
    state = {id(p): dict(s) for p, s in optimizer.state.items()}
    peaks = fake_peaks(module, strategy._captured, batch, 0, optimizer, strategy.precision_plugin, strategy.plan)
    assert len(peaks) == STAGES and all(p > 0 for p in peaks)
    after = module.state_dict()
    assert not any(isinstance(t, FakeTensor) or t.is_meta for t in after.values())
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert module.kept == kept and dict(module.trainer.callback_metrics) == logged
    assert {id(p): dict(s) for p, s in optimizer.state.items()}.keys() == state.keys()
    assert all(not (isinstance(v, FakeTensor) or v.is_meta) for s in optimizer.state.values() for v in s.values())
    assert vars(module)["forward"] == strategy._forward  # the strategy's pipeline still runs the module


def test_under_cpu_autocast_the_check_meters_what_training_does():
    # bf16-mixed on the CPU casts fake tensors standing on the CPU; meta tensors it leaves in fp32
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", measure_memory=True)
    torch.manual_seed(0)
    model = GPT(optimizer="adam")
    trainer(strategy, STAGES, max_steps=2, precision="bf16-mixed").fit(model, loader(TokenDataset(2 * BATCH), BATCH))
    model.forward = strategy._forward
    batch = next(iter(loader(TokenDataset(BATCH), BATCH)))
    peaks = fake_peaks(model, strategy._captured, batch, 0, strategy.optimizers[0], strategy.precision_plugin,
                       strategy.plan)
    assert peaks == strategy.meter.peaks()
