import re

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Subset

from examples.models import GPT, ImageDataset, TokenDataset, UNet, loader
from lightning_pipe import CaptureError, MemoryPipeStrategy
from tests.helpers import max_rel_diff, trainer
from tests.models import Untraceable, WritesInForward, make


def _fit(family, strategy="auto", devices=1, batch_size=8, **model_kwargs):
    model, data = make(family, **model_kwargs)
    trainer(strategy, devices).fit(model, loader(data, batch_size))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "unet", "encdec"])
@pytest.mark.parametrize("stages", [2, 4])
def test_five_steps_match_single_device_training(family, stages):
    reference = _fit(family)
    piped = _fit(family, MemoryPipeStrategy(chunks=4), stages)
    assert max_rel_diff(piped, reference) < 1e-5
    # training moved the parameters, so the comparison is not vacuous
    assert max_rel_diff(piped, make(family)[0]) > 1e-3


def test_adam_with_uneven_chunks_matches_single_device():
    reference = _fit("gpt", optimizer="adam", lr=1e-3, batch_size=10)
    piped = _fit("gpt", MemoryPipeStrategy(chunks=3), 3, optimizer="adam", lr=1e-3, batch_size=10)
    # Key biases have an exactly-zero true gradient; Adam normalises their rounding noise
    # (which differs with the micro-batch split) into ~1e-5 relative drift after 5 steps.
    assert max_rel_diff(piped, reference) < 1e-4


class _CountHeadCalls(Callback):
    def __init__(self):
        self.per_step = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.calls = 0
        self.handle = module.head.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.handle.remove()
        self.per_step.append(self.calls)


def test_training_step_runs_the_pipeline_over_microbatches():
    model, data = make("gpt")
    counter = _CountHeadCalls()
    strategy = MemoryPipeStrategy(chunks=4, planner=None)  # (planning would run the head to profile it)
    trainer(strategy, 2, max_steps=2, callbacks=[counter]).fit(model, loader(data, 8))
    assert counter.per_step == [4, 4]
    assert "forward" not in vars(model)  # teardown restored the plain module


def test_registered_name_and_split_summary(caplog):
    t = trainer("memory_pipe", 2, max_steps=1)
    assert isinstance(t.strategy, MemoryPipeStrategy) and t.strategy.options.chunks == 4
    model, data = make("gpt")
    with caplog.at_level("INFO"):
        t.fit(model, loader(data, 8))
    assert t.num_devices == 2 and t.world_size == 1
    # planning says so and how long it took; the even split it replaces is not shown (the plan's table is)
    assert re.search(r"Planning at the first training batch: profiling one micro-batch through \d+ nodes, then "
                     r"splitting them over 2 stages", caplog.text)
    assert re.search(r"Planned in \d+\.\d s\.", caplog.text) and "stage  device   nodes" not in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):  # without a planner the split that runs is the summary's
        trainer(MemoryPipeStrategy(planner=None), 2, max_steps=1).fit(make("gpt")[0], loader(data, 8))
    assert "stage  device   nodes" in caplog.text and ".. head" in caplog.text and "Planning" not in caplog.text


def test_validate_test_predict_match_plain_module():
    model, data = make("unet")
    plain = trainer()
    expected_val = plain.validate(model, loader(data, 8), verbose=False)[0]["val_loss"]
    expected_pred = torch.cat(plain.predict(model, loader(data, 8)))
    piped = trainer(MemoryPipeStrategy(chunks=2), 3)
    assert piped.validate(model, loader(data, 8), verbose=False)[0]["val_loss"] == pytest.approx(expected_val, rel=1e-5)
    assert piped.test(model, loader(data, 8), verbose=False)[0]["test_loss"] == pytest.approx(expected_val, rel=1e-5)
    predictions = torch.cat(piped.predict(model, loader(data, 8)))
    assert torch.allclose(predictions, expected_pred, atol=1e-5)


