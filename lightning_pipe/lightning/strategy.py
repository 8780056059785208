"""MemoryPipeStrategy: pipeline an unmodified LightningModule over the Trainer's devices.

One process drives every stage. At setup the module's ``forward`` is captured, split into
one stage per device and placed; then ``self(x)`` inside the user's steps runs the pipeline
(autograd-driven GPipe), and Lightning's own ``loss.backward()`` runs the pipelined backward.
"""

import os
import time
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pipe.graph.capture import capture
from lightning_pipe.graph.microbatch import scatter
from lightning_pipe.lightning.metrics import log_step_metrics, step_metrics
from lightning_pipe.lightning.steps import ScheduledStep
from lightning_pipe.measure.clock import StageClock
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan import report
from lightning_pipe.plan.balance import balance_by_weight, check_stage_count
from lightning_pipe.plan.partitioners import PARTITIONERS, Partitioner
from lightning_pipe.plan.plan import Plan, make_plan
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.schedule import Schedule
from lightning_pipe.runtime.build import Program, build
from lightning_pipe.runtime.gpipe import Pipeline
from lightning_pipe.runtime.scheduled import ScheduledPipeline
from lightning_pipe.runtime.versions import WeightVersions
from lightning_pipe.units import MemorySize, mib, parse_bytes

__all__ = ["MemoryPipeStrategy"]

_PLANNING_HEADROOM = 0.9  # the planner fills each stage to at most this share of its limit


