"""The fence around Lightning's and torchmetrics' private APIs
(:mod:`lightning_pipe.lightning.internals`): each name still exists and does what the strategy
relies on, against the installed Lightning and torchmetrics. A failure here means one of them
changed a private API the package uses: fix the fence before widening their ranges in
pyproject.toml. (tests/test_internals.py checks nothing private is used outside the fences.)"""

import inspect
import signal
import typing
from pathlib import Path

import torch
import torchmetrics
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.connectors import accelerator_connector
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe.internals import default_store
from lightning_pipe.lightning import internals as fence
from tests.helpers import trainer as make_trainer


class _Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.after_backward = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.log("loss", batch[0].sum())
        return self.layer(batch[0]).sum()

    def on_after_backward(self) -> None:
        self.after_backward += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)


class _Loop(Callback):
    """Reads the loop's internals through the fence while it runs; skips every backward."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, ...]] = []
        self.after_backward = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):  # type: ignore[no-untyped-def]
        assert not fence.skip_backward(trainer.fit_loop)
        fence.set_skip_backward(trainer.fit_loop, True)
        assert fence.skip_backward(trainer.fit_loop)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        results = fence.logged_results(trainer)
        self.seen.append((fence.should_update_logs(trainer), fence.batches_that_stepped(trainer), trainer.global_step,
                          results is not None and any(key.endswith("loss") for key in results),
                          fence.attached_trainer(module) is trainer))
        fence.set_skip_backward(trainer.fit_loop, False)

    def on_after_backward(self, trainer, module):  # type: ignore[no-untyped-def]
        self.after_backward += 1


def test_the_training_loop_through_the_fence() -> None:
    module, loop = _Module(), _Loop()
    trainer = make_trainer(max_steps=2, callbacks=[loop], log_every_n_steps=1)
    trainer.fit(module)
    assert module.after_backward == loop.after_backward == 0  # Lightning's backward was skipped
    # at a batch's end the loop's logging step still counts the batches before it; global_step counts it
    assert [(update, stepped) for update, stepped, *_ in loop.seen] == [(True, 0), (True, 1)]
    assert all(step == stepped + 1 for _, stepped, step, *_ in loop.seen)
    assert all(logged and attached for *_, logged, attached in loop.seen)
    assert isinstance(trainer.fit_loop, fence.FitLoop)
    assert fence.logged_results(None) is None

    # the hooks the strategy calls in place of the loop's
    fence.call_callback_hooks(trainer, "on_after_backward")
    fence.call_module_hook(trainer, "on_after_backward")
    assert module.after_backward == loop.after_backward == 1


def test_a_module_s_device_mesh_and_trainer() -> None:
    module = _Module()
    assert fence.attached_trainer(module) is None
    fence.set_device(module, torch.device("meta"))
    assert module.device == torch.device("meta")
    mesh = object()
    fence.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh


class _Launched(fence.ConfiguresLauncher, SingleDeviceStrategy):
    def configure_launcher(self) -> None:
        self.configured = True
        fence.set_launcher(self, "a launcher")


def test_the_trainer_asks_the_strategy_for_its_launcher() -> None:
    assert "strategy._configure_launcher()" in inspect.getsource(accelerator_connector)
    strategy = _Launched(device=torch.device("cpu"))
    make_trainer(strategy)
    assert strategy.configured and strategy.launcher == "a launcher"
    module = _Module()
    fence.set_lightning_module(strategy, module)
    assert strategy.lightning_module is module
    fence.set_lightning_module(strategy, None)
    assert strategy.lightning_module is None
    assert fence.SubprocessScriptLauncher.__name__ == "_SubprocessScriptLauncher"
    assert {"cluster_environment", "num_processes", "num_nodes"} <= set(
        inspect.signature(fence.SubprocessScriptLauncher).parameters)
    assert callable(fence.SubprocessScriptLauncher.kill)
    assert fence.sigkill_signal() in (signal.SIGKILL, signal.SIGTERM)


def test_names_and_types() -> None:
    assert set(typing.get_args(fence.PATH)) == {str, Path}
    assert fence.METADATA_FILENAME == "meta.pt"  # what Lightning's sharded checkpoints hold besides tensors


def test_a_process_group_the_way_lightning_starts_one(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_network_port()))
    assert fence.default_backend(torch.device("cpu")) == "gloo"
    environment = LightningEnvironment()
    environment.set_world_size(1)
    environment.set_global_rank(0)
    fence.init_process_group(environment, "gloo")
    try:
        assert torch.distributed.get_world_size() == 1
        assert fence.sync(torch.tensor([3.0]), None, "mean").tolist() == [3.0]
        assert fence.all_gather(torch.tensor([2.0])).tolist() == [[2.0]]
        store = default_store()
        store.set("key", "value")
        assert store.get("key") == b"value"
    finally:
        torch.distributed.destroy_process_group()


def test_metric_internals() -> None:
    metric = torchmetrics.MeanMetric()
    value = metric(torch.tensor([1.0, 3.0]))
    assert fence.step_value(metric) is value  # what forward returned: what Lightning logs on step
    fence.set_step_value(metric, torch.tensor(7.0))
    assert fence.step_value(metric) == 7.0

    assert metric.update_count == 1
    fence.set_update_count(metric, 5)
    assert metric.update_count == 5

    assert metric.compute() == 2.0
    metric.mean_value, metric.weight = torch.tensor(8.0), torch.tensor(2.0)
    assert metric.compute() == 2.0  # cached
    fence.forget_computed(metric)
    assert metric.compute() == 4.0

    fence.set_sync_on_step(metric, True)
    assert metric._to_sync is True
    assert "should_sync=self._to_sync" in inspect.getsource(torchmetrics.Metric)  # what compute() syncs by
