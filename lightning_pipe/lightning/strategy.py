"""MemoryPipeStrategy: pipeline an unmodified LightningModule over the Trainer's devices.

The strategy is what Lightning talks to: the options, Lightning's backward skipped where the
schedule runs it, the optimizer step and its metrics, teardown. Where the stages live and how a
step runs on them is its engine's (:mod:`~lightning_pipe.lightning.engine`): every stage in this
process (:mod:`.local`), or a process per stage (:mod:`.distributed`).
"""

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pipe.lightning.distributed import DistributedEngine
from lightning_pipe.lightning.engine import Engine
from lightning_pipe.lightning.internals import PATH, ConfiguresLauncher, FitLoop, set_skip_backward, skip_backward
from lightning_pipe.lightning.local import LocalEngine
from lightning_pipe.lightning.metrics import logs_this_step
from lightning_pipe.lightning.microlog import LossReduction
from lightning_pipe.lightning.options import DataParallel, PipeOptions, Runtime, StateDictType, parse_limits
from lightning_pipe.lightning.recovery import RecoveryError
from lightning_pipe.measure.meter import MemoryMeter, StageOutOfMemoryError
from lightning_pipe.plan.partitioners import Partitioner
from lightning_pipe.plan.plan import Plan
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanSchedule
from lightning_pipe.runtime.batchnorm import batch_norm_layers
from lightning_pipe.units import MemorySize

__all__ = ["MemoryPipeStrategy"]


