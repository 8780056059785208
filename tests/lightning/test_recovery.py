"""Training that survives a plan that does not hold (runtime="local"): a stage running out of
memory mid-step is planned again and the step runs again, with nothing lost or applied twice."""

import re
import warnings
from contextlib import nullcontext
from functools import cache

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from benchmarks.faults import Cut
from examples.models import TokenDataset, loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.lightning.recovery import RecoveryError
from tests.helpers import max_rel_diff, trainer
from tests.models import Denoiser, MetricUNet, WritesInForward, make

STEPS = 4


@cache
def _limit(family: str, schedule: str) -> int:
    """The fuller stage of an unconstrained plan of ``family``: a limit memory binds at."""
    model, data = make(family)
    strategy = MemoryPipeStrategy(chunks=2, schedule=schedule, measure_memory=True)
    trainer(strategy, 2, max_steps=1).fit(model, loader(data, 4))
    return max(s.peak.total for s in strategy.plan.stages)


@cache
def _reference(family: str, steps: int = STEPS):
    """``family`` trained on one device (not to be changed: shared by the tests)."""
    torch.manual_seed(0)
    reference, data = make(family)
    trainer(max_steps=steps).fit(reference, loader(data, 4))
    return reference


def _survives(family: str, schedule: str, stage: int, step: int, cut: float, limit: int):
    """Train ``family`` under ``limit`` with ``stage``'s memory cut by ``cut`` at ``step``; the
    model, the strategy, the cut and the warnings of re-plans."""
    torch.manual_seed(0)
    model, data = make(family)
    strategy = MemoryPipeStrategy(chunks=2, schedule=schedule, measure_memory=True, memory_limit=limit)
    injected = Cut(strategy, stage, step, 1 - cut)
    fit = trainer(strategy, 2, max_steps=STEPS, callbacks=[injected])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(model, loader(data, 4))
    assert fit.global_step == STEPS
    replans = [str(w.message) for w in caught if str(w.message).startswith("Planned again")]
    return model, strategy, injected, replans


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_losing_memory_mid_run_is_planned_again_and_the_step_runs_again_unchanged(schedule):
    limit = _limit("gpt", schedule)
    model, strategy, injected, replans = _survives("gpt", schedule, stage=1, step=2, cut=0.25, limit=limit)
    assert len(replans) == 1 and re.match(r"Planned again \(1 of at most 3\): Stage 1 is out of memory.*"
                                          r"Balance \[\d+, \d+\] -> \[\d+, \d+\]", replans[0])
    assert strategy.plan.targets[1] <= injected.capacity  # planned for what the stage has now
    assert all(m.peak <= c for m, c in zip(strategy.meter.stages, strategy.meter.capacities))
    assert max_rel_diff(model, _reference("gpt")) < 1e-5  # the failed attempt left no trace, no step twice


@pytest.mark.slow
def test_a_failed_attempt_leaves_no_log_metric_or_random_draw_behind():
    """The U-Net logs a torchmetrics accuracy and its loss; the denoiser draws noise before
    ``self(...)``. A step that runs out after both is undone: logged values, metric state and
    the noise of the step run again are those of training without the failure."""
    runs = []
    for cut in (None, 0.1):
        torch.manual_seed(0)
        model = MetricUNet()
        _, data = make("unet")
        strategy = MemoryPipeStrategy(chunks=2, measure_memory=True, memory_limit=_limit("unet", "gpipe"))
        callbacks = [] if cut is None else [Cut(strategy, 1, 1, 1 - cut, of_peak=True)]
        fit = trainer(strategy, 2, max_steps=3, callbacks=callbacks)
        with pytest.warns(UserWarning, match="Planned again") if cut else nullcontext():
            fit.fit(model, loader(data, 4))
        runs.append((model, {k: v.item() for k, v in fit.logged_metrics.items()}, model.train_acc.tp.clone()))
    (model, logged, tp), (again, logged_again, tp_again) = runs
    assert logged_again == pytest.approx(logged, rel=1e-5)
    assert torch.equal(tp_again, tp)
    assert max_rel_diff(again, model) < 1e-5


