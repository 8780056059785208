"""MemoryPipeStrategy: pipeline an unmodified LightningModule over the Trainer's devices.

One process drives every stage. At setup the module's ``forward`` is captured, split into
one stage per device and placed; then ``self(x)`` inside the user's steps runs the pipeline
(autograd-driven GPipe), and Lightning's own ``loss.backward()`` runs the pipelined backward.
"""

import os
import time
from collections.abc import Mapping
from contextlib import ExitStack
from datetime import timedelta
from functools import partial
from types import UnionType
from typing import Any, Literal, cast, get_args

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten, tree_map
from typing_extensions import override

from lightning_pipe.graph.capture import Captured, NeedsExampleInputs
from lightning_pipe.graph.microbatch import scatter
from lightning_pipe.graph.shapes import Shapes, batch_shapes, grown, largest, show, tile
from lightning_pipe.graph.variants import Variants, follow_balance
from lightning_pipe.lightning.check import UncheckableStepError, fake_peaks
from lightning_pipe.lightning.metrics import log_step_metrics, step_metrics
from lightning_pipe.lightning.microlog import LossReduction, silenced
from lightning_pipe.lightning.steps import NO_FORWARD, ScheduledStep
from lightning_pipe.measure.clock import StageClock
from lightning_pipe.measure.meter import MemoryMeter, not_charged
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan import report
from lightning_pipe.plan.balance import balance_by_weight, check_stage_count
from lightning_pipe.plan.headroom import checked, flat
from lightning_pipe.plan.partitioners import PARTITIONERS, Partitioner
from lightning_pipe.plan.plan import PREDICTION_ERROR, Plan, make_plan
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.schedule import Schedule
from lightning_pipe.runtime.batchnorm import DeferredBatchNorm, batch_norm_layers
from lightning_pipe.runtime.build import Policy, Program, build
from lightning_pipe.runtime.gpipe import Pipeline
from lightning_pipe.runtime.scheduled import ScheduledPipeline
from lightning_pipe.runtime.versions import WeightVersions
from lightning_pipe.units import MemorySize, mib, parse_bytes

__all__ = ["MemoryPipeStrategy"]

Runtime = Literal["local", "distributed"]
StateDictType = Literal["full", "sharded"]