class MemoryPipeStrategy(ConfiguresLauncher, ParallelStrategy):
    """Pipeline-parallel training of an unmodified LightningModule: its stages in this process,
    one per device (``runtime="local"``), or one process per stage (``runtime="distributed"``).

    Args:
        chunks: micro-batches per batch; a batch with fewer samples (an epoch's short last
            batch) runs as one-sample micro-batches.
        schedule: ``"gpipe"`` (autograd-driven), ``"1f1b"`` or ``"2bw"`` (schedule-driven);
            under ``runtime="distributed"`` (not ``"2bw"``) also ``"interleaved-1f1b"``,
            ``"interleaved-zb"``, ``"zbv"`` and ``"dualpipev"``, several stages per process
            (``virtual_stages``), and ``"auto"``: at the first training batch the planner plans
            each of these (:data:`~lightning_pipe.plan.auto.CANDIDATES`, those whose
            micro-batch rule ``chunks`` meets) and every rank runs the one of fastest simulated
            step that fits, with its stages per process; global rank 0 logs the plan with every
            schedule weighed (step and per-process peaks, or why none) and writes it as
            ``plan.json`` to the logger's folder. Plans made again keep the pick. Under
            ``"auto"``, ``memory_limit`` is per process, and it needs a planner, no
            ``balance``, ``virtual_stages`` or ``data_parallel="fsdp"``.
        balance: graph nodes per stage, in order; overrides the planner.
        leaf_modules: submodule names (``"blocks.3"``) or class names (``"Block"``) that
            tracing keeps as single nodes, e.g. code torch.fx cannot trace.
        planner: how to split: ``"dawnpiper"`` (memory-centric, default), ``"capslog"``
            (lowest peak), ``"time"``, ``"params"``, ``"uniform"``; ``None``: an even split
            by parameter bytes, no profiling.
        memory_limit: bytes per stage device, as a number or a string such as ``"2GiB"``;
            one value for all stages or one per stage. Default: each device's memory shared
            by the stages on it. With ``measure_memory``, going over it raises
            :class:`~lightning_pipe.measure.meter.StageOutOfMemoryError`.
        host_bandwidth: bytes per second between a device and host memory; lets the planner
            swap activations to the host. ``None``: the planner only recomputes.
        link_bandwidth: bytes per second between stage devices; the planner prices what
            crosses each cut. ``None``: transfers between stages cost nothing.
        measure_memory: meter every stage's memory from its live tensors while running
            (``strategy.meter``); costs some speed.
        deferred_batch_norm: BatchNorm layers update their running statistics once per batch
            with the whole batch's statistics, as on one device, instead of once per
            micro-batch; each micro-batch is still normalised with its own statistics.
        plan_shapes: the largest batch to plan for, as the shape of each batch tensor by its
            path in the batch (``{"input_ids": [8, 512]}``; ``"0"``, ``"1"`` for a tuple batch;
            ``"batch"`` for a lone tensor). The first training batch is repeated to these
            shapes to profile. Without it the plan is made for the first training batch, and a
            later batch larger in any dimension is planned again.
        loss_reduction: how ``training_step``'s loss reduces over the samples, for 1F1B and
            2BW, which call ``training_step`` per micro-batch and combine the micro-batch
            losses (the choice ``scale_grads`` makes in ``torch.distributed.pipelining``): ``"mean"``
            (a per-sample mean, the default) weights each by its share of the batch;
            ``"sum"`` adds them unscaled. Gradients, the returned loss and a logged loss then
            equal single-device training's. GPipe computes the loss on the whole batch and
            needs neither.
        runtime: ``"local"``: every stage in this process, one per device; ``"distributed"``:
            one process per device (Lightning's launcher, torchrun or SLURM), pipelines of
            ``stages`` processes times data-parallel replicas (:mod:`.distributed`).
        stages: pipeline depth under ``runtime="distributed"``; default all processes.
        virtual_stages: under ``runtime="distributed"``, stages per process: the model is split
            into ``stages * virtual_stages`` stages, process ``p`` running stages ``p``,
            ``p + stages``, ... (a loop), under ``schedule="interleaved-1f1b"`` (Interleaved 1F1B;
            ``"1f1b"`` with ``virtual_stages > 1`` is the same) or ``"interleaved-zb"``
            (interleaved zero-bubble, its backward split into input and weight gradients), both
            ``torch.distributed.pipelining``'s. Default: 2 for those two, else 1. ``"zbv"`` and
            ``"dualpipev"`` always hold 2 stages per process as a V (process ``r`` runs stages
            ``r`` and ``2 * stages - 1 - r``).
        timeout: under ``runtime="distributed"``, how long a rank waits for another before
            failing (default 30 minutes), so that an error on one rank ends every rank.
        state_dict_type: under ``runtime="distributed"``, ``"full"`` gathers checkpoints on
            global rank 0 into one file; ``"sharded"`` has every rank write its own stage's
            tensors and optimizer state into a ``torch.distributed.checkpoint`` directory, for
            models too big to gather.
        max_replans: with a planner, how many times a run may plan again because a stage ran
            out of memory (:class:`~lightning_pipe.measure.meter.StageOutOfMemoryError` or
            ``torch.OutOfMemoryError``: the step is undone, planned for below the memory it
            took and run again) or drifted more than 5% past its prediction and its target;
            then a stage running out raises :class:`~lightning_pipe.lightning.recovery.RecoveryError`.
            Under ``runtime="distributed"`` every rank agrees on a failure, plans again and
            rebuilds together, and raises together.
        plan: the path of a saved ``plan.json`` (as ``lightning-pipe plan --out`` and a
            training run's logger folder hold it) to train with exactly: its split and
            per-node choices, no profiling or planning, never planned again. The model's graph
            must be the one it was made for, and micro-batches at most its size (a clear error
            names what differs); under ``runtime="distributed"`` one stage per process and
            virtual stage.
        data_parallel: under ``runtime="distributed"``, how the data-parallel replicas of a
            stage share it: ``"ddp"`` (default), each holds the whole stage and gradients are
            averaged; ``"fsdp"``, each holds ``1 / replicas`` of its parameters, gradients and
            optimizer state (``torch.distributed.fsdp.fully_shard`` over the replicas), and
            gathers them per layer block for its forward and backward. Needs more processes
            than ``stages``; ``precision="bf16-mixed"`` gathers in bfloat16.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend: as for Lightning's own strategies (``DDPStrategy``); the
            Trainer fills them in when they are not given. ``process_group_backend`` (default:
            ``"nccl"`` on CUDA, else ``"gloo"``) applies to ``runtime="distributed"``.

    Every argument is keyword-only.
    """

    strategy_name = "memory_pipe"

    def __init__(
        self,
        *,
        chunks: int = 4,
        schedule: PlanSchedule = "gpipe",
        balance: list[int] | None = None,
        leaf_modules: list[str] | None = None,
        planner: Partitioner | None = "dawnpiper",
        memory_limit: MemorySize | list[MemorySize] | None = None,
        host_bandwidth: float | None = None,
        link_bandwidth: float | None = None,
        measure_memory: bool = False,
        deferred_batch_norm: bool = False,
        plan_shapes: dict[str, list[int]] | None = None,
        loss_reduction: LossReduction = "mean",
        runtime: Runtime = "local",
        stages: int | None = None,
        virtual_stages: int | None = None,
        timeout: timedelta | None = None,
        state_dict_type: StateDictType = "full",
        max_replans: int = 3,
        plan: "str | os.PathLike[str] | None" = None,
        data_parallel: DataParallel = "ddp",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.options = PipeOptions.checked(
            chunks=chunks, schedule=schedule, balance=balance, leaf_modules=leaf_modules, planner=planner,
            memory_limit=memory_limit, host_bandwidth=host_bandwidth, link_bandwidth=link_bandwidth,
            measure_memory=measure_memory, deferred_batch_norm=deferred_batch_norm, plan_shapes=plan_shapes,
            loss_reduction=loss_reduction, runtime=runtime, stages=stages, virtual_stages=virtual_stages,
            timeout=timeout, state_dict_type=state_dict_type, max_replans=max_replans, plan=plan,
            data_parallel=data_parallel,
        )
        if process_group_backend is not None and runtime != "distributed":
            raise ValueError(
                f"process_group_backend={process_group_backend!r} applies to runtime='distributed' (processes); with "
                f"runtime='local' there is no process group. Pass runtime='distributed' or leave it unset."
            )
        self.engine: Engine = (
            DistributedEngine(self, self.options, process_group_backend) if runtime == "distributed"
            else LocalEngine(self, self.options)
        )
        self.num_nodes = 1  # the Trainer's num_nodes (runtime="distributed")
        self._lightning_skip: tuple[FitLoop, bool] | None = None  # the fit loop and its skip-backward flag
        self._step_start = 0.0

    # --- what the engine made ----------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The plan the stages were split by (``None`` before the first training batch)."""
        return self.engine.plan

    @property
    def profile(self) -> Profile | None:
        """The profile the plan was made from."""
        return self.engine.profile

    @property
    def memory_limit(self) -> list[int] | None:
        """Each stage's memory limit in bytes (one for every stage, or one per stage; ``None``:
        the devices' memory). Assign it while training, in any form the constructor takes,
        when the memory a job may use changes: the next training batch plans for it."""
        return self.options.memory_limit

    @memory_limit.setter
    def memory_limit(self, limit: MemorySize | list[MemorySize] | None) -> None:
        self.engine.set_memory_limit(parse_limits(limit))

    @property
    def meter(self) -> MemoryMeter | None:
        """This process's stages' metered memory (``measure_memory=True``)."""
        return self.engine.meter

    # --- processes and devices ---------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        """Where the loss and the labels live: the last stage's device, or this process's."""
        return self.engine.root_device

    @property
    @override
    def global_rank(self) -> int:
        return self.engine.global_rank

    @property
    @override
    def local_rank(self) -> int:
        return self.engine.local_rank

    @property
    @override
    def node_rank(self) -> int:
        return self.engine.node_rank

    @property
    @override
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def is_distributed(self) -> bool:  # read by Lightning, though Strategy does not declare it
        return self.engine.is_distributed

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.engine.sampler_kwargs

    @override
    def configure_launcher(self) -> None:  # through Lightning's private launcher hook (ConfiguresLauncher)
        self.engine.configure_launcher()

    def set_world_ranks(self) -> None:  # called by Lightning's accelerator connector
        self.engine.setup_ranks()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.engine.setup_environment()

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        context = self.engine.tensor_init_context(empty_init)
        with super().tensor_init_context(empty_init) if context is None else context:
            yield

    # --- setup ---------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.engine.check_setup(trainer)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self._warn_batch_norm()
        self.setup_precision_plugin()
        self.engine.after_setup(trainer)

    def _warn_batch_norm(self) -> None:
        layers = list(batch_norm_layers(self.model)) if self.model is not None else []
        chunks = self.options.chunks
        if layers and chunks > 1 and not self.options.deferred_batch_norm:
            rank_zero_warn(
                f"BatchNorm layers ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''}) see one "
                f"micro-batch at a time with chunks={chunks}, so they update running_mean and "
                f"running_var once per micro-batch, unlike training on one device. Pass "
                f"MemoryPipeStrategy(deferred_batch_norm=True) to update them once per batch with the "
                f"whole batch's statistics."
            )

    @override
    def model_to_device(self) -> None:
        self.engine.model_to_device()

    # --- steps ---------------------------------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Where the schedule runs backward inside ``training_step``, Lightning must neither
        run it again nor zero the gradients after it. Its skip-backward flag is set for this
        step only, as Lightning's own callbacks set it, and its value restored after the step,
        so that a callback changing it (``StochasticWeightAveraging``) keeps working."""
        self.engine.surviving(partial(self.engine.on_train_batch_start, batch, batch_idx), undo=False)  # (the batch)
        module = self.lightning_module
        if self.engine.runs_backward and self._lightning_skip is None and module is not None:
            loop = module.trainer.fit_loop
            self._lightning_skip = loop, skip_backward(loop)
            set_skip_backward(loop, True)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._step_start = time.perf_counter()
        forwards_only = self._lightning_skip is not None and self._lightning_skip[1]  # SWA's BatchNorm epoch
        try:
            return self.engine.training_step(partial(super().training_step, *args, **kwargs), forwards_only,
                                             *args, **kwargs)
        finally:
            self._restore_skip_backward()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.eval_step("validation_step", partial(super().validation_step, *args, **kwargs),
                                     *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.eval_step("test_step", partial(super().test_step, *args, **kwargs), *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.eval_step("predict_step", partial(super().predict_step, *args, **kwargs),
                                     *args, **kwargs)

    def _restore_skip_backward(self) -> None:
        if self._lightning_skip is not None:
            loop, before = self._lightning_skip
            set_skip_backward(loop, before)
            self._lightning_skip = None

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.engine.clock.end_backward()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step (its closure runs the training step), metered, then the step's
        per-stage time and memory to the loggers."""
        engine = self.engine
        engine.stepping = True
        try:
            parent = super().optimizer_step

            def step(run: Any) -> Any:  # the closure Lightning passes, or the meter's wrapping of it
                return parent(optimizer, run, model, **kwargs)

            def attempt() -> Any:
                made = False  # the closure made the gradients: the optimizer's update is under way

                def closure_made() -> Any:
                    nonlocal made
                    result = closure()
                    made = True
                    return result

                try:
                    return step(closure_made) if engine.meter is None else engine.meter.step(step, closure_made)
                except (StageOutOfMemoryError, torch.OutOfMemoryError) as error:
                    if made:
                        raise RecoveryError(
                            f"{error} It ran out in the optimizer's update, which may have changed some parameters "
                            f"already, so the step cannot run again. Lower memory_limit (the planner then leaves room "
                            f"for the update) or the micro-batch size."
                        ) from error
                    raise

            output = engine.surviving(attempt)
        finally:
            engine.stepping = False
        module = self.lightning_module
        if module is not None and logs_this_step(module.trainer):  # the same on every rank: it depends on the step
            engine.log_step_metrics((time.perf_counter() - self._step_start) * 1e3)
        if engine.meter is not None:
            engine.meter.own_optimizer_state(optimizer)
        engine.after_step()
        return output

    # --- checkpoints ---------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The plain module's ``state_dict`` keys, whatever the split."""
        state = self.engine.module_state_dict()
        return super().lightning_module_state_dict() if state is None else state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = self.engine.optimizer_state(optimizer)
        return super().optimizer_state(optimizer) if state is None else state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None) -> None:
        if not self.engine.save_checkpoint(checkpoint, filepath):
            super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: bool | None = None) -> dict[str, Any]:
        loaded = self.engine.load_checkpoint(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only) if loaded is None else loaded

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.engine.load_model_state_dict(checkpoint, strict):
            super().load_model_state_dict(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self.engine.load_optimizer_state_dict(checkpoint)

    # --- collectives ---------------------------------------------------------------------------

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Under ``runtime="distributed"``, over the data-parallel replicas of this rank's stage
        by default (see :meth:`.distributed.DistributedEngine.reduce`)."""
        return self.engine.reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return self.engine.reduce_boolean_decision(decision, all)

    @override
    def barrier(self, name: str | None = None) -> None:
        self.engine.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.engine.broadcast(obj, src)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return self.engine.all_gather(tensor, group, sync_grads)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.engine.on_exception(exception)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None:
            vars(module).pop("forward", None)
        self._restore_skip_backward()  # a step that did not run (an exception) leaves it set
        self.engine.teardown(super().teardown)

    # --- reading the split ----------------------------------------------------------------------

    def describe(self) -> str:
        """The per-stage split as a text table."""
        return self.engine.describe()

    def memory_summary(self) -> str:
        """Metered bytes per stage now and at peak, by kind; with one GPU per stage, also
        ``torch.cuda.max_memory_allocated``."""
        return self.engine.memory_summary()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Memory-centric pipeline parallelism for Lightning"
        )


if MemoryPipeStrategy.strategy_name not in StrategyRegistry:
    MemoryPipeStrategy.register_strategies(StrategyRegistry)
