"""Lightning's and torchmetrics' private APIs, in one place: every other module goes through here.

A strategy that runs backward itself, per micro-batch and per stage, has to do from the outside
what Lightning's loop does from the inside (call the backward hooks, skip its own backward, set
a module's device, launch processes), and to replay torchmetrics' per-step values across
micro-batches and ranks. Neither library has public hooks for these. Each name below says why
it is needed and what stops working if it changes; ``tests/lightning/test_internals.py`` fails
when one of them moves, and ``tests/test_internals.py`` scans the package for a private
Lightning or torchmetrics name used anywhere else. torch's private APIs have their own fence,
:mod:`lightning_pipe.internals`; the supported versions are in ``pyproject.toml``.
"""

from typing import Any, TypeAlias

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from torch import Tensor
from torchmetrics import Metric

__all__ = [
    "METADATA_FILENAME", "PATH", "ConfiguresLauncher", "FitLoop", "SubprocessScriptLauncher", "all_gather",
    "attached_trainer", "batches_that_stepped", "call_callback_hooks", "call_module_hook", "copy_metric",
    "default_backend", "forget_computed", "init_process_group", "logged_results", "set_device", "set_device_mesh",
    "set_launcher", "set_lightning_module", "set_skip_backward", "set_step_value", "set_sync_on_step",
    "set_update_count", "should_update_logs", "sigkill_signal", "skip_backward", "step_value", "sync",
]

# --- names and types -------------------------------------------------------------------------------

# What Lightning's checkpoint methods take as a path (``str | Path``): overrides of them keep
# Lightning's parameter type.
PATH: TypeAlias = _PATH

# The file of a sharded checkpoint directory that holds everything but the tensors: the sharded
# checkpoint is written and read as Lightning's own (FSDP's, ModelParallelStrategy's) so that
# either loads the other's. A new name makes ours unreadable to Lightning and the other way.
METADATA_FILENAME: str = _METADATA_FILENAME

# The fit loop's class (type annotations only).
FitLoop: TypeAlias = _FitLoop

# Lightning's launcher of one process per device running the user's script again (what DDP
# uses); runtime="distributed" launches the same way. No public launcher class.
SubprocessScriptLauncher: TypeAlias = _SubprocessScriptLauncher


# --- the strategy ----------------------------------------------------------------------------------

class ConfiguresLauncher:
    """The strategy's launcher is asked for through a private hook (``Strategy._configure_launcher``,
    which the Trainer's accelerator connector calls; every built-in strategy overrides it). A
    private override cannot be wrapped: it lives here and calls :meth:`configure_launcher`. Mix in
    before the strategy's base class."""

    def configure_launcher(self) -> None:
        """Set the launcher (:func:`set_launcher`), or leave none."""

    def _configure_launcher(self) -> None:
        self.configure_launcher()


def set_launcher(strategy: Strategy, launcher: Any) -> None:
    """``strategy``'s launcher (``Strategy._launcher``, read by the public ``launcher``
    property; Lightning has no setter)."""
    strategy._launcher = launcher


def set_lightning_module(strategy: Strategy, module: LightningModule | None) -> None:
    """Attach ``module`` to ``strategy`` without ``connect`` (which also wraps and moves it):
    teardown detaches the module for a moment so that Lightning's ``module.cpu()`` skips a
    module whose tensors stay on meta, then puts it back."""
    strategy._lightning_module = module


def sigkill_signal() -> Any:
    """The signal Lightning kills launched processes with (SIGKILL; SIGTERM on Windows)."""
    return _get_sigkill_signal()


# --- the training loop ----------------------------------------------------------------------------

def skip_backward(loop: FitLoop) -> bool:
    """Whether the fit loop skips its own backward this step (``_FitLoop._skip_backward``): the
    strategy runs backward inside ``training_step`` for a schedule-driven pipeline, and so must
    stop Lightning's; SWA's callback sets it too (its BatchNorm epoch), so it is read first."""
    return bool(loop._skip_backward)


def set_skip_backward(loop: FitLoop, value: bool) -> None:
    """Set :func:`skip_backward`; if this stops working Lightning runs a second backward."""
    loop._skip_backward = value


def call_callback_hooks(trainer: Trainer, hook: str, *args: Any) -> None:
    """Call ``hook`` on every callback, as the loop does around its own backward: the strategy
    runs backward itself (per micro-batch, per stage), so it calls the hooks the loop would."""
    call._call_callback_hooks(trainer, hook, *args)