class MemoryPipeStrategy(ParallelStrategy):
    """Pipeline-parallel training in one process, one stage per device.

    Args:
        chunks: micro-batches per batch; a batch with fewer samples (an epoch's short last
            batch) runs as one-sample micro-batches.
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
        virtual_stages: under ``runtime="distributed"`` with ``schedule="1f1b"``, stages per
            process: the model is split into ``stages * virtual_stages`` stages placed in a
            loop (process ``p`` runs stages ``p``, ``p + stages``, ...) and trained with
            ``torch.distributed.pipelining``'s Interleaved 1F1B, which shortens the bubble.
        timeout: under ``runtime="distributed"``, how long a rank waits for another before
            failing (default 30 minutes), so that an error on one rank ends every rank.
        state_dict_type: under ``runtime="distributed"``, ``"full"`` gathers checkpoints on
            global rank 0 into one file; ``"sharded"`` has every rank write its own stage's
            tensors and optimizer state into a ``torch.distributed.checkpoint`` directory, for
            models too big to gather.
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
        link_bandwidth: float | None = None,
        measure_memory: bool = False,
        deferred_batch_norm: bool = False,
        plan_shapes: dict[str, list[int]] | None = None,
        loss_reduction: LossReduction = "mean",
        runtime: Runtime = "local",
        stages: int | None = None,
        virtual_stages: int = 1,
        timeout: timedelta | None = None,
        state_dict_type: StateDictType = "full",
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
        _check_types(chunks=(chunks, int), host_bandwidth=(host_bandwidth, float | None),
                     link_bandwidth=(link_bandwidth, float | None),
                     measure_memory=(measure_memory, bool), deferred_batch_norm=(deferred_batch_norm, bool))
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}.")
        if schedule not in ("gpipe", "1f1b", "2bw"):
            raise ValueError(f"schedule must be one of 'gpipe', '1f1b', '2bw', got {schedule!r}.")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(
                f"loss_reduction must be 'mean' (training_step returns a per-sample mean) or 'sum' "
                f"(a sum over the samples), got {loss_reduction!r}."
            )
        if planner is not None and planner not in PARTITIONERS:
            raise ValueError(f"planner must be one of {list(PARTITIONERS)} or None, got {planner!r}.")
        if host_bandwidth is not None and host_bandwidth <= 0:
            raise ValueError(f"host_bandwidth must be positive (bytes per second), got {host_bandwidth}.")
        if link_bandwidth is not None and link_bandwidth <= 0:
            raise ValueError(f"link_bandwidth must be positive (bytes per second), got {link_bandwidth}.")
        if plan_shapes is not None and not (
            isinstance(plan_shapes, Mapping)
            and all(isinstance(k, str) and isinstance(v, list | tuple) and v and all(
                isinstance(n, int) and n > 0 for n in v) for k, v in plan_shapes.items())
        ):
            raise ValueError(
                f"plan_shapes must map batch tensor paths to shapes of positive sizes, such as "
                f"{{'input_ids': [8, 512]}}, got {plan_shapes!r}."
            )
        if balance is not None and any(b < 1 for b in balance):
            raise ValueError(f"balance {balance} has a stage with no nodes; every entry must be >= 1.")
        _check_runtime(runtime, stages, schedule, timeout, virtual_stages)
        _check_state_dict_type(runtime, state_dict_type)
        self.runtime = runtime
        self.state_dict_type = state_dict_type
        self.stages = stages
        self.virtual_stages = virtual_stages
        self.timeout = timeout or timedelta(minutes=30)
        self.chunks = chunks
        self.schedule = schedule
        self.balance = balance
        self.leaf_modules = leaf_modules or []
        self.planner = planner
        self.memory_limit = _parse_limits(memory_limit)
        self.host_bandwidth = host_bandwidth
        self.link_bandwidth = link_bandwidth
        self.measure_memory = measure_memory
        self.deferred_batch_norm = deferred_batch_norm
        self.plan_shapes = {k: tuple(v) for k, v in (plan_shapes or {}).items()}
        self.loss_reduction = loss_reduction
        self._batch_norm: DeferredBatchNorm | None = None
        self.program: Program | None = None
        self.profile: Profile | None = None
        self.plan: Plan | None = None
        self.meter: MemoryMeter | None = None
        self._needs_plan = False
        self._shapes_to_plan: Shapes = {}
        self._captured: Captured | None = None  # the training graph, which the plan is for
        self._pipeline: Pipeline | None = None  # the training graph's
        self._pipelines: dict[int, Pipeline] = {}  # per graph (by id) of each mode and input
        self._policies: dict[str, Policy] = {}  # the training graph's, by node name
        self._probing = False
        self._forward_calls = 0  # calls of the module's forward so far: a step must make one
        self._warned_unchecked = False
        self._probe_meter: MemoryMeter | None = None  # meters what a probing training_step does outside forward
        self._probe_output: Any = None  # the profiled output a probing self(...) returned
        self._scheduled: ScheduledPipeline | None = None
        self._versions: WeightVersions | None = None
        self._step: ScheduledStep | None = None
        self._stepping = False
        self._lightning_skip: tuple[_FitLoop, bool] | None = None  # the fit loop and its skip-backward flag
        self._step_start = 0.0
        self.clock = StageClock(0)
        self._metering = ExitStack()
        if runtime == "distributed":  # a subclass with these arguments runs it (lightning/distributed.py)
            from lightning_pipe.lightning.distributed import become_distributed

            become_distributed(self)

    @property
    def _module(self) -> LightningModule:
        module = self.lightning_module
        assert module is not None, "the Trainer has not connected a LightningModule yet"
        return module

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
    def is_distributed(self) -> bool:  # read by Lightning, though Strategy does not declare it
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
            layers = list(batch_norm_layers(self.model))
            if layers and self.chunks > 1 and not self.deferred_batch_norm:
                rank_zero_warn(
                    f"BatchNorm layers ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''}) see one "
                    f"micro-batch at a time with chunks={self.chunks}, so they update running_mean and "
                    f"running_var once per micro-batch, unlike training on one device. Pass "
                    f"MemoryPipeStrategy(deferred_batch_norm=True) to update them once per batch with the "
                    f"whole batch's statistics."
                )
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:
                _state_to_param_devices(optimizer)
        if self.schedule != "gpipe" and trainer.state.fn == TrainerFn.FITTING:
            if not self._module.automatic_optimization:
                raise ValueError(
                    f"schedule={self.schedule!r} runs each micro-batch's backward itself, which "
                    f"needs automatic optimization. Use schedule='gpipe' for manual optimization."
                )
            if self.schedule == "2bw":
                self._versions = WeightVersions(self._module.parameters())
            if self._scheduled is not None:  # else once the first forward is captured (_probe)
                self._make_step()
        if self.meter is not None:
            self._own_memory()
            self._metering.enter_context(self.meter)
            self._metering.enter_context(self.meter.saved_tensors_hooks())

    @override
    def model_to_device(self) -> None:
        """Capture, split and place the module, and route its ``forward`` through the pipeline.

        The first split is the user's ``balance`` or an even split by parameter bytes; with a
        ``planner`` and no ``balance``, the first forward call profiles one micro-batch, plans
        and re-splits before it runs. The graph split is the training graph; a model torch.fx
        cannot trace is captured by torch.export from the first forward call's inputs, and
        the graphs of other modes and inputs are captured at their first call
        (:mod:`~lightning_pipe.graph.variants`).
        """
        module = self.lightning_module
        assert module is not None and self.parallel_devices
        devices = list(self.parallel_devices)
        self._batch_norm = DeferredBatchNorm(module) if self.deferred_batch_norm else None
        self._variants = Variants(module, self.leaf_modules)
        self.meter = MemoryMeter(len(devices), self._capacities()) if self.measure_memory else None
        self.clock = StageClock(len(devices))
        # A plan from an earlier fit is reused: validate/test/predict never profile.
        self._needs_plan = self.planner is not None and self.balance is None and self.plan is None
        try:
            self._captured = self._training_graph()
        except NeedsExampleInputs:
            self._captured = None  # torch.export captures it from the first forward's inputs
        else:
            self._install_known(self._captured)
        # An instance attribute shadows the class's forward without registering a submodule,
        # so state_dict keys stay those of the plain module.
        module.forward = self._forward  # type: ignore[method-assign]
        module._device = self.root_device

    def _training_graph(self, inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> Captured:
        assert self.parallel_devices
        with not_charged():  # torch.export traces on fake tensors: no device's bytes
            captured = self._variants.training_graph(inputs)
        check_stage_count(len(captured.nodes), len(self.parallel_devices))
        if self._batch_norm is not None and self._batch_norm.layers and captured.front_end != "torch.fx":
            raise ValueError(
                "deferred_batch_norm=True needs BatchNorm layers as torch.fx leaf modules, but torch.fx could "
                "not trace this model and torch.export records batch norm as operations. Make the model "
                "traceable by torch.fx (see leaf_modules) or leave deferred_batch_norm off."
            )
        return captured

    def _install(
        self, captured: Captured, balance: list[int] | None = None, policies: dict[str, Policy] | None = None
    ) -> None:
        """Split the training graph by ``balance`` (else the user's, else even by parameter
        bytes) and place the parameters; graphs of other modes then follow this placement."""
        module = self.lightning_module
        assert module is not None and self.parallel_devices
        devices = list(self.parallel_devices)
        planned = balance is not None
        balance = balance or self.balance or balance_by_weight(captured.param_bytes(), len(devices))
        self.program = build(captured, module, balance, devices, policies)
        self._policies = dict(policies or {})
        self._pipeline = Pipeline(
            self.program, module, self.chunks, self.root_device, self.meter, self.clock, self._batch_norm
        )
        self._pipelines = {id(captured): self._pipeline}  # the others follow the new placement when next called
        if self.schedule != "gpipe":
            if self._scheduled is None:
                self._scheduled = ScheduledPipeline(self.program, self.root_device, self.meter, self.clock)
            self._scheduled.program = self.program
        for optimizer in self.optimizers:
            _state_to_param_devices(optimizer)
        if self._versions is not None:
            self._versions.follow_params()
        self._own_memory()
        if not planned:  # a plan shows its own table
            rank_zero_info(self.describe())

    def _install_known(self, captured: Captured) -> None:
        """Split by the plan already made for this graph, else by the user's or an even split."""
        if self.plan is not None and sum(self.plan.balance) == len(captured.nodes):
            self._install(captured, self.plan.balance, _policies(captured, self.plan))
        else:
            self._install(captured)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        # Only a training batch plans, through _probe: the sanity check, validation, test and
        # predict run in eval mode, often with other batch sizes, and train on no plan of theirs.
        self._forward_calls += 1
        if self._needs_plan and self._probing:
            self._captured = self._training_graph((args, kwargs))  # an exported graph admitting these sizes
            return self._profile_from(args, kwargs)  # the probe goes on to the loss, then plans
        elif self._captured is None:
            self._captured = self._training_graph((args, kwargs))
            self._install_known(self._captured)
        if self._probing:
            raise _Probed
        pipeline = self._pipeline_for(args, kwargs)
        if self._scheduled is not None and self._scheduled.active:
            if self._scheduled.program is not pipeline.program:  # another mode's graph (a teacher pass)
                pipeline.program.lender.new_batch()  # its lent copies may be a batch old
                self._scheduled.program = pipeline.program
            return self._scheduled(pipeline.root, *args, **kwargs)
        return pipeline(*args, **kwargs)

    def _pipeline_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Pipeline:
        """The pipeline of the graph for the module's current modes and these inputs: the
        training graph's, or one that leaves the parameters where that one placed them and
        takes its memory policies for the nodes of the same name."""
        module = self.lightning_module
        assert module is not None and self.program is not None and self.parallel_devices
        captured = self._variants.get((args, kwargs))
        if id(captured) not in self._pipelines:
            stage_of = {id(t): stage.index for stage in self.program.stages for t in stage.owned}
            balance = follow_balance(captured, stage_of, len(self.program.stages))
            policies = {n.name: self._policies[n.name] for n in captured.nodes if n.name in self._policies}
            program = build(captured, module, balance, list(self.parallel_devices), policies, place=False)
            self._pipelines[id(captured)] = Pipeline(
                program, module, self.chunks, self.root_device, self.meter, self.clock, self._batch_norm
            )
        return self._pipelines[id(captured)]

    def _profile_from(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Profile this call's inputs (one micro-batch); return the graph's output on them,
        from which the probing ``training_step`` goes on to compute its loss (``_probe``)."""
        assert self._captured is not None and self._probe_meter is not None
        self._needs_plan = False
        optimizer = self.optimizers[0] if self.optimizers else None
        output: list[Any] = []
        with torch.enable_grad(), self._probe_meter.running(None):
            self.profile = profile_graph(self._captured, args, kwargs, optimizer=optimizer, output=output)
        if self._batch_norm is not None:
            self._batch_norm.discard()  # the profiler's runs are not part of the batch
        if not self._module.automatic_optimization:
            raise _Probed  # training_step would step the optimizers itself
        self._probe_output = output[0]
        # A copy, as the merged output is: the probe meters how long the loss keeps it.
        return tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, output[0])

    def _plan(self, batch: Any, batch_idx: int) -> None:
        """Plan from the profile, checked by a fake training step on ``batch``'s shapes, and
        re-split to the plan."""
        assert self.planner is not None and self.parallel_devices and self._captured and self.profile
        devices = list(self.parallel_devices)
        capacities = self._capacities() or _device_capacities(devices)
        settings = (self.planner, self.schedule, self.chunks, self.host_bandwidth, self.link_bandwidth)
        profile = self.profile
        self.plan = checked(
            lambda targets: make_plan(profile, targets, *settings), capacities, partial(self._check, batch, batch_idx)
        )
        self.plan.input_shapes = {path: list(shape) for path, shape in self._shapes_to_plan.items()}
        self._install(self._captured, self.plan.balance, _policies(self._captured, self.plan))
        if self.meter is not None:
            self.meter.reset_peaks()  # peaks of an earlier split are not this plan's
        report.show(self.plan, devices)
        logger = self._module.trainer.logger if self._module._trainer else None
        if logger is not None and logger.log_dir is not None:
            report.save(self.plan, logger.log_dir)

    def _check(self, batch: Any, batch_idx: int, plan: Plan) -> list[int]:
        """Each stage's peak when ``plan`` trains, from a fake training step; for a step that
        cannot run on fake tensors (manual optimization steps the optimizers itself; a step
        reading a value), what the flat headroom assumes, said once."""
        module = self._module
        assert self._captured is not None
        if not module.automatic_optimization:
            return self._unchecked(plan, "manual optimization steps the optimizers inside training_step")
        optimizer = self.optimizers[0] if self.optimizers else None
        try:
            return fake_peaks(module, self._captured, batch, batch_idx, optimizer, self.precision_plugin, plan)
        except UncheckableStepError as error:
            return self._unchecked(plan, str(error))

    def _unchecked(self, plan: Plan, why: str) -> list[int]:
        if not self._warned_unchecked:
            self._warned_unchecked = True
            rank_zero_warn(
                f"MemoryPipeStrategy cannot check its plan by a training step on fake tensors ({why}); it plans "
                f"{PREDICTION_ERROR:.0%} below the memory limit instead, a margin measured on other models."
            )
        return flat(plan)

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
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Under 1F1B/2BW the strategy runs backward inside ``training_step``: Lightning must
        neither run it again nor zero the gradients after it. Its skip-backward flag is set
        for this step only, as Lightning's own callbacks set it, and its value restored after
        the step, so that a callback changing it (``StochasticWeightAveraging``) keeps working."""
        module = self.lightning_module
        to_plan = self._batch_to_plan(batch)
        if to_plan is not None or (self.schedule != "gpipe" and self._step is None):
            self._probe(batch if to_plan is None else to_plan, batch_idx)
        if self.meter is not None:  # the batch lives on the root device, the last stage's
            tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, Tensor)]
            self.meter.own(len(self.meter.stages) - 1, tensors, "boundary")
        if self._step is not None and self._lightning_skip is None and module is not None:
            loop = module.trainer.fit_loop
            self._lightning_skip = loop, loop._skip_backward
            loop._skip_backward = True

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.clock.reset()
        self._step_start = time.perf_counter()
        if self._step is None:
            step = partial(super().training_step, *args, **kwargs)
            calls = self._forward_calls
            loss = self.meter.run_as(len(self.meter.stages) - 1, step) if self.meter else step()
            if loss is not None and self._forward_calls == calls:
                raise RuntimeError(NO_FORWARD.format(hook="training_step"))
            return loss
        try:
            if self._lightning_skip is not None and self._lightning_skip[1]:
                # Lightning skips backward itself (SWA's BatchNorm epoch): forwards only, as it runs them
                return super().training_step(*args, **kwargs)
            assert self.lightning_module is not None
            loss = self._step(self.lightning_module, self.optimizers[0], self._stepping, *args, **kwargs)
        finally:
            self._restore_skip_backward()
        if self._batch_norm is not None:
            self._batch_norm.commit()  # the batch's micro-batches ran as separate forward calls
        return loss

    def _make_step(self) -> None:
        assert self._scheduled is not None
        self._step = ScheduledStep(
            self._scheduled, self.schedule, self.chunks, self.precision_plugin, self._versions, self.loss_reduction
        )

    def _batch_to_plan(self, batch: Any) -> Any | None:
        """The batch to plan from before this training batch runs: the first one (grown to
        ``plan_shapes``), or one larger than the plan was made for; ``None`` while the plan holds."""
        now = batch_shapes(batch)
        if self._needs_plan:
            target = largest(now, self.plan_shapes)
        elif self.plan is not None and self.planner is not None and self.balance is None:
            planned = {path: tuple(shape) for path, shape in self.plan.input_shapes.items()}
            more = grown(planned, now)
            if not more:
                return None
            target = largest(planned, now)
            rank_zero_info(
                f"A training batch ({show(more)}) is larger than the plan was made for ({show(planned)}): "
                f"planning again for {show(target)}. Pass MemoryPipeStrategy(plan_shapes={show(target)}) "
                f"to plan for the largest batch from the start."
            )
            self._needs_plan = True
        else:
            return None
        self._shapes_to_plan = target
        return tile(batch, {path: shape for path, shape in target.items() if shape != now.get(path)})

    def _probe(self, batch: Any, batch_idx: int) -> None:
        """Run ``training_step`` on the first micro-batch of ``batch`` up to its ``self(...)``:
        planning profiles ``forward``'s inputs, and torch.export captures from them, which
        only ``training_step`` makes. Schedule-driven steps need the captured stages before they
        start. To plan, ``self(...)`` returns the profiled output and ``training_step`` goes on
        to its loss and that loss's backward, metered (nothing logged, metrics untouched, the
        random state restored): the last stage holds them. Otherwise it stops there."""
        module = self.lightning_module
        assert module is not None
        planning = self._needs_plan
        sample = scatter(batch, self.chunks)[0]
        self._probing, self._probe_meter = True, MemoryMeter(1)
        meter = self._probe_meter
        cuda = [d for d in self.parallel_devices or [] if d.type == "cuda"]
        loss: Any = None
        forward_peak = 0
        calls = self._forward_calls
        try:
            with (
                torch.random.fork_rng(cuda), torch.set_grad_enabled(planning), silenced(module), meter,
                meter.saved_tensors_hooks(),
            ):
                returned = meter.run_as(0, partial(module.training_step, sample, batch_idx))
                loss = returned["loss"] if isinstance(returned, Mapping) else returned
                forward_peak = meter.stages[0].peak
                meter.reset_peaks()
                _probe_backward(loss, self._probe_output)
        except _Probed:
            pass
        finally:
            self._probing, self._probe_output = False, None
        if planning and self.profile is not None and not self._needs_plan:
            self.profile.batch_bytes = _tensor_bytes(sample)
            self.profile.loss_bytes, self.profile.loss_backward_bytes = forward_peak, meter.stages[0].peak
            self.profile.loss_kept_bytes = loss.untyped_storage().nbytes() if isinstance(loss, Tensor) else 0
            self._plan(batch, batch_idx)
        if self._forward_calls == calls:
            raise RuntimeError(NO_FORWARD.format(hook="training_step"))
        if self.schedule != "gpipe":
            self._make_step()

    def _restore_skip_backward(self) -> None:
        if self._lightning_skip is not None:
            loop, before = self._lightning_skip
            loop._skip_backward = before
            self._lightning_skip = None

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.clock.end_backward()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        self._stepping = True
        try:
            parent = super().optimizer_step

            def step(run: Any) -> Any:  # the closure Lightning passes, or the meter's wrapping of it
                return parent(optimizer, run, model, **kwargs)

            output = step(closure) if self.meter is None else self.meter.step(step, closure)
        finally:
            self._stepping = False
        step_ms = (time.perf_counter() - self._step_start) * 1e3
        cuda = MemoryMeter.cuda_peaks(self.parallel_devices or [])
        metrics = step_metrics(self.clock, self.meter, self.plan, self.schedule, self.chunks, step_ms, cuda)
        log_step_metrics(self._module.trainer, metrics)
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
        self._restore_skip_backward()  # a step that did not run (an exception) leaves it set
        if self._batch_norm is not None:
            self._batch_norm.restore()
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