@pytest.mark.slow
def test_noise_drawn_in_the_step_is_drawn_again_the_same():
    torch.manual_seed(0)
    reference = Denoiser()
    data = torch.utils.data.TensorDataset(torch.randn(16, 16))
    trainer(max_steps=3).fit(reference, torch.utils.data.DataLoader(data, batch_size=4))
    torch.manual_seed(0)
    model = Denoiser()
    strategy = MemoryPipeStrategy(chunks=2, measure_memory=True, memory_limit="1MiB")
    fit = trainer(strategy, 2, max_steps=3, callbacks=[Cut(strategy, 1, 1, 0.8, of_peak=True)])
    with pytest.warns(UserWarning, match="Planned again"):
        fit.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    assert strategy.plan is not None
    assert max_rel_diff(model, reference) < 1e-6


@pytest.mark.slow
def test_a_limit_no_plan_can_meet_is_a_clear_error_naming_the_stage():
    limit = _limit("gpt", "gpipe")
    torch.manual_seed(0)
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, measure_memory=True, memory_limit=limit)
    fit = trainer(strategy, 2, max_steps=STEPS, callbacks=[Cut(strategy, 0, 1, 0.02)])
    with pytest.raises(RecoveryError, match=r"Stage 0 is out of memory.*No plan keeps every stage under its limit"):
        fit.fit(model, loader(data, 4))


@pytest.mark.slow
def test_out_of_replans_is_a_clear_error():
    limit = _limit("gpt", "gpipe")
    torch.manual_seed(0)
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, measure_memory=True, memory_limit=limit, max_replans=1)
    cuts = [Cut(strategy, 1, 1, 0.9, of_peak=True), Cut(strategy, 1, 2, 0.9, of_peak=True)]
    fit = trainer(strategy, 2, max_steps=STEPS, callbacks=cuts)
    out = r"Stage 1 is out of memory.*planned again 1 times already \(max_replans=1\).*raise max_replans"
    with pytest.warns(UserWarning, match=r"Planned again \(1 of at most 1\)"), pytest.raises(RecoveryError, match=out):
        fit.fit(model, loader(data, 4))


def test_max_replans_must_be_a_count():
    with pytest.raises(ValueError, match="max_replans must be >= 0"):
        MemoryPipeStrategy(max_replans=-1)
    with pytest.raises(TypeError, match="max_replans must be int"):
        MemoryPipeStrategy(max_replans=1.5)


class CudaOutOfMemoryOnce(Callback):
    """Raise ``torch.OutOfMemoryError`` as CUDA words it from the loss's backward of training
    batch ``step``, once: where only the device knows it ran out, not the meter."""

    def __init__(self, step: int) -> None:
        self.step, self.raised = step, False

    def on_before_backward(self, trainer, module, loss) -> None:
        if trainer.global_step == self.step and not self.raised:
            self.raised = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 KiB. GPU 0 has a total capacity "
                                         "of 79.10 GiB of which 16.00 KiB is free.")


@pytest.mark.slow
def test_a_cuda_out_of_memory_error_is_planned_for_below_the_check(schedule="1f1b"):
    limit = _limit("gpt", schedule)
    torch.manual_seed(0)
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, schedule=schedule, measure_memory=True, memory_limit=limit)
    fit = trainer(strategy, 2, max_steps=STEPS, callbacks=[CudaOutOfMemoryOnce(2)])
    with pytest.warns(UserWarning, match=r"Planned again \(1 of at most 3\): CUDA out of memory"):
        fit.fit(model, loader(data, 4))
    # (no CUDA stage named: every stage planned 20 KiB below what its check said)
    assert all(t < limit for t in strategy.plan.targets)
    assert max_rel_diff(model, _reference("gpt")) < 1e-5


