"""Lightning features inside the pipeline give what single-device training gives."""

import pytest
import torch
import torchmetrics

from examples.models import EncoderDecoder, loader
from lightning_pipe import MemoryPipeStrategy
from tests.helpers import max_rel_diff, trainer
from tests.models import make

PIPES = {
    "gpipe": lambda: (MemoryPipeStrategy(chunks=4), 3),
    "1f1b": lambda: (MemoryPipeStrategy(chunks=4, schedule="1f1b"), 3),
}


def _fit(family, pipe=None, model_cls=None, **trainer_kwargs):
    model, data = make(family)
    if model_cls is not None:
        torch.manual_seed(0)
        model = model_cls()
    strategy, devices = PIPES[pipe]() if pipe else ("auto", 1)
    t = trainer(strategy, devices, **trainer_kwargs)
    t.fit(model, loader(data, 8))
    return model, t


@pytest.mark.parametrize("pipe", ["gpipe", "1f1b"])
def test_gradient_clipping_by_global_norm(pipe):
    kwargs = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm", "max_steps": 3}
    reference, _ = _fit("gpt", **kwargs)
    piped, _ = _fit("gpt", pipe, **kwargs)
    unclipped, _ = _fit("gpt", max_steps=3)
    assert max_rel_diff(piped, reference) < 1e-5
    assert max_rel_diff(reference, unclipped) > 1e-3  # the clip was active


class _Dtypes(EncoderDecoder):
    """Records the dtype of the pipelined forward's output."""

    def training_step(self, batch, batch_idx):
        logits = self(*self.inputs(batch))
        self.seen = logits.dtype
        return self.criterion(logits, batch)


@pytest.mark.slow
@pytest.mark.parametrize("pipe", ["gpipe", "1f1b"])
def test_bf16_mixed_on_cpu(pipe):
    reference, _ = _fit("encdec", model_cls=_Dtypes, precision="bf16-mixed", max_steps=3)
    piped, _ = _fit("encdec", pipe, model_cls=_Dtypes, precision="bf16-mixed", max_steps=3)
    assert piped.seen == reference.seen == torch.bfloat16  # autocast reached every stage
    # Micro-batches round differently in bf16; the runs stay within bf16's precision.
    assert max_rel_diff(piped, reference) < 0.05


class _Scheduled(EncoderDecoder):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


@pytest.mark.slow
@pytest.mark.parametrize("pipe", ["gpipe", "1f1b"])
def test_lr_scheduler(pipe):
    reference, t_ref = _fit("encdec", model_cls=_Scheduled, max_steps=-1, max_epochs=2)
    piped, t = _fit("encdec", pipe, model_cls=_Scheduled, max_steps=-1, max_epochs=2)
    assert t.optimizers[0].param_groups[0]["lr"] == t_ref.optimizers[0].param_groups[0]["lr"] == 0.025
    assert max_rel_diff(piped, reference) < 1e-5


class _Manual(EncoderDecoder):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimization_in_autograd_driven_mode():
    reference, _ = _fit("encdec", model_cls=_Manual, max_steps=3)
    piped, _ = _fit("encdec", "gpipe", model_cls=_Manual, max_steps=3)
    assert max_rel_diff(piped, reference) < 1e-5


class _WithAccuracy(EncoderDecoder):
    def __init__(self):
        super().__init__()
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=64)

    def training_step(self, batch, batch_idx):
        logits = self(*self.inputs(batch))
        self.accuracy.update(logits.argmax(-1), batch["labels"])
        self.log("train_acc", self.accuracy, on_step=False, on_epoch=True)
        loss = self.criterion(logits, batch)
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("pipe", ["gpipe", "1f1b"])
def test_torchmetrics_and_logged_values_equal_single_device(pipe):
    _, t_ref = _fit("encdec", model_cls=_WithAccuracy, max_steps=-1, max_epochs=1)
    _, t = _fit("encdec", pipe, model_cls=_WithAccuracy, max_steps=-1, max_epochs=1)
    for name in ("train_acc", "train_loss"):
        assert float(t.callback_metrics[name]) == pytest.approx(float(t_ref.callback_metrics[name]), rel=1e-5)


class _LossMean(EncoderDecoder):
    """Logs a ``MeanMetric`` fed the loss itself, still attached to autograd (``self.mean(loss)``)."""

    def __init__(self):
        super().__init__()
        self.mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_mean", self.mean(loss))
        return loss


def test_a_metric_fed_the_attached_loss_logs_the_batch_mean():
    # the step copies every metric (a probe's stand-in, the batch's twin): a copy of one whose step value is attached
    # to autograd raised "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol"
    _, t_ref = _fit("encdec", model_cls=_LossMean, max_steps=2)
    _, t = _fit("encdec", "1f1b", model_cls=_LossMean, max_steps=2)
    assert float(t.callback_metrics["train_mean"]) == pytest.approx(float(t_ref.callback_metrics["train_mean"]),
                                                                    rel=1e-5)