class _Probed(Exception):
    """Ends a probing ``training_step`` at its first ``self(...)`` (see ``_probe``)."""


def _probe_backward(loss: Any, output: Any) -> None:
    """Run the backward of the loss a probing ``training_step`` returned down to the graph's
    ``output``, which the probe made a leaf (nothing when it returned no loss)."""
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
    if isinstance(loss, Tensor) and loss.requires_grad and leaves:
        torch.autograd.grad(loss, leaves, allow_unused=True)


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, Tensor))


def _policies(captured: Captured, plan: Plan) -> dict[str, Policy]:
    """The plan's recompute and swap choices by node name."""
    return {n.name: cast(Policy, p) for n, p in zip(captured.nodes, plan.policies) if p != "keep"}


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


def _check_runtime(
    runtime: Runtime, stages: int | None, schedule: Schedule, timeout: timedelta | None, virtual_stages: int
) -> None:
    if runtime not in ("local", "distributed"):
        raise ValueError(f"runtime must be 'local' (one process) or 'distributed' (one per stage), got {runtime!r}.")
    if runtime == "local" and (stages is not None or timeout is not None):
        raise ValueError(
            "stages and timeout apply to runtime='distributed' (processes); with runtime='local' every device is a "
            "stage. Pass runtime='distributed' or leave them unset."
        )
    if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
        raise ValueError(f"stages must be a positive int (the pipeline depth) or None, got {stages!r}.")
    if runtime == "distributed" and schedule == "2bw":
        raise ValueError(
            "schedule='2bw' runs only with runtime='local': torch.distributed.pipelining flushes the pipeline every "
            "step and has no two-version weights. Use schedule='1f1b' or 'gpipe' with runtime='distributed'."
        )
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive int (stages per process), got {virtual_stages!r}.")
    if virtual_stages > 1 and (runtime != "distributed" or schedule != "1f1b"):
        raise ValueError(
            f"virtual_stages={virtual_stages} interleaves stages over processes, which Interleaved 1F1B needs: "
            f"use runtime='distributed' and schedule='1f1b', or leave virtual_stages=1."
        )


