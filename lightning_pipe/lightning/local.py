"""``runtime="local"``: every stage in this process, one per device.

At setup the module's ``forward`` is captured, split into one stage per device and placed;
``self(x)`` inside the user's steps then runs the pipeline: autograd-driven GPipe, where
Lightning's own ``loss.backward()`` runs the pipelined backward, or 1F1B and 2BW in schedule
order (:mod:`.steps`). With a planner, the first training batch profiles one micro-batch
(``_probe``), plans, checks the plan by a fake training step (:mod:`.check`) and splits again.
"""

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from typing import Any, cast

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_pipe.graph.capture import Captured, NeedsExampleInputs, buffer_writes, get_attr
from lightning_pipe.graph.microbatch import scatter
from lightning_pipe.graph.shapes import Shapes, batch_shapes, grown, largest, show, tile
from lightning_pipe.graph.variants import Variants, follow_balance
from lightning_pipe.internals import tree_flatten, tree_map
from lightning_pipe.lightning.check import (
    UncheckableStepError,
    fake_peaks,
    picks_kernel_by_device,
    unchecked_warning,
)
from lightning_pipe.lightning.engine import (
    Engine,
    check_buffer_writes,
    check_follows,
    check_microbatch,
    device_memory,
    policies_of,
    state_to_param_devices,
)
from lightning_pipe.lightning.internals import attached_trainer, set_device
from lightning_pipe.lightning.metrics import log_step_metrics, step_metrics
from lightning_pipe.lightning.options import PipeOptions, limits_per_stage
from lightning_pipe.lightning.probe import StepBytes, probe_step
from lightning_pipe.lightning.recovery import DRIFT, Corrections, Failure, limit_unmet, mid_window
from lightning_pipe.lightning.steps import NO_FORWARD, ScheduledStep
from lightning_pipe.measure.clock import StageClock
from lightning_pipe.measure.meter import MemoryMeter, not_charged
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan import report
from lightning_pipe.plan.balance import balance_by_weight, check_stage_count
from lightning_pipe.plan.headroom import checked, flat
from lightning_pipe.plan.plan import InfeasiblePlanError, Plan, make_plan
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.schedule import Schedule
from lightning_pipe.progress import progress_bar, tracker
from lightning_pipe.runtime.batchnorm import DeferredBatchNorm
from lightning_pipe.runtime.build import Policy, Program, build
from lightning_pipe.runtime.gpipe import Pipeline
from lightning_pipe.runtime.scheduled import ScheduledPipeline
from lightning_pipe.runtime.versions import WeightVersions
from lightning_pipe.units import mib

__all__ = ["LocalEngine"]