class Hoard(Callback):
    """From training batch 2 on, the step keeps a tensor of ``nbytes`` on the last stage that
    the profile never saw (a cache the user's code fills), and the meter enforces nothing: the
    stage's peak drifts past its prediction and its target without running out."""

    def __init__(self, strategy: MemoryPipeStrategy, nbytes: int) -> None:
        self.strategy, self.nbytes = strategy, nbytes

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.strategy.meter.capacities = [None, None]
        if batch_idx == 2:
            self.strategy.meter.run_as(1, lambda: setattr(module, "hoard", torch.zeros(self.nbytes // 4)))


@pytest.mark.slow
def test_a_stage_drifting_past_its_prediction_is_planned_for_before_the_next_step():
    limit = _limit("gpt", "1f1b")
    torch.manual_seed(0)
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, schedule="1f1b", measure_memory=True, memory_limit=limit)
    fit = trainer(strategy, 2, max_steps=STEPS, callbacks=[Hoard(strategy, limit // 4)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(model, loader(data, 4))
    replans = [str(w.message) for w in caught if str(w.message).startswith("Planned again")]
    # (a factor learned on one plan may fall short on a plan recomputing more: then once more)
    assert 1 <= len(replans) <= 2
    assert all(re.match(r"Planned again \(\d of at most 3\): stage 1 peaked at [\d,]+ bytes, \d+\.\d% over its "
                        r"prediction and past its target", r) for r in replans)
    assert strategy.plan.targets[1] < limit * 0.8  # planned below by what the stage took beyond its check
    assert all(m.peak <= limit for m in strategy.meter.stages)  # the hoard fits under the limit now
    assert max_rel_diff(model, _reference("gpt")) < 1e-5


@pytest.mark.slow
def test_the_last_good_checkpoint_is_intact_when_no_plan_fits(tmp_path):
    limit = _limit("gpt", "gpipe")
    torch.manual_seed(0)
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, measure_memory=True, memory_limit=limit)
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1, save_top_k=0)
    fit = trainer(strategy, 2, max_steps=STEPS, callbacks=[Cut(strategy, 0, 2, 0.02), saving],
                  enable_checkpointing=True)
    with pytest.raises(RecoveryError, match="Stage 0 is out of memory"):
        fit.fit(model, loader(data, 4))
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2  # the two steps before the failed one
    restored, _ = make("gpt")
    restored.load_state_dict(checkpoint["state_dict"])
    assert max_rel_diff(restored, _reference("gpt", steps=2)) < 1e-5


@pytest.mark.slow
def test_a_buffer_forward_writes_is_put_back_when_the_step_runs_again():
    """With ``chunks=1`` forward may write a buffer in place (an EMA of its outputs): a failed
    attempt wrote it already, so the step run again must start from the value before it, or
    the EMA takes the step twice."""
    torch.manual_seed(0)
    reference = WritesInForward("ema")
    trainer(max_steps=STEPS).fit(reference, loader(TokenDataset(16), 4))
    torch.manual_seed(0)
    unconstrained = MemoryPipeStrategy(chunks=1, measure_memory=True)
    trainer(unconstrained, 2, max_steps=1).fit(WritesInForward("ema"), loader(TokenDataset(16), 4))
    torch.manual_seed(0)
    model = WritesInForward("ema")
    limit = max(s.peak.total for s in unconstrained.plan.stages)
    strategy = MemoryPipeStrategy(chunks=1, measure_memory=True, memory_limit=limit)
    fit = trainer(strategy, 2, max_steps=STEPS, callbacks=[_CutBeforeBackward(strategy, stage=1, step=2)])
    with pytest.warns(UserWarning, match="Planned again"):
        fit.fit(model, loader(TokenDataset(16), 4))
    assert torch.equal(model.ema, reference.ema)
    assert max_rel_diff(model, reference) < 1e-5


class _CutBeforeBackward(Callback):
    """At batch ``step``, once forward has run, ``stage`` gets 90% of what it holds: it runs out in the backward."""

    def __init__(self, strategy: MemoryPipeStrategy, stage: int, step: int) -> None:
        self.strategy, self.stage, self.step, self.done = strategy, stage, step, False

    def on_before_backward(self, trainer, module, loss) -> None:
        meter = self.strategy.meter
        if trainer.global_step == self.step and not self.done:
            self.done = True
            meter.capacities[self.stage] = int(0.9 * meter.stages[self.stage].total)
