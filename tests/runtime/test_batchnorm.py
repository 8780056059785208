import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import TensorDataset

from examples.models import loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.graph.capture import capture
from lightning_pipe.runtime.batchnorm import DeferredBatchNorm
from lightning_pipe.runtime.build import build
from lightning_pipe.runtime.gpipe import Pipeline
from tests.helpers import max_rel_diff, trainer
from tests.models import make

CPU = torch.device("cpu")
STATS = ["bn2d.running_mean", "bn2d.running_var", "bn1d.running_mean", "bn1d.running_var"]


class BNNet(LightningModule):
    """A conv branch with BatchNorm2d and a pooled linear branch with BatchNorm1d (cumulative
    average), added and fed to a linear head.

    Each BatchNorm reads values no other BatchNorm normalised (a later one would see micro-batch
    normalisation upstream), and ``lr=0`` keeps the weights fixed, so piped and single-device
    runs feed every BatchNorm the same values.
    """

    def __init__(self, lr: float = 0.0):
        super().__init__()
        self.lr = lr
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn2d = nn.BatchNorm2d(8)
        self.fc = nn.Linear(3, 8)
        self.bn1d = nn.BatchNorm1d(8, momentum=None)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        a = F.relu(self.bn2d(self.conv(x))).mean(dim=(2, 3))
        b = F.relu(self.bn1d(self.fc(x.mean(dim=(2, 3)))))
        return self.head(a + b)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _data(size=80):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(size, 3, 6, 6, generator=g) * 2 + 1, torch.randn(size, 1, generator=g))


def _fit(strategy="auto", devices=1, callbacks=()):
    torch.manual_seed(0)
    model = BNNet()
    trainer(strategy, devices, callbacks=list(callbacks)).fit(model, loader(_data(), 16))
    return model


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_running_statistics_equal_single_device_training_only_when_deferred(schedule):
    reference = _fit()
    deferred = _fit(MemoryPipeStrategy(chunks=4, schedule=schedule, deferred_batch_norm=True), 3)
    assert max_rel_diff(deferred, reference, STATS) < 1e-5
    assert deferred.bn2d.num_batches_tracked == reference.bn2d.num_batches_tracked == 5
    stock = _fit(MemoryPipeStrategy(chunks=4, schedule=schedule), 3)
    assert max_rel_diff(stock, reference, STATS) > 1e-2
    assert stock.bn2d.num_batches_tracked == 20  # once per micro-batch


class _StateKeys(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.keys = set(module.state_dict())


def test_state_dict_keys_are_the_plain_modules_and_teardown_restores_the_layers(tmp_path):
    spy = _StateKeys()
    model = _fit(MemoryPipeStrategy(chunks=4, deferred_batch_norm=True), 2, callbacks=[spy])
    assert spy.keys == set(BNNet().state_dict())
    assert type(model.bn2d) is nn.BatchNorm2d and "forward" not in vars(model.bn2d)
    torch.save(model.state_dict(), tmp_path / "bn.pt")
    BNNet().load_state_dict(torch.load(tmp_path / "bn.pt"))  # strict


def _warnings(strategy, model, fn="fit"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer(strategy, 2, max_steps=1)
        data = loader(_data(), 16) if isinstance(model, BNNet) else loader(make("gpt")[1], 8)
        getattr(t, fn)(model, data)
    return [str(w.message) for w in caught if "deferred_batch_norm" in str(w.message)]


@pytest.mark.slow
def test_warning_names_the_option_only_when_micro_batches_change_the_statistics():
    (message,) = _warnings(MemoryPipeStrategy(chunks=4), BNNet())
    assert "bn2d, bn1d" in message and "MemoryPipeStrategy(deferred_batch_norm=True)" in message
    assert not _warnings(MemoryPipeStrategy(chunks=4, deferred_batch_norm=True), BNNet())
    assert not _warnings(MemoryPipeStrategy(chunks=1), BNNet())
    assert not _warnings(MemoryPipeStrategy(chunks=4), make("gpt")[0])  # no BatchNorm
    assert not _warnings(MemoryPipeStrategy(chunks=4), BNNet(), "predict")  # eval uses the running statistics


def test_recomputed_micro_batches_are_not_recorded_twice():
    torch.manual_seed(0)
    model = BNNet()
    plain = copy.deepcopy(model)
    x = _data(16).tensors[0]
    deferred = DeferredBatchNorm(model)
    captured = capture(model)
    n = len(captured.nodes)
    recompute = {node.name: "recompute" for node in captured.nodes}
    program = build(captured, model, [n // 2, n - n // 2], [CPU, CPU], recompute)
    pipe = Pipeline(program, model, 4, CPU, batch_norm=deferred)
    for _ in range(2):  # a recompute recorded in the first batch's backward would leak into the second
        pipe(x).sum().backward()
        plain(x)
    assert max_rel_diff(model, plain, STATS) < 1e-5
    assert model.bn1d.num_batches_tracked == 2


def test_normalisation_is_per_micro_batch_and_eval_is_unchanged():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    plain = copy.deepcopy(bn)
    deferred = DeferredBatchNorm(bn)
    x = torch.randn(8, 4) * 3 + 1
    assert torch.allclose(bn(x[:4]), plain(x[:4]), atol=1e-6)  # micro-batch statistics normalise
    assert bn.running_mean.abs().sum() == 0  # nothing committed yet
    deferred.commit()
    bn.eval(), plain.eval()
    assert torch.allclose(bn(x), plain(x), atol=1e-6)
    deferred.restore()
    assert "forward" not in vars(bn)