class LocalEngine(Engine):
    """Every stage in this process (see the module docstring)."""

    def __init__(self, strategy: ParallelStrategy, options: PipeOptions) -> None:
        super().__init__(strategy, options)
        self._batch_norm: DeferredBatchNorm | None = None
        self.program: Program | None = None
        self.variants: Variants | None = None
        self._needs_plan = False
        self._shapes_to_plan: Shapes = {}
        self._planning_since: float | None = None  # when the running plan's profiling began
        self.captured: Captured | None = None  # the training graph, which the plan is for
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
        self._metering = ExitStack()
        self._batch: tuple[Any, int] | None = None  # this training batch and its index
        self._checks: dict[tuple[tuple[int, ...], tuple[str, ...]], list[int]] = {}  # each checked plan's peaks
        self._checked: list[int] = []  # what the plan's check said each stage peaks at

    @property
    def root_device(self) -> torch.device:
        """The last stage's device: outputs, and so the loss and the labels, live there."""
        return self.parallel_devices[-1]

    @property
    def runs_backward(self) -> bool:
        return self._step is not None

    def after_setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:
                state_to_param_devices(optimizer)
        schedule = self.options.schedule
        if schedule != "gpipe" and trainer.state.fn == TrainerFn.FITTING:
            if not self.module.automatic_optimization:
                raise ValueError(
                    f"schedule={schedule!r} runs each micro-batch's backward itself, which "
                    f"needs automatic optimization. Use schedule='gpipe' for manual optimization."
                )
            if schedule == "2bw":
                self._versions = WeightVersions(self.module.parameters())
            if self._scheduled is not None:  # else once the first forward is captured (_probe)
                self._make_step()
        if self.meter is not None:
            self._own_memory()
            self._metering.enter_context(self.meter)
            self._metering.enter_context(self.meter.saved_tensors_hooks())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch = batch, batch_idx
        limit_changed = self._needs_plan and self.plan is not None  # (set_memory_limit)
        to_plan = self._batch_to_plan(batch)
        if to_plan is not None or (self.options.schedule != "gpipe" and self._step is None):
            try:
                self._probe(batch if to_plan is None else to_plan, batch_idx)
            except InfeasiblePlanError as error:
                if limit_changed:
                    raise limit_unmet(self.options.memory_limit, error) from error
                raise
        if self.meter is not None:  # the batch lives on the root device, the last stage's
            tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, Tensor)]
            self.meter.charge_batch(len(self.meter.stages) - 1, tensors)

    def training_step(self, step: Callable[[], Any], forwards_only: bool, *args: Any, **kwargs: Any) -> Any:
        self.clock.reset()
        if self._step is None:
            calls = self._forward_calls
            loss = self.meter.run_as(len(self.meter.stages) - 1, step) if self.meter else step()
            if loss is not None and self._forward_calls == calls:
                raise RuntimeError(NO_FORWARD.format(hook="training_step"))
            return loss
        if forwards_only:  # Lightning skips backward itself: forwards only, as it runs them
            return step()
        loss = self._step(self.module, self.optimizers[0], self.stepping, *args, **kwargs)
        if self._batch_norm is not None:
            self._batch_norm.commit()  # the batch's micro-batches ran as separate forward calls
        return loss

    @property
    def _schedule(self) -> Schedule:
        """The options' schedule (``"auto"`` is refused with ``runtime="local"``)."""
        return cast(Schedule, self.options.schedule)

    def log_step_metrics(self, step_ms: float) -> None:
        cuda = MemoryMeter.cuda_peaks(self.parallel_devices)
        metrics = step_metrics(self.clock, self.meter, self.plan, self._schedule, self.options.chunks,
                               step_ms, cuda)
        log_step_metrics(self.module.trainer, metrics)

    def teardown(self, lightning_teardown: Callable[[], None]) -> None:
        if self._batch_norm is not None:
            self._batch_norm.restore()
        self._metering.close()
        if self.meter is not None:
            self.meter.close()
            if self.strategy.lightning_module is not None and any(self.meter.peaks()):  # a step was metered
                self._save_report(self.meter.peaks())
        lightning_teardown()

    def model_to_device(self) -> None:
        """Capture, split and place the module, and route its ``forward`` through the pipeline.

        The first split is the user's ``balance`` or an even split by parameter bytes; with a
        ``planner`` and no ``balance``, the first forward call profiles one micro-batch, plans
        and re-splits before it runs. The graph split is the training graph; a model torch.fx
        cannot trace is captured by torch.export from the first forward call's inputs, and
        the graphs of other modes and inputs are captured at their first call
        (:mod:`~lightning_pipe.graph.variants`).
        """
        module = self.strategy.lightning_module
        assert module is not None and self.parallel_devices
        devices = list(self.parallel_devices)
        self._batch_norm = DeferredBatchNorm(module) if self.options.deferred_batch_norm else None
        self.variants = Variants(module, self.options.leaf_modules)
        self.meter = MemoryMeter(len(devices), self._capacities()) if self.options.measure_memory else None
        self.clock = StageClock(len(devices))
        if self.options.plan is not None:  # a saved plan: followed, never made here
            self.plan = self.options.plan
        # A plan from an earlier fit is reused: validate/test/predict never profile.
        self._needs_plan = self.options.planner is not None and self.options.balance is None and self.plan is None
        try:
            self.captured = self._training_graph()
        except NeedsExampleInputs:
            self.captured = None  # torch.export captures it from the first forward's inputs
        else:
            self._install_known(self.captured)
        # An instance attribute shadows the class's forward without registering a submodule,
        # so state_dict keys stay those of the plain module.
        module.forward = self.run_forward  # type: ignore[method-assign]
        set_device(module, self.root_device)

    def _training_graph(self, inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> Captured:
        assert self.parallel_devices
        assert self.variants is not None, "model_to_device makes the variants"
        with not_charged():  # torch.export traces on fake tensors: no device's bytes
            captured = self.variants.training_graph(inputs)
        check_stage_count(len(captured.nodes), len(self.parallel_devices))
        check_buffer_writes(captured, self.module, self.options.chunks)
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
        module = self.strategy.lightning_module
        assert module is not None and self.parallel_devices
        devices = list(self.parallel_devices)
        planned = balance is not None
        balance = balance or self.options.balance or balance_by_weight(captured.param_bytes(), len(devices))
        self.program = build(captured, module, balance, devices, policies)
        self._policies = dict(policies or {})
        self._pipeline = Pipeline(
            self.program, module, self.options.chunks, self.root_device, self.meter, self.clock, self._batch_norm
        )
        self._pipelines = {id(captured): self._pipeline}  # the others follow the new placement when next called
        if self.options.schedule != "gpipe":
            if self._scheduled is None:
                self._scheduled = ScheduledPipeline(self.program, self.root_device, self.meter, self.clock)
            self._scheduled.program = self.program
        for optimizer in self.optimizers:
            state_to_param_devices(optimizer)
        if self._versions is not None:
            self._versions.follow_params()
        self._own_memory()
        if not planned and not self._needs_plan:  # a plan shows its own table; a provisional split none
            rank_zero_info(self.describe())

    def _install_known(self, captured: Captured) -> None:
        """Split by the plan already made for this graph, else by the user's or an even split."""
        if self.options.plan is not None:
            check_follows(self.options.plan, captured, self.precision_plugin.precision)
        if self.plan is not None and sum(self.plan.balance) == len(captured.nodes):
            self._install(captured, self.plan.balance, policies_of(captured, self.plan))
        else:
            self._install(captured)

    def run_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``forward`` while the strategy runs it: the pipeline."""
        # Only a training batch plans, through _probe: the sanity check, validation, test and
        # predict run in eval mode, often with other batch sizes, and train on no plan of theirs.
        self._forward_calls += 1
        if self._needs_plan and self._probing:
            self.captured = self._training_graph((args, kwargs))  # an exported graph admitting these sizes
            return self._profile_from(args, kwargs)  # the probe goes on to the loss, then plans
        elif self.captured is None:
            self.captured = self._training_graph((args, kwargs))
            self._install_known(self.captured)
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
        module = self.strategy.lightning_module
        assert module is not None and self.program is not None and self.parallel_devices
        assert self.variants is not None, "model_to_device makes the variants"
        captured = self.variants.get((args, kwargs))
        if id(captured) not in self._pipelines:
            stage_of = {id(t): stage.index for stage in self.program.stages for t in stage.owned}
            balance = follow_balance(captured, stage_of, len(self.program.stages))
            policies = {n.name: self._policies[n.name] for n in captured.nodes if n.name in self._policies}
            program = build(captured, module, balance, list(self.parallel_devices), policies, place=False)
            self._pipelines[id(captured)] = Pipeline(
                program, module, self.options.chunks, self.root_device, self.meter, self.clock, self._batch_norm
            )
        return self._pipelines[id(captured)]

    def _profile_from(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Profile this call's inputs (one micro-batch); return the graph's output on them,
        from which the probing ``training_step`` goes on to compute its loss (``_probe``)."""
        assert self.captured is not None and self._probe_meter is not None
        self._needs_plan = False
        optimizer = self.optimizers[0] if self.optimizers else None
        output: list[Any] = []
        nodes, stages = len(self.captured.nodes), len(self.parallel_devices or [])
        rank_zero_info(f"Planning at the first training batch: profiling one micro-batch through {nodes} nodes, then "
                       f"splitting them over {stages} stages, each plan checked by a training step on fake tensors.")
        self._planning_since = time.perf_counter()
        with torch.enable_grad(), self._probe_meter.running(None), progress_bar() as bar:
            self.profile = profile_graph(self.captured, args, kwargs, optimizer=optimizer, output=output,
                                         progress=tracker(bar, "profiling nodes", nodes))
        if self._batch_norm is not None:
            self._batch_norm.discard()  # the profiler's runs are not part of the batch
        if not self.module.automatic_optimization:
            raise _Probed  # training_step would step the optimizers itself
        self._probe_output = output[0]
        if self.options.schedule != "gpipe":  # the schedule hands the loss each micro-batch's output itself
            return output[0]
        # GPipe merges the micro-batches' outputs into a copy: the probe meters how long the loss keeps it.
        return tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, output[0])

    def _plan(self, batch: Any, batch_idx: int) -> None:
        """Plan from the profile, checked by a fake training step on ``batch``'s shapes, and
        re-split to the plan."""
        assert self.options.planner is not None and self.parallel_devices and self.captured and self.profile
        devices = list(self.parallel_devices)
        o, planner = self.options, self.options.planner
        assert planner is not None
        profile = self.profile
        before = self.plan
        corrections = self._corrections
        limits = self._limits() if corrections is None else corrections.limits(self._limits())
        request = PlanRequest(limits, planner, o.schedule, o.chunks, o.host_bandwidth, o.link_bandwidth)
        self.plan = checked(lambda targets: make_plan(profile, replace(request, capacities=targets)), limits,
                            partial(self._check, batch, batch_idx), always=corrections is not None)
        self._checked = self._checks.get(_key(self.plan)) or [s.peak.total for s in self.plan.stages]
        if before is not None and corrections is None:
            rank_zero_info(f"The stages are split again: balance {before.balance} -> {self.plan.balance}.")
        self.plan.input_shapes = {path: list(shape) for path, shape in self._shapes_to_plan.items()}
        self.plan.precision = self.precision_plugin.precision
        self._install(self.captured, self.plan.balance, policies_of(self.captured, self.plan))
        if self.meter is not None:
            self.meter.reset_peaks()  # peaks of an earlier split are not this plan's
        report.show(self.plan, devices)
        if self._planning_since is not None:
            rank_zero_info(f"Planned in {time.perf_counter() - self._planning_since:.1f} s.")
            self._planning_since = None
        self._save_report()

    def _save_report(self, metered: list[int] | None = None) -> None:
        """The plan's JSON and plot in the logger's folder; after training, the plot with each
        stage's ``metered`` peak beside its prediction."""
        logger = self.module.trainer.logger if attached_trainer(self.module) else None
        if self.plan is not None and logger is not None and logger.log_dir is not None:
            report.save(self.plan, logger.log_dir, metered or ())

    def _check(self, batch: Any, batch_idx: int, plan: Plan) -> list[int]:
        """Each stage's peak when ``plan`` trains, from a fake training step; for a step that
        cannot run on fake tensors (manual optimization steps the optimizers itself; a step
        reading a value), what the flat headroom assumes, said once."""
        module = self.module
        assert self.captured is not None
        if not module.automatic_optimization:
            return self._unchecked(plan, "manual optimization steps the optimizers inside training_step")
        optimizer = self.optimizers[0] if self.optimizers else None
        try:
            # (on meta tensors where no operator picks its kernel by device: they run faster)
            on_cpu = all(d.type == "cpu" for d in self.parallel_devices or []) and picks_kernel_by_device(self.captured)
            # (a stage on a GPU: what its caching allocator will reserve)
            peaks = fake_peaks(module, self.captured, batch, batch_idx, optimizer, self.precision_plugin, plan,
                               on_cpu=on_cpu, devices=self.parallel_devices)
        except UncheckableStepError as error:
            peaks = self._unchecked(plan, str(error))
        self._checks[_key(plan)] = peaks
        return peaks

    def _unchecked(self, plan: Plan, why: str) -> list[int]:
        if not self._warned_unchecked:
            self._warned_unchecked = True
            rank_zero_warn(unchecked_warning(why))
        return flat(plan)

    def _own_memory(self) -> None:
        """Charge parameters, buffers, 2BW's stale weights, gradients and optimizer state to
        the stage owning them."""
        if self.meter is None or self.program is None:
            return
        stale = dict(zip(map(id, self._versions.params), self._versions.stale)) if self._versions else {}
        for stage in self.program.stages:
            self.meter.own(stage.index, stage.owned)
            self.meter.own(stage.index, [stale[id(t)] for t in stage.owned if id(t) in stale])
        for optimizer in self.optimizers:  # a new split moves them with their parameters
            self.meter.own_optimizer_state(optimizer)

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

    def set_memory_limit(self, limits: list[int] | None) -> None:
        """Enforce ``limits`` from now on and, with a planner, plan for them at the next
        training batch: the stages are split again, parameters and optimizer state moved."""
        previous = self.options.memory_limit
        self.options.memory_limit = limits
        if not self.parallel_devices:  # before setup: the first plan is for them
            return
        try:
            capacities = self._capacities()
        except ValueError:
            self.options.memory_limit = previous
            raise
        if self.meter is not None:
            enforced: list[int | None] = [*capacities] if capacities else [None] * len(self.meter.stages)
            self.meter.capacities = enforced
        if self._planner_splits:
            self._needs_plan = True

    def _limits(self) -> list[int]:
        """Each stage's memory limit: the user's, else its device's memory shared by the stages
        placed on it; less where the meter enforces less (memory another job took)."""
        devices = list(self.parallel_devices)
        limits = self._capacities() or [device_memory(d) // devices.count(d) for d in devices]
        if self.meter is None:
            return limits
        enforced = self.meter.capacities
        return [limit if cap is None else min(limit, cap) for limit, cap in zip(limits, enforced)]

    @property
    def _planner_splits(self) -> bool:
        """Whether the planner made the split and so may make it again (no user ``balance``)."""
        return (self.plan is not None and self.options.planner is not None and self.options.balance is None
                and self.options.plan is None)

    def replans(self) -> bool:
        return self._planner_splits and self.options.max_replans > 0

    def written_buffers(self) -> list[Tensor]:
        """BatchNorm's statistics and the buffers the training graph writes in place (an EMA in
        ``forward``, allowed with ``chunks=1``): a failed attempt wrote them already."""
        written = super().written_buffers()
        if self.captured is not None:  # the graph reads attributes by their names in the module
            seen = {id(b) for b in written}
            written += [b for b in (get_attr(self.module, name) for name in buffer_writes(self.captured))
                        if id(b) not in seen]
        return written

    def recover(self, failure: Failure) -> None:
        """Plan again below the memory the failed step showed each stage takes, and rebuild."""
        assert self._batch is not None, "a training batch has started"
        if self._batch[1] % self.module.trainer.accumulate_grad_batches:
            raise mid_window(failure)
        self._replan(lambda c: c.learn_failure(failure, self._checked), failure.message)

    def after_step(self) -> None:
        plan, meter, o = self.plan, self.meter, self.options
        if not self._planner_splits or plan is None or meter is None or self._batch is None:
            return
        corrections = self._corrections_so_far()
        peaks = meter.peaks()
        # (a drift already planned for, with the plan unchanged, is not planned for again)
        drifted = [s for s, (peak, stage, target) in enumerate(zip(peaks, plan.stages, plan.targets))
                   if peak > (1 + DRIFT) * stage.peak.total and peak > target
                   and peak > corrections.factors[s] * self._checked[s]]
        if not drifted or corrections.replans >= o.max_replans:
            return

        def learn(c: Corrections) -> None:
            for s in drifted:
                c.learn(s, peaks[s], self._checked[s])

        why = "; ".join(f"stage {s} peaked at {peaks[s]:,} bytes, {peaks[s] / plan.stages[s].peak.total - 1:.1%} over "
                        f"its prediction and past its target of {plan.targets[s]:,}" for s in drifted)
        self._replan(learn, why)

    @property
    def _memories(self) -> int:
        """A memory per stage."""
        return len(self.parallel_devices)

    def _plan_again(self) -> None:
        """Plan this training batch again (grown to the shapes planned for) and rebuild; an
        abandoned step's pending work is dropped first."""
        assert self._batch is not None and self.plan is not None
        if self._scheduled is not None:
            self._scheduled.abandon()
        if self._batch_norm is not None:
            self._batch_norm.discard()
        batch, batch_idx = self._batch
        planned = {path: tuple(shape) for path, shape in self.plan.input_shapes.items()}
        self._plan(self._grown(batch, largest(planned, batch_shapes(batch))), batch_idx)

    def _capacities(self) -> list[int] | None:
        assert self.parallel_devices
        return limits_per_stage(self.options.memory_limit, len(self.parallel_devices), "stage devices")

    def _make_step(self) -> None:
        assert self._scheduled is not None
        o = self.options
        self._step = ScheduledStep(
            self._scheduled, self._schedule, o.chunks, self.precision_plugin, self._versions, o.loss_reduction
        )

    def _batch_to_plan(self, batch: Any) -> Any | None:
        """The batch to plan from before this training batch runs: the first one (grown to
        ``plan_shapes``), or one larger than the plan was made for; ``None`` while the plan holds."""
        now = batch_shapes(batch)
        if self.options.plan is not None:
            check_microbatch(self.options.plan, now)
            return None
        if self._needs_plan and self.plan is not None:  # the memory limit changed (set_memory_limit)
            target = largest({path: tuple(shape) for path, shape in self.plan.input_shapes.items()}, now)
            rank_zero_info(f"memory_limit is now {self.options.memory_limit}: planning again for {show(target)}.")
        elif self._needs_plan:
            target = largest(now, self.options.plan_shapes)
        elif self._planner_splits:
            assert self.plan is not None
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
        return self._grown(batch, target)

    def _grown(self, batch: Any, target: Shapes) -> Any:
        """``batch`` repeated to the shapes to plan for, ``target``, which the plan records."""
        self._shapes_to_plan = target
        now = batch_shapes(batch)
        return tile(batch, {path: shape for path, shape in target.items() if shape != now.get(path)})

    def _probe(self, batch: Any, batch_idx: int) -> None:
        """Run ``training_step`` on the first micro-batch of ``batch`` up to its ``self(...)``:
        planning profiles ``forward``'s inputs, and torch.export captures from them, which
        only ``training_step`` makes. Schedule-driven steps need the captured stages before they
        start. To plan, ``self(...)`` returns the profiled output and ``training_step`` goes on
        to its loss and that loss's backward, metered (nothing logged, metrics untouched, the
        random state restored): the last stage holds them. Otherwise it stops there."""
        module = self.strategy.lightning_module
        assert module is not None
        planning = self._needs_plan
        sample = scatter(batch, self.options.chunks)[0]
        self._probing, self._probe_meter = True, MemoryMeter(1)
        calls = self._forward_calls
        step = None
        try:
            step = probe_step(module, sample, batch_idx, self._probe_meter, self.parallel_devices or [],
                              lambda: self._probe_output, self.precision_plugin, grad=planning)
        except _Probed:
            pass
        finally:
            self._probing, self._probe_output = False, None
        if planning and self.profile is not None and not self._needs_plan:
            # (a step stopped at a self(...): manual optimization, or a second call of forward)
            (step or StepBytes.batch_only(sample)).record(self.profile)
            self._plan(batch, batch_idx)
        if self._forward_calls == calls:
            raise RuntimeError(NO_FORWARD.format(hook="training_step"))
        if self.options.schedule != "gpipe":
            self._make_step()


def _key(plan: Plan) -> tuple[tuple[int, ...], tuple[str, ...]]:
    return tuple(plan.balance), tuple(plan.policies)


class _Probed(Exception):
    """Ends a probing ``training_step`` at its first ``self(...)`` (see ``_probe``)."""