class MemoryPipeStrategy(ParallelStrategy):
    """Pipeline-parallel training in one process, one stage per device.

    Args:
        chunks: micro-batches per batch; every batch must hold at least this many samples.
        schedule: ``"gpipe"`` (autograd-driven), ``"1f1b"`` or ``"2bw"`` (schedule-driven).
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
        measure_memory: meter every stage's memory from its live tensors while running
            (``strategy.meter``); costs some speed.
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for Lightning's
            own strategies; the Trainer fills them in when they are not given.
    """

    strategy_name = "memory_pipe"

    def __init__(
        self,
        chunks: int = 4,
        schedule: Schedule = "gpipe",
        balance: list[int] | None = None,
        leaf_modules: list[str] | None = None,
        planner: Partitioner | None = "dawnpiper",
        memory_limit: MemorySize | list[MemorySize] | None = None,
        host_bandwidth: float | None = None,
        measure_memory: bool = False,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}.")
        if schedule not in ("gpipe", "1f1b", "2bw"):
            raise ValueError(f"schedule must be one of 'gpipe', '1f1b', '2bw', got {schedule!r}.")
        if planner is not None and planner not in PARTITIONERS:
            raise ValueError(f"planner must be one of {list(PARTITIONERS)} or None, got {planner!r}.")
        if host_bandwidth is not None and host_bandwidth <= 0:
            raise ValueError(f"host_bandwidth must be positive (bytes per second), got {host_bandwidth}.")
        if balance is not None and any(b < 1 for b in balance):
            raise ValueError(f"balance {balance} has a stage with no nodes; every entry must be >= 1.")
        self.chunks = chunks
        self.schedule = schedule
        self.balance = balance
        self.leaf_modules = leaf_modules or []
        self.planner = planner
        self.memory_limit = _parse_limits(memory_limit)
        self.host_bandwidth = host_bandwidth
        self.measure_memory = measure_memory
        self.program: Program | None = None
        self.profile: Profile | None = None
        self.plan: Plan | None = None
        self.meter: MemoryMeter | None = None
        self._needs_plan = False
        self._pipeline: Pipeline | None = None
        self._scheduled: ScheduledPipeline | None = None
        self._versions: WeightVersions | None = None
        self._step: ScheduledStep | None = None
        self._stepping = False
        self._step_start = 0.0
        self.clock = StageClock(0)
        self._metering = ExitStack()

    @property
    @override
    def root_device(self) -> torch.device:
        """The last stage's device: outputs, and so the loss and the labels, live there."""
        assert self.parallel_devices, "the Trainer has not assigned devices to the strategy yet"
        return self.parallel_devices[-1]

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    @override
    def is_distributed(self) -> bool:
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:
                _state_to_param_devices(optimizer)
        if self.schedule != "gpipe" and trainer.state.fn == TrainerFn.FITTING:
            if not self.lightning_module.automatic_optimization:
                raise ValueError(
                    f"schedule={self.schedule!r} runs each micro-batch's backward itself, which "
                    f"needs automatic optimization. Use schedule='gpipe' for manual optimization."
                )
            # The strategy runs backward inside training_step; Lightning must not run it again.
            trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward = True
            if self.schedule == "2bw":
                self._versions = WeightVersions(self.lightning_module.parameters())
            assert self._scheduled is not None
            self._step = ScheduledStep(self._scheduled, self.schedule, self.chunks, self.precision_plugin, self._versions)
        if self.meter is not None:
            self._own_memory()
            self._metering.enter_context(self.meter)
            self._metering.enter_context(self.meter.saved_tensors_hooks())

    @override
    def model_to_device(self) -> None:
        """Capture, split and place the module, and route its ``forward`` through the pipeline.

        The first split is the user's ``balance`` or an even split by parameter bytes; with a
        ``planner`` and no ``balance``, the first forward call profiles one micro-batch, plans
        and re-splits before it runs.
        """
        module = self.lightning_module
        assert module is not None and self.parallel_devices
        devices = list(self.parallel_devices)
        self._captured = capture(module, self.leaf_modules)
        check_stage_count(len(self._captured.nodes), len(devices))
        self.meter = MemoryMeter(len(devices), self._capacities()) if self.measure_memory else None
        self.clock = StageClock(len(devices))
        balance = self.balance or balance_by_weight(self._captured.param_bytes(), len(devices))
        self.program = build(self._captured, module, balance, devices)
        self._pipeline = Pipeline(self.program, module, self.chunks, self.root_device, self.meter, self.clock)
        if self.schedule != "gpipe":
            self._scheduled = ScheduledPipeline(self.program, self.root_device, self.meter, self.clock)
        self._needs_plan = self.planner is not None and self.balance is None
        # An instance attribute shadows the class's forward without registering a submodule,
        # so state_dict keys stay those of the plain module.
        module.forward = self._forward
        module._device = self.root_device
        rank_zero_info(self.describe())

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._needs_plan:
            self._plan_from(args, kwargs)
        if self._scheduled is not None and self._scheduled.active:
            return self._scheduled(self.lightning_module, *args, **kwargs)
        return self._pipeline(*args, **kwargs)

    def _plan_from(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Profile one micro-batch of this call's inputs, plan, and re-split to the plan."""
        assert self.planner is not None and self.parallel_devices
        self._needs_plan = False
        whole_batch = not (self._scheduled is not None and self._scheduled.active)
        sample_args, sample_kwargs = scatter((args, kwargs), self.chunks)[0] if whole_batch else (args, kwargs)
        optimizer = self.optimizers[0] if self.optimizers else None
        with torch.enable_grad():
            self.profile = profile_graph(self._captured, sample_args, sample_kwargs, optimizer=optimizer)
        devices = list(self.parallel_devices)
        capacities = self._capacities() or _device_capacities(devices)
        # Plan below the limit: the memory model's workspace and boundary terms are estimates.
        targets = [int(c * _PLANNING_HEADROOM) for c in capacities]
        self.plan = make_plan(self.profile, targets, self.planner, self.schedule, self.chunks, self.host_bandwidth)
        policies = {n.name: p for n, p in zip(self._captured.nodes, self.plan.policies) if p != "keep"}
        self.program = build(self._captured, self.lightning_module, self.plan.balance, devices, policies)
        for runner in (self._pipeline, self._scheduled):
            if runner is not None:
                runner.program = self.program
        for optimizer in self.optimizers:
            _state_to_param_devices(optimizer)
        if self._versions is not None:
            self._versions.follow_params()
        self._own_memory()
        report.show(self.plan, devices)
        logger = self.lightning_module.trainer.logger if self.lightning_module._trainer else None
        if logger is not None and logger.log_dir is not None:
            report.save(self.plan, logger.log_dir)

    def _own_memory(self) -> None:
        """Charge parameters, buffers and 2BW's stale weights to the stage owning them."""
        if self.meter is None or self.program is None:
            return
        stale = dict(zip(map(id, self._versions.params), self._versions.stale)) if self._versions else {}
        for stage in self.program.stages:
            self.meter.own(stage.index, stage.owned)
            self.meter.own(stage.index, [stale[id(t)] for t in stage.owned if id(t) in stale])

    def describe(self) -> str:
        """The per-stage split as a text table."""
        assert self.program is not None, "the pipeline is built in setup()"
        rows = [f"{'stage':>5}  {'device':<8} {'nodes':>5}  {'params':>10}  first .. last node"]
        for stage in self.program.stages:
            rows.append(
                f"{stage.index:>5}  {stage.device!s:<8} {len(stage.node_names):>5}  "
                f"{mib(stage.param_bytes()):>10}  {stage.node_names[0]} .. {stage.node_names[-1]}"
            )
        return "\n".join(rows)

    def memory_summary(self) -> str:
        """Metered bytes per stage now and at peak, by kind; with one GPU per stage, also
        ``torch.cuda.max_memory_allocated``."""
        if self.meter is None or self.program is None:
            raise RuntimeError("memory_summary() needs MemoryPipeStrategy(measure_memory=True) and a run.")
        devices = [stage.device for stage in self.program.stages]
        cuda = MemoryMeter.cuda_peaks(devices)
        rows = [f"{'stage':>5}  {'current':>10}  {'peak':>10}  peak by kind" + ("  cuda peak" if cuda else "")]
        for k, memory in enumerate(self.meter.stages):
            kinds = ", ".join(f"{kind} {mib(n)}" for kind, n in memory.peak_by_kind.items() if n)
            row = f"{k:>5}  {mib(memory.total):>10}  {mib(memory.peak):>10}  {kinds}"
            rows.append(row + (f"  {mib(cuda[k])}" if cuda else ""))
        return "\n".join(rows)

    def _capacities(self) -> list[int] | None:
        assert self.parallel_devices
        stages = len(self.parallel_devices)
        limits = self.memory_limit
        if limits is None or len(limits) == 1:
            return None if limits is None else limits * stages
        if len(limits) != stages:
            raise ValueError(
                f"memory_limit has {len(limits)} entries but there are {stages} stage devices; "
                f"give one value for all stages or one per stage."
            )
        return limits

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.clock.reset()
        self._step_start = time.perf_counter()
        if self._step is None:
            return super().training_step(*args, **kwargs)
        return self._step(self.lightning_module, self.optimizers[0], self._stepping, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.clock.end_backward()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        self._stepping = True
        try:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._stepping = False
        module = self.lightning_module
        step_ms = (time.perf_counter() - self._step_start) * 1e3
        log_step_metrics(module.trainer, step_metrics(self.clock, self.meter, self.plan, self.schedule, self.chunks, step_ms))
        if self.meter is not None:
            self.meter.own_optimizer_state(optimizer)
        return output

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
            _state_to_param_devices(optimizer)

    @override
    def reduce(self, tensor: Tensor | Any, *args: Any, **kwargs: Any) -> Tensor | Any:
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None:
            vars(module).pop("forward", None)
        self._metering.close()
        if self.meter is not None:
            self.meter.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Memory-centric pipeline parallelism in one process"
        )


def _device_capacities(devices: list[torch.device]) -> list[int]:
    """Each device's memory, shared evenly by the stages placed on it."""
    total = {}
    for device in set(devices):
        if device.type == "cuda":
            total[device] = torch.cuda.get_device_properties(device).total_memory
        else:
            total[device] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return [total[d] // devices.count(d) for d in devices]


def _state_to_param_devices(optimizer: Optimizer) -> None:
    """Move each optimizer state tensor to its parameter's device (Lightning moves all of
    them to the root device); ``step`` counters stay where the optimizer keeps them."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if key != "step" and isinstance(value, Tensor):
                state[key] = value.to(param.device)


def _parse_limits(limit: MemorySize | list[MemorySize] | None) -> list[int] | None:
    if limit is None:
        return None
    return [parse_bytes(v) for v in (limit if isinstance(limit, list) else [limit])]


if MemoryPipeStrategy.strategy_name not in StrategyRegistry:
    MemoryPipeStrategy.register_strategies(StrategyRegistry)