def test_checkpoint_from_pipeline_loads_into_plain_module(tmp_path):
    model, data = make("gpt")
    t = trainer(MemoryPipeStrategy(chunks=2), 4, max_steps=3)
    t.fit(model, loader(data, 8))
    t.save_checkpoint(tmp_path / "pipe.ckpt")
    plain = GPT.load_from_checkpoint(tmp_path / "pipe.ckpt")
    assert set(plain.state_dict()) == set(GPT().state_dict())
    assert max_rel_diff(plain, model) == 0
    assert plain.head.weight is plain.tok_emb.weight  # still tied


def _epochs(family, strategy, devices, epochs, ckpt_path=None, save=None):
    model, data = make(family)  # SGD with momentum: the buffers must survive the resume
    t = trainer(strategy, devices, max_steps=-1, max_epochs=epochs)
    t.fit(model, loader(data, 8), ckpt_path=ckpt_path)
    if save:
        t.save_checkpoint(save)
    return model, t


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [("pipe", "pipe"), ("plain", "pipe"), ("pipe", "plain")])
def test_resume_equals_uninterrupted_run(tmp_path, first, second):
    def strategy(kind):
        return (MemoryPipeStrategy(chunks=2), 3) if kind == "pipe" else ("auto", 1)

    uninterrupted, _ = _epochs("encdec", *strategy("plain"), epochs=2)
    ckpt = tmp_path / "epoch1.ckpt"
    _epochs("encdec", *strategy(first), epochs=1, save=ckpt)
    resumed, t = _epochs("encdec", *strategy(second), epochs=2, ckpt_path=ckpt)
    assert t.global_step == 2 * len(loader(make("encdec")[1], 8))
    assert max_rel_diff(resumed, uninterrupted) < 1e-5
    for param, state in t.optimizers[0].state.items():
        assert state["momentum_buffer"].device == param.device


def test_bad_configuration_errors():
    with pytest.raises(ValueError, match="chunks must be >= 1, got 0"):
        MemoryPipeStrategy(chunks=0)
    with pytest.raises(ValueError, match="every entry must be >= 1"):
        MemoryPipeStrategy(balance=[3, 0])
    with pytest.raises(ValueError, match="schedule must be one of 'gpipe', '1f1b', '2bw', 'interleaved-1f1b', "
                                         "'interleaved-zb', 'zbv', 'dualpipev', 'auto', got 'pipedream'"):
        MemoryPipeStrategy(schedule="pipedream")


def test_errors_at_setup_name_the_fix():
    model, data = make("unet")
    with pytest.raises(ValueError, match=r"balance \[2, 3\] sums to 5 but the traced model has \d+ nodes"):
        trainer(MemoryPipeStrategy(balance=[2, 3]), 2).fit(model, loader(data, 8))
    tiny = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="8 pipeline stages were requested but the traced model has only 1"):
        _run_module(tiny, 8)
    with pytest.raises(CaptureError, match=r"submodule 'net\.gate'(.|\n)*leaf_modules=\[.net\.gate.\]"):
        _run_module(Untraceable(), 2)
    _run_module(Untraceable(), 2, leaf_modules=["net.gate"])  # the suggested fix works