def _check_state_dict_type(runtime: Runtime, state_dict_type: StateDictType) -> None:
    if state_dict_type not in ("full", "sharded"):
        raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")
    if state_dict_type == "sharded" and runtime != "distributed":
        raise ValueError(
            "state_dict_type='sharded' writes one shard per process: it needs runtime='distributed'. With "
            "runtime='local' one process holds every stage; leave state_dict_type='full'."
        )


def _check_types(**arguments: tuple[object, type | UnionType]) -> None:
    """Name an argument of the wrong type, the type it needs and the value it got, rather than
    fail later on a comparison (``chunks="4"``). A bool is no int here; an int is a float."""
    for name, (value, expected) in arguments.items():
        kinds = get_args(expected) or (expected,)
        if not any(_is_a(value, kind) for kind in kinds):
            names = " or ".join("None" if kind is type(None) else kind.__name__ for kind in kinds)
            raise TypeError(f"{name} must be {names}, got {value!r} of type {type(value).__name__}.")


def _is_a(value: object, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, kind) or (kind is float and isinstance(value, int))


def _parse_limits(limit: MemorySize | list[MemorySize] | None) -> list[int] | None:
    if limit is None:
        return None
    return [parse_bytes(v) for v in (limit if isinstance(limit, list) else [limit])]


if MemoryPipeStrategy.strategy_name not in StrategyRegistry:
    MemoryPipeStrategy.register_strategies(StrategyRegistry)
