"""Under 1F1B and 2BW the strategy runs training_step per micro-batch and the backwards itself;
what Lightning shows the user (logged values, hook order, callbacks, the loss) stays that of
single-device training."""

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from torch.utils.data import DataLoader, TensorDataset

from examples.models import EncoderDecoder, Seq2SeqDataset, loader
from lightning_pipe import MemoryPipeStrategy
from tests.helpers import max_rel_diff, trainer


def _fit(model_cls, schedule=None, strategy_kwargs=None, data=None, batch_size=8, **trainer_kwargs):
    torch.manual_seed(0)
    model = model_cls()
    if schedule is None:
        strategy, devices = "auto", 1
    else:
        strategy, devices = MemoryPipeStrategy(chunks=4, schedule=schedule, **(strategy_kwargs or {})), 3
    t = trainer(strategy, devices, **trainer_kwargs)
    t.fit(model, loader(data or Seq2SeqDataset(), batch_size))
    return model, t


class _Classifier(LightningModule):
    """Four classes; accuracy averaged over classes, which no weighting of per-micro-batch
    values reproduces."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=4, average="macro")
        self.acc_object = torchmetrics.Accuracy(task="multiclass", num_classes=4, average="macro")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        preds = logits.argmax(-1)
        self.log("acc", self.acc(preds, y), on_step=True, on_epoch=True)
        self.acc_object(preds, y)
        self.log("acc_object", self.acc_object, on_step=True, on_epoch=True)
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _StepValues(Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("_step")})


def _classes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, (x[:, :4] + 0.5 * torch.randn(64, 4, generator=g)).argmax(-1))


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_logged_step_and_epoch_values_equal_single_device(schedule):
    batch_size = 64 if schedule == "2bw" else 16  # 2BW's first step alone runs on the same weights
    runs = {}
    for name in (None, schedule):
        values = _StepValues()
        torch.manual_seed(0)
        model = _Classifier()
        strategy = "auto" if name is None else MemoryPipeStrategy(chunks=4, schedule=name, planner=None)
        t = trainer(strategy, 1 if name is None else 2, max_steps=-1, max_epochs=1, callbacks=[values])
        t.fit(model, DataLoader(_classes(), batch_size=batch_size))
        runs[name] = values.steps, {k: float(v) for k, v in t.callback_metrics.items() if k.endswith("_epoch")}
    (steps, epoch), (ref_steps, ref_epoch) = runs[schedule], runs[None]
    assert len(steps) == len(ref_steps) and ref_steps[0].keys() == {"acc_step", "acc_object_step", "loss_step"}
    for got, want in zip(steps, ref_steps):
        assert got == pytest.approx(want, rel=1e-5)
    assert epoch == pytest.approx(ref_epoch, rel=1e-5)
    assert 0.2 < ref_epoch["acc_epoch"] < 0.8  # neither trivial nor perfect


class _Order(EncoderDecoder):
    """Records the hooks around backward and every parameter's gradient as it lands."""

    def on_fit_start(self):
        self.events = []
        for p in self.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.events.append("backward"))

    def training_step(self, batch, batch_idx):
        self.events.append("training_step")
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss):
        assert all(p.grad is None for p in self.parameters()), "a backward ran before on_before_backward"
        self.events.append("on_before_backward")

    def on_after_backward(self):
        assert all(p.grad is not None for p in self.parameters())
        self.events.append("on_after_backward")


class _RecordHooks(Callback):
    def on_before_zero_grad(self, trainer, module, optimizer):
        module.events.append("zero_grad")

    def on_before_backward(self, trainer, module, loss):
        module.events.append("callback.on_before_backward")

    def on_after_backward(self, trainer, module):
        module.events.append("callback.on_after_backward")

    def on_before_optimizer_step(self, trainer, module, optimizer):
        module.events.append("optimizer_step")


def _collapsed(events):
    return [e for k, e in enumerate(events) if k == 0 or e != events[k - 1]]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [None, "gpipe", "1f1b", "2bw"])
def test_hooks_around_backward_keep_lightnings_order(schedule):
    model, _ = _fit(_Order, schedule, max_steps=2, callbacks=[_RecordHooks()])
    steps = " ".join(_collapsed(model.events)).split("optimizer_step")[:-1]
    assert len(steps) == 2
    for step in steps:
        events = step.split()
        # training_step (of the first micro-batch), zero grad, on_before_backward, the
        # backwards (with the other micro-batches' training_step in between), on_after_backward
        assert events[:4] == ["training_step", "zero_grad", "callback.on_before_backward", "on_before_backward"]
        assert events[-3:] == ["backward", "callback.on_after_backward", "on_after_backward"]
        assert set(events[4:-2]) == ({"backward"} if schedule in (None, "gpipe") else {"backward", "training_step"})


class _Swa(EncoderDecoder):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.slow
def test_stochastic_weight_averaging_matches_single_device():
    runs = {}
    for schedule in (None, "1f1b"):
        swa = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1)
        runs[schedule], t = _fit(_Swa, schedule, max_steps=-1, max_epochs=3, callbacks=[swa])
        assert not t.fit_loop._skip_backward  # given back as found
    assert max_rel_diff(runs["1f1b"], runs[None]) < 1e-5


class _BatchNormed(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_swa_batch_norm_epoch_runs_forwards_only_as_gpipe_does():
    """With BatchNorm, SWA adds an epoch that skips backward to recompute the running
    statistics; the schedule-driven step then runs forwards only. Micro-batches normalise
    on their own under any pipeline, so GPipe is the reference."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        runs[schedule] = _BatchNormed()
        strategy = MemoryPipeStrategy(chunks=4, schedule=schedule, planner=None, deferred_batch_norm=True)
        swa = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1)
        t = trainer(strategy, 2, max_steps=-1, max_epochs=3, callbacks=[swa])
        t.fit(runs[schedule], DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16))
        assert t.current_epoch == 4  # the BatchNorm epoch ran
    assert max_rel_diff(runs["1f1b"], runs["gpipe"]) < 1e-5  # running statistics included


class _SumLoss(EncoderDecoder):
    def __init__(self):
        super().__init__(lr=0.05 / 80)  # the loss sums 8 x 10 tokens

    def criterion(self, logits, batch):
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sum_reduced_loss_matches_single_device(schedule):
    kwargs = {"max_steps": 4, "accumulate_grad_batches": 2, "log_every_n_steps": 1}
    reference, t_ref = _fit(_SumLoss, **kwargs)
    piped, t = _fit(_SumLoss, schedule, {"loss_reduction": "sum"}, **kwargs)
    assert max_rel_diff(piped, reference) < 1e-5
    # the logged loss is the batch's sum, not a mean of the micro-batch sums
    logged, expected = (float(run.callback_metrics["train_loss"]) for run in (t, t_ref))
    assert logged == pytest.approx(expected, rel=1e-5)


def test_loss_reduction_is_checked_and_typed_for_the_cli(tmp_path, capsys):
    from lightning.pytorch.cli import LightningCLI

    with pytest.raises(ValueError, match=r"loss_reduction must be 'mean'.*or 'sum'"):
        MemoryPipeStrategy(loss_reduction="total")
    args = ["--config", "examples/configs/unet.yaml", f"--trainer.default_root_dir={tmp_path}"]
    cli = LightningCLI(run=False, args=[*args, "--trainer.strategy.loss_reduction=sum"])
    assert cli.trainer.strategy.options.loss_reduction == "sum"
    with pytest.raises(SystemExit):
        LightningCLI(run=False, args=[*args, "--trainer.strategy.loss_reduction=total"])
    assert "loss_reduction" in capsys.readouterr().err