def test_predict_validate_test_on_a_short_last_batch_match_plain_module():
    model, _ = make("unet")
    batches = DataLoader(ImageDataset(size=18), batch_size=8)  # 8, 8 and 2 samples
    plain = trainer()
    expected_pred = torch.cat(plain.predict(model, batches))
    expected_val = plain.validate(model, batches, verbose=False)[0]["val_loss"]
    piped = trainer(MemoryPipeStrategy(chunks=4), 3)
    predictions = torch.cat(piped.predict(model, batches))
    assert predictions.shape[0] == 18
    assert torch.allclose(predictions, expected_pred, atol=1e-5)
    assert piped.validate(model, batches, verbose=False)[0]["val_loss"] == pytest.approx(expected_val, rel=1e-5)
    assert piped.test(model, batches, verbose=False)[0]["test_loss"] == pytest.approx(expected_val, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_training_with_short_batches_matches_single_device(schedule):
    data = TokenDataset(size=18)  # batches of 8, 8 and 2 samples; the sanity check sees 2

    def fit(strategy, devices):
        model, _ = make("gpt")
        t = trainer(strategy, devices, max_steps=-1, max_epochs=1)
        t.fit(model, DataLoader(data, batch_size=8), DataLoader(Subset(data, range(2)), batch_size=8))
        assert t.global_step == 3
        return model

    reference = fit("auto", 1)
    assert max_rel_diff(fit(MemoryPipeStrategy(chunks=4, schedule=schedule), 3), reference) < 1e-5


def test_user_balance_is_used():
    from lightning_pipe.graph.capture import capture

    model, data = make("unet")
    n = len(capture(UNet()).nodes)
    seen = []

    class Spy(Callback):
        def on_train_start(self, trainer, module):
            seen.append([len(s.node_names) for s in trainer.strategy.engine.program.stages])

    strategy = MemoryPipeStrategy(chunks=2, balance=[1, n - 1])
    trainer(strategy, 2, max_steps=1, callbacks=[Spy()]).fit(model, loader(data, 8))
    assert seen == [[1, n - 1]]


def _run_module(module, devices, leaf_modules=None):
    from lightning.pytorch import LightningModule

    class Wrapper(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = module

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    strategy = MemoryPipeStrategy(chunks=2, leaf_modules=leaf_modules)
    trainer(strategy, devices, max_steps=1).fit(Wrapper(), torch.utils.data.DataLoader(data, batch_size=4))


@pytest.mark.slow
def test_metered_fit_reports_stage_peaks_and_enforces_limits():
    from lightning_pipe.measure.meter import StageOutOfMemoryError

    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, measure_memory=True)
    trainer(strategy, 2, max_steps=2).fit(model, loader(data, 8))
    peaks = strategy.meter.peaks()
    assert all(p > 0 for p in peaks)
    summary = strategy.memory_summary().splitlines()
    assert len(summary) == 3 and "activations" in summary[1] and "cuda" not in summary[0]
    for stage, memory in zip(strategy.engine.program.stages, strategy.meter.stages):
        assert memory.peak_by_kind["parameters"] == stage.param_bytes() + sum(
            b.numel() * b.element_size() for b in stage.owned if not isinstance(b, torch.nn.Parameter)
        )
        assert memory.current["optimizer"] > 0  # SGD momentum buffers, charged after the step
    # The same run under a limit below the metered peak of stage 1 fails there, loudly.
    model, data = make("gpt")
    limit = [peaks[0] * 2, peaks[1] // 2]
    unplanned = MemoryPipeStrategy(chunks=2, planner=None, measure_memory=True, memory_limit=limit,
                                   balance=[len(s.node_names) for s in strategy.engine.program.stages])
    with pytest.raises(StageOutOfMemoryError, match="Stage 1 is out of memory"):
        trainer(unplanned, 2, max_steps=2).fit(model, loader(data, 8))
    with pytest.raises(ValueError, match="memory_limit has 3 entries but there are 2 stage devices"):
        three_limits = MemoryPipeStrategy(measure_memory=True, memory_limit=[1, 2, 3])
        trainer(three_limits, 2).fit(make("gpt")[0], loader(data, 8))


@pytest.mark.slow
def test_plan_is_made_from_the_first_training_batch_and_reused_by_validate(monkeypatch):
    """The sanity check's smaller eval batch must not be what the plan is for, and a later
    ``validate`` reuses the plan instead of profiling again."""
    from lightning_pipe.lightning import local as strategy_module

    profiled = []
    real = strategy_module.profile_graph

    def counting(*args, **kwargs):
        profiled.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(strategy_module, "profile_graph", counting)
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=4)
    t = trainer(strategy, 2, max_steps=2, limit_val_batches=1, num_sanity_val_steps=1)
    t.fit(model, loader(data, 16), loader(data, 4))
    assert len(profiled) == 1
    assert strategy.profile is not None and strategy.profile.microbatch_size == 16 // 4  # not 4 // 4
    plan = strategy.plan
    t.validate(model, loader(data, 4))
    assert len(profiled) == 1 and strategy.plan is plan
    assert [len(s.node_names) for s in strategy.engine.program.stages] == plan.balance


def _tokens(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(96, (batch, length + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


# the sequence grows, then the batch; the last, smaller batch fits the plan
GROWING = DataLoader([_tokens(8, 16, 0), _tokens(8, 24, 1), _tokens(16, 24, 2), _tokens(4, 16, 3)], batch_size=None)


def _count_profiles(monkeypatch) -> list[int]:
    from lightning_pipe.lightning import local as strategy_module

    sizes = []
    real = strategy_module.profile_graph

    def counting(captured, args, kwargs, **options):
        sizes.append(args[0]["input_ids"].shape[0])
        return real(captured, args, kwargs, **options)

    monkeypatch.setattr(strategy_module, "profile_graph", counting)
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_training_batch_larger_than_planned_is_planned_again(schedule, monkeypatch, caplog):
    reference, _ = make("gpt", context=32)
    trainer(max_steps=4).fit(reference, GROWING)
    profiled = _count_profiles(monkeypatch)
    model, _ = make("gpt", context=32)
    strategy = MemoryPipeStrategy(chunks=4, schedule=schedule)
    with caplog.at_level("INFO"):
        trainer(strategy, 2, max_steps=4).fit(model, GROWING)
    assert profiled == [2, 2, 4]  # micro-batches of the first batch, the longer one, the larger one
    assert strategy.plan.input_shapes == {"input_ids": [16, 24], "labels": [16, 24]}
    assert "plan_shapes={'input_ids': [16, 24], 'labels': [16, 24]}" in caplog.text
    assert max_rel_diff(model, reference) < 1e-5


def test_plan_shapes_plans_for_the_largest_batch_from_the_start(monkeypatch):
    profiled = _count_profiles(monkeypatch)
    model, _ = make("gpt", context=32)
    strategy = MemoryPipeStrategy(chunks=4, plan_shapes={"input_ids": [16, 24], "labels": [16, 24]})
    trainer(strategy, 2, max_steps=4).fit(model, GROWING)
    assert profiled == [4]
    assert strategy.plan.input_shapes == {"input_ids": [16, 24], "labels": [16, 24]}


def test_plan_shapes_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"plan_shapes must map batch tensor paths to shapes of positive sizes"):
        MemoryPipeStrategy(plan_shapes={"input_ids": [8, 0]})
    model, _ = make("gpt", context=32)
    strategy = MemoryPipeStrategy(chunks=4, plan_shapes={"ids": [16, 24]})
    with pytest.raises(ValueError, match=r"names \['ids'\], which the training batch does not have; its tensors are"):
        trainer(strategy, 2, max_steps=1).fit(model, GROWING)


class CallsSubmodules(GPT):
    """Its training_step runs the blocks itself instead of calling ``self(...)``."""

    def training_step(self, batch, batch_idx):
        return self.criterion(GPT.forward(self, batch), batch)


@pytest.mark.parametrize(
    "settings",
    [{"planner": None}, {"planner": None, "schedule": "1f1b"}, {"balance": [80, 80], "schedule": "1f1b"},
     {"schedule": "2bw"}, {}],
)
def test_a_step_that_never_calls_forward_is_named_under_every_setting(settings):
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"training_step never called the module's forward"):
        trainer(MemoryPipeStrategy(chunks=2, **settings), 2, max_steps=1).fit(
            CallsSubmodules(), loader(TokenDataset(8), 4)
        )


def test_a_buffer_written_in_forward_is_named_with_its_line_unless_one_micro_batch_makes_it_exact():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"forward writes the buffer 'ema' \(models.py:\d+: self.ema.mul_"):
        trainer(MemoryPipeStrategy(chunks=4, planner=None), 2, max_steps=1).fit(
            WritesInForward("ema"), loader(TokenDataset(8), 4)
        )
    # one micro-batch per step: forward runs once a step, as on one device
    torch.manual_seed(0)
    reference = WritesInForward("ema")
    trainer(max_steps=3).fit(reference, loader(TokenDataset(12), 4))
    torch.manual_seed(0)
    piped = WritesInForward("ema")
    trainer(MemoryPipeStrategy(chunks=1, planner=None), 2, max_steps=3).fit(piped, loader(TokenDataset(12), 4))
    assert reference.ema != 0 and torch.allclose(piped.ema, reference.ema, rtol=1e-5)


def test_a_python_attribute_changed_in_forward_is_named():
    torch.manual_seed(0)
    model = WritesInForward("calls")
    with pytest.raises(CaptureError, match=r"forward assigns to the Python attribute \(it was 0\) 'calls'"):
        trainer(MemoryPipeStrategy(chunks=4, planner=None), 2, max_steps=1).fit(model, loader(TokenDataset(8), 4))
    assert model.calls == 0  # tracing's change undone


def test_the_stage_clocks_are_read_only_at_steps_the_loggers_take(monkeypatch, tmp_path):
    """Reading a clock waits for the device on CUDA (the events' elapsed time): a step that
    logs nothing must not."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pipe.measure import clock

    reads = []
    real = clock.elapsed_ms
    monkeypatch.setattr(clock, "elapsed_ms", lambda *args: reads.append(1) or real(*args))

    def fit(**kwargs):
        reads.clear()
        model, data = make("gpt")
        trainer(MemoryPipeStrategy(chunks=2, schedule="1f1b", planner=None), 2, max_steps=4, **kwargs).fit(
            model, loader(data, 4)
        )
        return len(reads)

    assert fit() == 0  # no logger
    assert fit(logger=CSVLogger(tmp_path), log_every_n_steps=50) == 0  # a logger, no step it takes
    assert fit(logger=CSVLogger(tmp_path), log_every_n_steps=1) > 0  # read where it logs


def _hooks(strategy="auto", devices=1):
    """The hooks of four steps of the GPT, accumulating two batches a step, clipping by norm and
    decaying the learning rate every step."""
    from tests.lightning.distributed_fit import with_scheduler
    from tests.models import HookRecorder

    model, data = make("gpt")
    with_scheduler(model)
    recorder = HookRecorder()
    trainer(strategy, devices, max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.05,
            callbacks=[recorder]).fit(model, loader(data, 8))
    return recorder.calls


def without_backward_loss(calls):
    """The hooks with the loss on_before_backward saw left out: a schedule that runs backward
    per micro-batch calls it before the first one's backward, with that micro-batch's loss."""
    return [call[:2] if call[0] == "on_before_backward" else call for call in calls]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
def test_hooks_run_in_lightnings_order_with_its_values(schedule):
    expected, hooks = _hooks(), _hooks(MemoryPipeStrategy(chunks=4, schedule=schedule, planner=None), 2)
    if schedule == "gpipe":  # Lightning's own backward: every value as on one device
        assert hooks == expected
    elif schedule == "1f1b":  # the losses of on_train_batch_end are the batch's, as on one device
        assert without_backward_loss(hooks) == without_backward_loss(expected)
    else:  # 2BW's gradients are the stale weights': the order, the steps and the learning rates are Lightning's
        assert [call[:2] for call in hooks] == [call[:2] for call in expected]
        assert [c for c in hooks if c[0] == "on_before_optimizer_step"] == [
            c for c in expected if c[0] == "on_before_optimizer_step"]