def call_module_hook(trainer: Trainer, hook: str, *args: Any) -> Any:
    """Call ``hook`` on the LightningModule as the loop does (with its profiler section and
    the module's ``_current_fx_name`` set, so that ``self.log`` inside the hook works)."""
    return call._call_lightning_module_hook(trainer, hook, *args)


def should_update_logs(trainer: Trainer) -> bool:
    """Whether the loggers take metrics this step (``log_every_n_steps``), as Lightning decides
    it: the stage clocks, which wait for the device on CUDA, are read only then."""
    return bool(trainer._logger_connector.should_update_logs)


def batches_that_stepped(trainer: Trainer) -> int:
    """The step Lightning's own logged metrics carry (``_batches_that_stepped``): the stage
    metrics are logged at the same step so that they line up with the user's."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def logged_results(trainer: Trainer | None) -> dict[str, object] | None:
    """The training loop's logged values (``Trainer._results``, a ``ResultCollection``: a dict
    of metrics per logged name), ``None`` outside a loop. A failed attempt's ``self.log`` calls
    are taken back from it; if this changes, a retried step logs its values twice."""
    results = getattr(trainer, "_results", None) if trainer is not None else None
    return results if isinstance(results, dict) else None


# --- the LightningModule -------------------------------------------------------------------------

def attached_trainer(module: LightningModule) -> Trainer | None:
    """``module``'s Trainer, ``None`` when it has none (the public ``trainer`` raises then)."""
    trainer: Trainer | None = module._trainer
    return trainer


def set_device(module: LightningModule, device: torch.device) -> None:
    """What ``module.device`` says: the strategy moves the stages, not the module, so it sets
    the device the module's own ``.to()`` would have recorded (``self.device`` in user code)."""
    module._device = device


def set_device_mesh(module: LightningModule, mesh: Any) -> None:
    """``module.device_mesh``, as ``ModelParallelStrategy`` sets it (Lightning has no setter)."""
    module._device_mesh = mesh


# --- processes --------------------------------------------------------------------------------------

def default_backend(device: torch.device) -> str:
    """The process group backend Lightning picks for ``device`` (``nccl``, ``gloo``, ...)."""
    return _get_default_process_group_backend_for_device(device)


def init_process_group(environment: ClusterEnvironment, backend: str, **kwargs: Any) -> None:
    """Start the default process group from ``environment`` as Lightning's own strategies do
    (``MASTER_ADDR``/``MASTER_PORT`` from it, the rank and world size, Lightning's warnings)."""
    _init_dist_connection(environment, backend, **kwargs)


def sync(tensor: Tensor, group: Any, reduce_op: Any) -> Tensor:
    """``tensor`` reduced over ``group`` as Lightning's ``reduce`` does (``"mean"`` included,
    and nothing without a process group)."""
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def all_gather(tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
    """``tensor`` gathered over ``group`` as Lightning's ``all_gather`` does."""
    return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)


# --- torchmetrics ---------------------------------------------------------------------------------

def step_value(metric: Metric) -> Any:
    """What the metric's last ``forward`` returned (``Metric._forward_cache``): what Lightning
    logs for a ``Metric`` logged with ``on_step=True``."""
    return metric._forward_cache


def set_step_value(metric: Metric, value: Any) -> None:
    """Set :func:`step_value`: micro-batches' forwards are merged into the batch's value, and a
    rank that did not run the metric gets the last stage's. If this stops working the logged
    step value is the last micro-batch's."""
    metric._forward_cache = value


def copy_metric(metric: Metric) -> Metric:
    """``metric.clone()`` with no step value: ``clone`` deep-copies the metric, which fails on
    a step value still attached to autograd (a metric fed the loss, ``self.mean(loss)``). A
    copy is fed or reset before anything reads its step value."""
    value, metric._forward_cache = metric._forward_cache, None
    try:
        return metric.clone()
    finally:
        metric._forward_cache = value


def set_update_count(metric: Metric, count: int) -> None:
    """``metric.update_count`` (read-only publicly), put back with the states: a retried step
    or another rank's replayed metric has the updates it had."""
    metric._update_count = count


def forget_computed(metric: Metric) -> None:
    """Drop the metric's cached ``compute()`` result (``Metric._computed``): its states were
    set from outside, so the cache is stale."""
    metric._computed = None


def set_sync_on_step(metric: Metric, value: bool) -> None:
    """Whether the next ``compute()`` syncs across processes (``Metric._to_sync``), which
    ``forward`` sets to ``dist_sync_on_step``: a twin fed by ``update`` computes a step value
    that syncs as the metric's own ``forward`` would."""
    metric._to_sync = value
