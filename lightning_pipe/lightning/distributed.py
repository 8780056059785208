"""``runtime="distributed"``: one pipeline stage (or a few, interleaved) per process.

Every device is a process, started by Lightning's launcher (``devices``, ``num_nodes``) or by
torchrun/SLURM through Lightning's cluster environments. Ranks form a ``("pp", "dp")``
device mesh, pipeline outermost: ``stages`` pipeline ranks times ``world_size // stages``
data-parallel replicas. At the first training batch global rank 0 captures, profiles and
plans; the plan goes to every rank, which builds and keeps only its own stage
(:class:`~lightning_pipe.runtime.distributed.DistributedPipeline`).

The user's ``training_step`` runs unchanged on the last stage, once per micro-batch, inside
the schedule's loss function: its ``self(x)`` returns that micro-batch's pipeline output.
The first stage runs it only up to ``self(x)``, to learn the forward's arguments. What the
last stage logs and returns goes to every rank of its pipeline, so the progress bar,
loggers and ``ModelCheckpoint(monitor=...)`` see it everywhere.
"""

import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments.lightning import LightningEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_pipe.graph.capture import Captured
from lightning_pipe.graph.microbatch import batch_size, gather, scatter
from lightning_pipe.graph.shapes import batch_shapes
from lightning_pipe.graph.variants import Inputs, Variants, follow_balance, in_mode
from lightning_pipe.internals import default_store, module_apply, tree_flatten, tree_map
from lightning_pipe.lightning.check import UncheckableStepError, fake_rank_peak, meta_replica, unchecked_warning
from lightning_pipe.lightning.engine import (
    Engine,
    check_buffer_writes,
    check_follows,
    check_microbatch,
    device_memory,
    policies_of,
    state_to_param_devices,
)
from lightning_pipe.lightning.internals import (
    METADATA_FILENAME,
    PATH,
    SubprocessScriptLauncher,
    all_gather,
    call_callback_hooks,
    call_module_hook,
    default_backend,
    forget_computed,
    init_process_group,
    set_device,
    set_device_mesh,
    set_launcher,
    set_lightning_module,
    set_step_value,
    set_update_count,
    sigkill_signal,
    step_value,
    sync,
)
from lightning_pipe.lightning.metrics import log_step_metrics
from lightning_pipe.lightning.microlog import LogCollector, silenced
from lightning_pipe.lightning.options import PipeOptions, check_balance_entries, limits_per_stage
from lightning_pipe.lightning.probe import probe_step
from lightning_pipe.lightning.recovery import DRIFT, Corrections, Failure, RecoveryError, limit_unmet, mid_window
from lightning_pipe.lightning.sharded import is_sharded, load_meta, load_optimizer, load_tensors, save_sharded
from lightning_pipe.lightning.steps import NO_FORWARD, _loss_of
from lightning_pipe.measure.clock import StageClock
from lightning_pipe.measure.meter import MemoryMeter, StageOutOfMemoryError, learn_workspaces, observed_workspaces
from lightning_pipe.measure.profiler import device_spec, profile_graph
from lightning_pipe.plan.balance import balance_by_weight
from lightning_pipe.plan.headroom import checked, flat
from lightning_pipe.plan.plan import InfeasiblePlanError, Plan, make_plan
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.schedule import DistributedSchedule, actions, check_schedule, placement, process_stages
from lightning_pipe.plan.simulate import StageTime, simulate
from lightning_pipe.runtime.build import build
from lightning_pipe.runtime.distributed import (
    OUT_OF_MEMORY,
    DistributedPipeline,
    StageRunner,
    constants,
    cuts,
    pipeline_mesh,
    silent_mesh,
    to_device,
    to_host,
)
from lightning_pipe.runtime.fsdp import (
    check_shardable,
    full_value,
    mixed_precision,
    planned_shardings,
    shard_optimizer,
)
from lightning_pipe.runtime.materialize import check_resettable, has_meta, materialize_module

__all__ = ["DistributedEngine"]

Logged = list[tuple[str, Any, dict[str, Any]]]
_E = TypeVar("_E", bound=BaseException)
_T = TypeVar("_T")


class DistributedEngine(Engine):
    """This process's stages of a ``("pp", "dp")`` mesh of processes (see the module docstring)."""

    def __init__(self, strategy: ParallelStrategy, options: PipeOptions, process_group_backend: str | None) -> None:
        super().__init__(strategy, options)
        self.process_group_backend = process_group_backend
        self._mesh: DeviceMesh | None = None
        self.pipe: DistributedPipeline | None = None
        self._planned = False  # the pipeline is the training one (else provisional, for evaluation)
        self._serve: Any = None  # what self(...) returns on the last stage (planning: the profiler)
        self._mode: str | None = None  # "probe", "serve" or "profile" while a user step runs
        self._probed: Inputs | None = None
        self._step_loss: Callable[[Any, Tensor], Tensor] | None = None  # the running step's loss function
        self._sharded_from: Path | None = None  # a sharded checkpoint being resumed
        self._optimizers_from: Path | None = None  # ... whose optimizer state waits for the pipeline
        self._graphs: Variants | None = None  # the forward's graphs, by modes and inputs
        self._pipe_graph: Captured | None = None  # the graph the pipeline runs (the training graph)
        self._runners: dict[int, list[StageRunner]] = {}  # this rank's stages of each other graph (evaluation's)
        self._empty = False  # the module was built on the meta device: each rank materialises its stage
        self._init_rng: tuple[Tensor, Tensor | None] | None = None  # the CPU's and the device's random
        # states when the module was handed over: rank 0 initialises a meta-built module from them
        self._deferred: tuple[Mapping[str, Any] | None, list[Any] | None] | None = None  # a checkpoint's
        # model and optimizer states, for a module on the meta device: loaded into the held tensors
        self._partial_state: RemovableHandle | None = None  # warns of a module read after training
        self._seed = 0  # global rank 0's: the random states of the user's steps derive from it (_seeded)
        self._calls = 0  # the user's steps run so far, the same count on every rank
        self._silent: DeviceMesh | None = None  # the mesh of fake steps checking a plan (silent_mesh)
        self._warned_unchecked = False
        self._checked_peaks: list[int] | None = None  # per pipeline rank, of the plan's last check
        self._batch: tuple[Any, int] | None = None  # this training batch and its index
        self._agreed: Failure | None = None  # the failure of the step just run, as every rank agreed on it
        self._enforced: int | None = None  # the meter's capacity, while a failed step runs on without it
        self._limit_changed = False  # memory_limit was assigned since the last training batch
        self._metering = ExitStack()  # the meter, entered while the pipeline it meters trains
        # the schedule the stages run and the stages per process: the options', or under schedule="auto" the
        # first plan's pick, kept when planning again (before it, GPipe's: a provisional evaluation pipeline's)
        self._schedule = cast(DistributedSchedule, "gpipe" if options.schedule == "auto" else options.schedule)
        self._virtual = options.virtual_stages

    # --- ranks and processes, as Lightning's multi-process strategies ---------------------

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def _environment(self) -> ClusterEnvironment:
        environment = self.strategy.cluster_environment
        assert environment is not None, "the Trainer gives the strategy a cluster environment"
        return environment

    @property
    def global_rank(self) -> int:
        return self._environment.global_rank()

    @property
    def local_rank(self) -> int:
        return self._environment.local_rank()

    @property
    def node_rank(self) -> int:
        return self._environment.node_rank()

    @property
    def world_size(self) -> int:
        return self._environment.world_size()

    @property
    def num_nodes(self) -> int:
        return int(getattr(self.strategy, "num_nodes", 1))

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def num_processes(self) -> int:
        return len(self.strategy.parallel_devices or [])

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh exists once the processes have started (setup_environment).")
        return self._mesh

    @property
    def num_stages(self) -> int:
        return self.options.stages or self.world_size

    @property
    def _placement(self) -> list[int]:
        """The pipeline rank of each stage (:func:`~lightning_pipe.plan.schedule.placement`)."""
        return placement(self._schedule, self.num_stages, self._virtual)

    def _stages_of(self, position: int) -> list[int]:
        """The stages pipeline rank ``position`` runs, in order: they share its memory."""
        return process_stages(self._schedule, self.num_stages, self._virtual)[position]

    @property
    def sampler_kwargs(self) -> dict[str, Any]:
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def configure_launcher(self) -> None:
        environment = self._environment
        if not environment.creates_processes_externally:
            launcher = SubprocessScriptLauncher(environment, self.num_processes, self.num_nodes)
            set_launcher(self.strategy, launcher)
            _LAUNCHERS.append(launcher)

    def setup_ranks(self) -> None:
        environment = self._environment
        environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        if self.options.data_parallel == "fsdp" and self.world_size == self.num_stages:  # before any process starts
            raise ValueError(
                f"data_parallel='fsdp' shards each stage over its data-parallel replicas, but {self.world_size} "
                f"processes for stages={self.num_stages} leave one replica per stage: nothing to shard over. Give "
                f"more devices (a multiple of stages), fewer stages, or data_parallel='ddp'."
            )

    def setup_environment(self) -> None:
        reset_seed()
        self.setup_ranks()
        if self.world_size % self.num_stages:  # on every rank, before any collective
            raise ValueError(
                f"stages={self.num_stages} does not divide the {self.world_size} processes into whole pipeline "
                f"replicas. Use a divisor of {self.world_size} (devices * num_nodes), or leave stages=None."
            )
        self._connect()
        if self._mesh is None:  # once per strategy, whichever of fit, validate, test, predict runs first
            replicas = self.world_size // self.num_stages
            self._mesh = pipeline_mesh(self.num_stages, replicas, self.root_device.type, self.options.timeout)
        set_device_mesh(self.module, self._mesh)
        sync = _ReplicaSync(self._mesh.get_group("dp"))
        for metric in self.module.modules():
            if isinstance(metric, Metric) and metric.process_group is None and metric.dist_sync_fn is None:
                metric.dist_sync_fn = sync

    def _connect(self) -> None:
        """The default process group, waiting ``timeout`` for a peer. When Lightning's launcher
        starts the other ranks (after global rank 0), rank 0 waits for them to start (imports
        included) for at least ``_START_UP``: their start-up is no unanswered peer."""
        env = self._environment
        if dist.is_initialized():
            return
        options: dict[str, Any] = {}
        if isinstance(env, LightningEnvironment):  # not torchrun's or a scheduler's, which start every rank at once
            options["store"] = dist.TCPStore(  # type: ignore[attr-defined]  # public, not re-exported in the stubs
                env.main_address, env.main_port, self.world_size, is_master=self.global_rank == 0,
                timeout=max(self.options.timeout, _START_UP),
            )
        backend = self.process_group_backend or default_backend(self.root_device)
        init_process_group(env, backend, timeout=self.options.timeout, **options)

    def check_setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not self.module.automatic_optimization:
            raise ValueError(
                "runtime='distributed' runs each micro-batch's backward inside the schedule, which needs "
                "automatic optimization. Use runtime='local' for manual optimization."
            )

    def after_setup(self, trainer: Trainer) -> None:
        for optimizer in self.optimizers:
            state_to_param_devices(optimizer)
        # clipping by norm needs the norm over every stage's parameters
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    def tensor_init_context(self, empty_init: bool | None) -> AbstractContextManager[None] | None:
        """``trainer.init_module(empty_init=True)`` builds the model on the meta device: no
        process ever holds it whole; each rank materialises its own stage at the first batch
        (:mod:`~lightning_pipe.runtime.materialize`)."""
        return _on_meta(self.precision_plugin) if empty_init else None

    @property
    def runs_backward(self) -> bool:
        return True

    def model_to_device(self) -> None:
        """Route ``forward``; the stages are built at the first step, from its batch."""
        module = self.module
        if self._partial_state is not None:  # the pipeline holds the tensors again
            self._partial_state.remove()
            self._partial_state = None
        self._empty = has_meta(module)
        if self.options.data_parallel == "fsdp":  # on every rank, before any collective
            check_shardable(module)
            mixed_precision(self.precision_plugin.precision)
        if self._empty:
            check_resettable(module)
            cuda = self.root_device.type == "cuda"
            self._init_rng = torch.get_rng_state(), torch.cuda.get_rng_state(self.root_device) if cuda else None
        else:
            module.to(self.root_device)
        module.forward = self.run_forward  # type: ignore[method-assign]
        set_device(module, self.root_device)

    # --- building the pipeline --------------------------------------------------------------

    def _ensure_pipeline(self, hook: str, batch: Any, batch_idx: int, training: bool) -> DistributedPipeline:
        """Build at the first step; a training step replaces a provisional evaluation pipeline
        (the sanity check's) by the planned one."""
        if self.pipe is not None and (self._planned or not training):
            return self.pipe
        module = self.module
        ((args, kwargs),) = self._forward_calls(hook, [batch], batch_idx, self._calls)
        self._graphs = self._graphs or Variants(module, self.options.leaf_modules)
        captured = self._graphs.training_graph((args, kwargs))
        check_buffer_writes(captured, module, self.options.chunks)  # on every rank, before any collective
        stages = self.num_stages * self._virtual  # a process's stages share its memory
        o = self.options  # on every rank, before any collective:
        check_balance_entries(o.balance, self.num_stages, self._virtual, self._schedule)
        check_schedule(self._schedule, o.chunks, stages, self._virtual, distributed=True)
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        final = training or not fitting
        saved = self.options.plan
        if saved is not None:  # on every rank, before any collective
            if len(saved.balance) != stages:
                raise ValueError(f"the plan has {len(saved.balance)} stages, this run {stages} ({self.num_stages} "
                                 f"processes x {self._virtual} virtual stages): plan for {stages}.")
            check_follows(saved, captured, self.precision_plugin.precision)
            if training:
                check_microbatch(saved, batch_shapes(batch))
        planning = training and self.options.planner is not None and self.options.balance is None and saved is None
        plan = self._plan(captured, batch, batch_idx, (args, kwargs)) if planning else saved
        if planning and plan is not None:
            plan.precision = self.precision_plugin.precision
        if final:  # the evaluation graph, while every rank holds every tensor (an exported one needs them)
            with in_mode(module, training=False):
                self._graphs.get((args, kwargs))
        return self._build(captured, plan, (args, kwargs), final)

    def _build(self, captured: Captured, plan: Plan | None, arguments: Inputs, final: bool) -> DistributedPipeline:
        """Split ``captured`` by ``plan`` (global rank 0's; else the user's balance or an even
        split) and build this rank's stages, each rank receiving the tensors it lacks from the
        rank that held them (rank 0, or in the pipeline this one replaces)."""
        module = self.module
        old = self.pipe if self.pipe is not None and self.pipe.released else None
        if not final and self._empty and self.options.data_parallel == "fsdp":
            rank_zero_warn(
                "data_parallel='fsdp': the model built on the meta device is evaluated before training (the sanity "
                "check) on a provisional split that FSDP does not shard (training builds the sharded stages once, "
                "planned): each rank holds its stage whole until then. Pass num_sanity_val_steps=0 to the Trainer "
                "for no rank to ever hold its stage whole."
            )
        box: list[Any] = [None]
        if self.global_rank == 0:
            sample = scatter(arguments, self.options.chunks)[0]
            balance = plan.balance if plan else self.options.balance or balance_by_weight(
                captured.param_bytes(), self.num_stages * self._virtual)
            policies = policies_of(captured, plan) if plan else {}
            graph, root = captured, cast(nn.Module, module)
            if self._empty or old is not None:  # shapes are all a model without (all its) storage can give
                sample = tree_map(lambda x: x.to("meta") if isinstance(x, Tensor) else x, sample)
                if old is not None:
                    root, graph = meta_replica(module, captured, old.shapes)
            device = torch.device("meta") if self._empty or old is not None else self.root_device
            program = build(graph, root, balance, [device] * len(balance), policies, place=False)
            box = [(balance, policies, cuts(program, root, *sample), plan, torch.initial_seed(), self._checked_peaks)]
        dist.broadcast_object_list(box, src=0)
        balance, policies, boundaries, self.plan, self._seed, self._checked_peaks = box[0]
        if self.options.schedule == "auto" and self.plan is not None:  # the pick, on every rank
            self._schedule, self._virtual = cast(DistributedSchedule, self.plan.schedule), self.plan.virtual_stages
        if self.global_rank == 0 and plan is not None and plan is not self.options.plan:
            self._report(plan)
        program = build(captured, module, balance, [self.root_device] * len(balance), policies, place=False)
        with self._initialising():
            self.pipe = DistributedPipeline(
                program, module, boundaries, self.device_mesh, self._schedule,
                self.options.chunks, self._loss, self.root_device, release=final, timeout=self.options.timeout,
                previous=old.held_by_rank if old else None, init=partial(materialize_module, device=self.root_device),
                shapes=old.shapes if old else None, fsdp=self._fsdp if final else None,
                planned=planned_shardings(self.plan) if final and self.plan is not None else None,
            )
        self.pipe.failure.on_failure = self._stop_enforcing
        self._load_deferred(final)
        self._planned = final
        self._pipe_graph, self._runners = captured, {}
        self.clock = StageClock(1)  # this rank's stages as stage 0
        self._metering.close()  # a provisional pipeline's, or the one replaced
        enforced = self.meter.capacities[0] if self.meter is not None else None  # (less: memory another job took)
        if self.meter is not None:
            self.meter.close()
        capacity = self._rank_limit()
        if enforced is not None:
            capacity = enforced if capacity is None else min(capacity, enforced)
        self.meter = MemoryMeter(1, [capacity]) if self.options.measure_memory else None
        for stage in self.pipe.modules:
            stage.clock, stage.meter = self.clock, self.meter
            stage.step_context = self.precision_plugin.train_step_context
            stage.randomness = self._stage_seeded
        if self.meter is not None:  # from here on, as the local engine meters: the optimizer step too
            self.meter.own(0, self.pipe.held)
            self._metering.enter_context(self.meter)
            self._metering.enter_context(self.meter.saved_tensors_hooks())
        if final:
            for optimizer in self.optimizers:  # state of tensors another rank holds
                shard_optimizer(optimizer, self.pipe.swapped)
                for param in [p for p in optimizer.state if p.numel() == 0 or p.is_meta]:
                    del optimizer.state[param]
            self._load_sharded_optimizers()
        return self.pipe

    def _report(self, plan: Plan) -> None:
        """On global rank 0: the plan the stages are built by as a table (under ``schedule="auto"``
        the schedule picked, and every one weighed with its simulated step and peaks, or why it
        has none), and as ``plan.json`` in the logger's folder, which ``plan=`` follows."""
        rank_zero_info(f"lightning_pipe plan, which every rank builds:\n{plan.table()}")
        logger = self.module.trainer.logger
        if logger is not None and logger.log_dir is not None:
            Path(logger.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(logger.log_dir) / "plan.json").write_text(plan.to_json())

    @property
    def _fsdp(self) -> Any:
        """FSDP's mixed precision policy where the stages are sharded, else ``None``."""
        return mixed_precision(self.precision_plugin.precision) if self.options.data_parallel == "fsdp" else None

    @contextmanager
    def _initialising(self) -> Iterator[None]:
        """The random state a meta-built module was handed over with: rank 0 initialises it as
        if right after it was built, whatever ran since (the sanity check, the probe)."""
        with torch.random.fork_rng(devices=[self.root_device] if self.root_device.type == "cuda" else []):
            if self._init_rng is not None:
                cpu_state, device_state = self._init_rng
                torch.set_rng_state(cpu_state)
                if device_state is not None:
                    torch.cuda.set_rng_state(device_state, self.root_device)
            yield

    def _load_deferred(self, final: bool) -> None:
        """A checkpoint restored into a module on the meta device, loaded into the tensors this
        rank now holds (its optimizer states once the pipeline is final)."""
        if self._deferred is None or self.pipe is None:
            return
        state, optimizer_states = self._deferred
        if self._sharded_from is not None:
            load_tensors(self._sharded_from, self.pipe.held_state())
        elif state is not None:
            self.pipe.load_state_dict(dict(state))
        if final:
            for optimizer, saved in zip(self.optimizers, optimizer_states or []):
                optimizer.load_state_dict(saved)
                shard_optimizer(optimizer, {})
            self._deferred = None

    def _limits(self, limits: list[int] | None) -> list[int] | None:
        """``memory_limit`` (``limits``) per stage (:func:`~lightning_pipe.lightning.options.limits_per_stage`);
        under ``schedule="auto"``, whose stages are the pick's, per pipeline process."""
        if self.options.schedule == "auto":
            return limits_per_stage(limits, self.num_stages, "pipeline processes (schedule='auto': one per process)")
        return limits_per_stage(limits, self.num_stages * self._virtual, "stages")

    def _process_limit(self, limits: list[int], position: int) -> int:
        """What ``limits`` (:meth:`_limits`) give pipeline rank ``position``: its stages' together."""
        if self.options.schedule == "auto":
            return limits[position]
        return sum(limits[s] for s in self._stages_of(position))

    def _rank_limit(self) -> int | None:
        """What ``memory_limit`` gives this rank's stages together (the meter enforces it)."""
        limits = self._limits(self.options.memory_limit)
        return None if limits is None else self._process_limit(limits, self._position())

    def _position(self) -> int:
        coordinate = self.device_mesh.get_coordinate()
        assert coordinate is not None, "this rank is in the mesh"
        return coordinate[0]

    def _process_capacities(self) -> list[int]:
        """Each pipeline process's memory limit, which its stages share: ``memory_limit`` (its
        stages' added), else the least memory any replica of the process has (``device_memory``;
        the host's RAM shared by the processes on it); less where a rank's meter enforces less
        (memory another job took, :meth:`_build`). On every rank: a collective."""
        limits = self._limits(self.options.memory_limit)
        device = self.root_device
        memory = device_memory(device) // (1 if device.type == "cuda" else max(1, self.num_processes))
        enforced = self.meter.capacities[0] if self.meter is not None and self._planned else None
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, (memory, enforced))
        replicas = self.world_size // self.num_stages
        capacities = []
        for p in range(self.num_stages):
            rank = every[p * replicas : (p + 1) * replicas]
            given = min(m for m, _ in rank) if limits is None else self._process_limit(limits, p)
            capacities.append(min([given, *(e for _, e in rank if e is not None)]))
        return capacities

    def _plan(
        self, captured: Captured, batch: Any, batch_idx: int, arguments: Inputs
    ) -> Plan | None:
        """Global rank 0 profiles one micro-batch and plans; every rank checks each plan by a
        fake training step of its own stages (:func:`~lightning_pipe.lightning.check.fake_rank_peak`),
        and rank 0 plans again below the limits where a rank went over
        (:func:`~lightning_pipe.plan.headroom.checked`). The plan on rank 0, ``None`` elsewhere."""
        capacities = self._process_capacities()
        if self._corrections is not None:  # below what training showed each rank takes beyond its check
            capacities = [int(c / f) for c, f in zip(capacities, self._corrections.factors)]
        self._silent = self._silent or silent_mesh(self.num_stages, self.world_size // self.num_stages)
        shapes = self.pipe.shapes if self.pipe is not None and self.pipe.released else None
        check = partial(self._check_rank, captured, batch, batch_idx, arguments, shapes)
        if self.global_rank != 0:
            while True:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=0)
                kind, value, workspaces = box[0]
                if kind == "infeasible":  # every rank raises what rank 0 does
                    raise InfeasiblePlanError(*value)
                if kind == "failed":
                    raise RuntimeError(f"Global rank 0 could not plan: {value}")
                if kind == "done":
                    return None
                learn_workspaces(workspaces)
                self._gather_checks(check(value))
        try:
            plan = self._plan_on_rank_zero(captured, batch, batch_idx, arguments, capacities, check)
        except InfeasiblePlanError as error:
            dist.broadcast_object_list([("infeasible", (str(error), error.min_peak, error.stage), None)], src=0)
            raise
        except BaseException as error:
            dist.broadcast_object_list([("failed", f"{type(error).__name__}: {error}", None)], src=0)
            raise
        dist.broadcast_object_list([("done", None, None)], src=0)
        return plan

    def _plan_on_rank_zero(
        self, captured: Captured, batch: Any, batch_idx: int, arguments: Inputs, capacities: list[int],
        check: Callable[[Plan], int | str],
    ) -> Plan:
        if self.profile is None or not self._planned:  # (planning again: the first profile; the rank holds
            self._profile(captured, batch, batch_idx, arguments)  # only its stages now)
        o = self.options
        assert o.planner is not None and self.profile is not None
        profile = self.profile

        def checked_on_every_rank(plan: Plan) -> list[int]:
            # with the workspaces of the operators rank 0 ran for real: the fake steps charge them
            dist.broadcast_object_list([("check", plan, observed_workspaces())], src=0)
            return self._rank_peaks(plan, self._gather_checks(check(plan)))

        # a check is one fake step on each rank at once: every plan is checked. "auto" weighs the schedules at the
        # first plan; planning again keeps its pick, whose stages are built (plan.auto)
        picking = o.schedule == "auto" and not self._planned
        request = PlanRequest(capacities, o.planner, "auto" if picking else self._schedule, o.chunks, o.host_bandwidth,
                              o.link_bandwidth, carry=True, replicas=self.world_size // self.num_stages,
                              virtual_stages=None if picking else self._virtual,
                              data_parallel=o.data_parallel)
        return checked(lambda targets: make_plan(profile, replace(request, capacities=targets)),
                       capacities, checked_on_every_rank, always=True)

    def _profile(self, captured: Captured, batch: Any, batch_idx: int, arguments: Inputs) -> None:
        """Global rank 0 profiles one micro-batch (:attr:`profile`)."""
        optimizer = self.optimizers[0] if self.optimizers else None
        device = device_spec(self.root_device)
        if self._empty:  # no storage: the forward profiled on fake tensors (times from a roofline); the
            # loss, which would meet real labels, is seen by the fake checks
            sample = tree_map(lambda x: x.to("meta") if isinstance(x, Tensor) else x,
                              scatter(arguments, self.options.chunks)[0])
            with torch.enable_grad():
                self.profile = profile_graph(captured, *sample, optimizer=optimizer, fake=True, device=device)
        else:  # the first micro-batch's step, its self(...) answered by the profiler (probe_step)
            meter, output = MemoryMeter(1), list[Any]()

            def profiled(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                with torch.enable_grad(), meter.running(None):
                    self.profile = profile_graph(captured, args, kwargs, optimizer=optimizer, output=output,
                                                 device=device)
                return output[0]  # as the schedule hands the loss the stage's output: no copy

            self._mode, self._serve = "profile", profiled
            try:
                with self._seeded(self._calls, 0):
                    step = probe_step(self.module, scatter(batch, self.options.chunks)[0], batch_idx, meter,
                                      [self.root_device], lambda: output[0], self.precision_plugin)
            finally:
                self._mode, self._serve = None, None
            assert self.profile is not None, "the step called self(...) (_forward_calls)"
            step.record(self.profile)

    def _check_rank(
        self, captured: Captured, batch: Any, batch_idx: int, arguments: Inputs,
        shapes: Mapping[int, torch.Size] | None, plan: Plan,
    ) -> int | str:
        """This rank's peak when ``plan`` trains, from a fake training step; a reason where
        the user's step cannot run on fake tensors. ``shapes``: of the tensors the rank released."""
        optimizer = self.optimizers[0] if self.optimizers else None
        assert self._silent is not None
        try:
            return fake_rank_peak(self.module, captured, batch, batch_idx, arguments, optimizer,
                                  self.precision_plugin, plan, self._silent, shapes,
                                  cuda=self.root_device.type == "cuda")
        except UncheckableStepError as error:
            return str(error)

    def _gather_checks(self, mine: int | str) -> list[int | str]:
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        return every

    def _rank_peaks(self, plan: Plan, checks: list[int | str]) -> list[int]:
        """Each pipeline process's checked peak (the largest of its replicas'); where a rank
        could not check, the flat headroom (:func:`~lightning_pipe.plan.headroom.flat`), said once."""
        why = next((c for c in checks if isinstance(c, str)), None)
        replicas = self.world_size // self.num_stages
        self._checked_peaks = None if why else [
            max(cast(list[int], checks[p * replicas : (p + 1) * replicas])) for p in range(self.num_stages)
        ]
        if why is not None:
            if not self._warned_unchecked:
                self._warned_unchecked = True
                rank_zero_warn(unchecked_warning(why))
            return flat(plan)
        assert self._checked_peaks is not None
        return list(self._checked_peaks)

    def set_memory_limit(self, limits: list[int] | None) -> None:
        """Enforce ``limits`` on this rank from now on and, with a planner, plan for them at
        the next training batch, every rank together (a rank told alone tells the others there)."""
        if self.pipe is not None:
            self._limits(limits)  # (raises before anything changes)
        self.options.memory_limit = limits
        if self.pipe is None or not self._planned:  # the first plan is for them
            return
        if self.meter is not None:
            self.meter.capacities[0] = self._rank_limit()
        self._limit_changed = True

    # --- planning again while training --------------------------------------------------------

    @property
    def _planner_splits(self) -> bool:
        """Whether the planner made the split and so may make it again (no user ``balance``)."""
        o = self.options
        return (self._planned and self.plan is not None and o.planner is not None and o.balance is None
                and o.plan is None and o.data_parallel == "ddp")  # (sharded stages are never rebuilt)

    def replans(self) -> bool:
        return self._planner_splits and self.options.max_replans > 0

    def _stop_enforcing(self, error: BaseException) -> None:
        """This rank ran out of memory mid-step: the rest of the step runs without computing,
        and the meter no longer refuses (:class:`~lightning_pipe.runtime.distributed.StageFailure`)."""
        if self.meter is not None:
            self._enforced = self.meter.capacities[0]
            self.meter.capacities[0] = None

    def _agree(self, error: BaseException | None, limits: bool = False) -> None:
        """On every rank, at the start of a training batch and after its schedule: whether any
        rank ran out of memory (``error``: this rank's); if one did, every rank raises its error
        (the step is undone and runs again, :meth:`recover`). ``limits``: else whether a rank
        was given a new ``memory_limit``, then planned for on every rank (:meth:`_plan_for_limits`).

        Raises:
            StageOutOfMemoryError: a rank's meter refused (the stage named is its pipeline rank).
            torch.OutOfMemoryError: a rank's device ran out.
        """
        assert self.pipe is not None
        flags = torch.tensor([0.0 if error is None else 1.0, 1.0 if limits and self._limit_changed else 0.0],
                             device=self.root_device)  # (NCCL reduces only device tensors)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        failed, changed = flags.tolist()
        if failed:
            self._fail_together(error)
        if changed:
            self._plan_for_limits()

    def _fail_together(self, error: BaseException | None) -> None:
        """Every rank raises the failure of the first rank that had one."""
        assert self.pipe is not None
        if self._enforced is not None and self.meter is not None:  # (the rest of the step ran without it)
            self.meter.capacities[0], self._enforced = self._enforced, None
        mine: tuple[int, int | None, int | None, int | None, str | None] | None = None
        if isinstance(error, StageOutOfMemoryError):
            mine = (self.pipe.position, error.capacity, error.request, error.in_use, None)
        elif error is not None:
            mine = (self.pipe.position, None, None, None, str(error).splitlines()[0] or type(error).__name__)
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        position, capacity, request, in_use, text = next(e for e in every if e is not None)
        if text is None:
            agreed: BaseException = StageOutOfMemoryError(position, capacity, request, in_use, self._named(position))
            self._agreed = Failure(position, in_use, request, str(agreed))
        else:
            agreed = torch.OutOfMemoryError(f"{self._named(position) or f'Pipeline rank {position}'} ran out of "
                                            f"device memory: {text}")
            self._agreed = Failure(position, None, None, str(agreed))
        raise _every_rank(agreed)

    def _named(self, position: int) -> str | None:
        """Pipeline rank ``position`` by the stages it runs, where it runs several (interleaved:
        they share its memory, which the meter counts as one); ``None``: its one stage."""
        if self._virtual == 1:
            return None
        *others, last = self._stages_of(position)
        return f"Pipeline rank {position} (stages {', '.join(map(str, others))} and {last}, which share its memory)"

    def failure_of(self, error: BaseException) -> Failure:
        """The failure every rank agreed on (:meth:`_agree`): a stage is a pipeline rank."""
        agreed, self._agreed = self._agreed, None
        return agreed or super().failure_of(error)

    def _rank_checked(self) -> list[int]:
        """What the plan's check said each pipeline rank peaks at (its prediction where the step
        could not be checked)."""
        assert self.plan is not None
        if self._checked_peaks is not None:
            return list(self._checked_peaks)
        return self.plan.process_peaks()

    def recover(self, failure: Failure) -> None:
        """Plan again below the memory the failed step showed its rank takes, and rebuild; on
        every rank together."""
        assert self._batch is not None, "a training batch has started"
        if self._batch[1] % self.module.trainer.accumulate_grad_batches:
            raise _every_rank(mid_window(failure))
        self._replan(lambda c: c.learn_failure(failure, self._rank_checked()), failure.message)

    def after_step(self) -> None:
        """Plan again before the next batch where a rank's metered peak drifted past its
        prediction (:data:`~lightning_pipe.lightning.recovery.DRIFT`) and its target; every
        rank decides alike (a collective)."""
        plan, meter = self.plan, self.meter
        if not self._planner_splits or plan is None or meter is None:
            return
        corrections = self._corrections_so_far()
        p, peak, checked_peaks = self._position(), meter.stages[0].peak, self._rank_checked()
        predicted, target = plan.process_peaks()[p], plan.targets[p]
        mine = peak > (1 + DRIFT) * predicted and peak > target and peak > corrections.factors[p] * checked_peaks[p]
        drifting = torch.tensor([1.0 if mine else 0.0], device=self.root_device)
        dist.all_reduce(drifting, op=dist.ReduceOp.MAX)
        if not drifting.item() or corrections.replans >= self.options.max_replans:
            return
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, (p, peak, predicted, target, mine))
        drifted: dict[int, tuple[int, int, int]] = {}  # the replica's that drifted most, per pipeline rank
        for q, peak, predicted, target, drifts in every:
            if drifts and peak > drifted.get(q, (0, 0, 0))[0]:
                drifted[q] = peak, predicted, target
        why = "; ".join(f"pipeline rank {q} peaked at {top:,} bytes, {top / expected - 1:.1%} over its prediction "
                        f"and past its target of {aim:,}" for q, (top, expected, aim) in sorted(drifted.items()))

        def learn(c: Corrections) -> None:
            for q, (peak, _, _) in drifted.items():
                c.learn(q, peak, checked_peaks[q])

        self._replan(learn, why)

    @property
    def _memories(self) -> int:
        """A memory per pipeline rank (its stages share it)."""
        return self.num_stages

    def _replan(self, learn: Callable[[Corrections], None], why: str) -> None:
        """Every rank plans again together (the failure or drift was agreed on), and so gives up
        together: no rank need end the others.

        Raises:
            RecoveryError: ``max_replans`` were made already, or no plan fits; on every rank.
        """
        try:
            super()._replan(learn, why)
        except RecoveryError as error:
            raise _every_rank(error) from error.__cause__

    def _plan_again(self) -> None:
        """On every rank: plan for this batch again from the first profile and rebuild the
        stages, parameters and optimizer state moving to their new ranks."""
        assert self._batch is not None and self._pipe_graph is not None and self.plan is not None
        batch, batch_idx = self._batch
        captured, before = self._pipe_graph, self.plan
        ((args, kwargs),) = self._forward_calls("training_step", [batch], batch_idx, self._calls)
        states = self._optimizer_states()
        plan = self._plan(captured, batch, batch_idx, (args, kwargs))
        if plan is not None:
            plan.precision, plan.input_shapes = before.precision, before.input_shapes
        self._build(captured, plan, (args, kwargs), final=True)
        self._restore_optimizer_states(states)

    def _optimizer_states(self) -> list[dict[int, Any]]:
        """Every optimizer's state of every parameter, by its place in the optimizer, from the
        ranks holding them (host copies, on every rank)."""
        mine = []
        for optimizer in self.optimizers:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            mine.append({k: to_host(optimizer.state[p]) for k, p in enumerate(params) if p in optimizer.state})
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        merged: list[dict[int, Any]] = [{} for _ in self.optimizers]
        for states in every:
            for whole, part in zip(merged, states):
                whole.update(part)
        return merged

    def _restore_optimizer_states(self, states: list[dict[int, Any]]) -> None:
        """The state of each parameter this rank holds now, where it was taken from
        (:meth:`_optimizer_states`); charged to the meter as the step will find it."""
        for optimizer, state in zip(self.optimizers, states):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for k, param in enumerate(params):
                if k in state and param.numel() > 0 and not param.is_meta and param not in optimizer.state:
                    optimizer.state[param] = to_device(state[k], self.root_device)
            state_to_param_devices(optimizer)
            if self.meter is not None:
                self.meter.own_optimizer_state(optimizer)

    def _plan_for_limits(self) -> None:
        """A rank was given a new ``memory_limit`` (:meth:`set_memory_limit`): every rank takes
        the least each stage was given, and plans again."""
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, self._limits(self.options.memory_limit) if self._limit_changed else None)
        told = [limits for limits in every if limits is not None]
        limits = [min(stage) for stage in zip(*told)]
        self._limit_changed = False
        self.options.memory_limit = limits
        if self.meter is not None:
            self.meter.capacities[0] = self._rank_limit()
        before = cast(Plan, self.plan)
        rank_zero_info(f"memory_limit is now {limits}: planning again.")
        try:
            self._plan_again()
        except InfeasiblePlanError as error:
            raise _every_rank(limit_unmet(limits, error)) from error
        rank_zero_info(f"The stages are split again: balance {before.balance} -> {cast(Plan, self.plan).balance}.")

    # --- the user's steps -------------------------------------------------------------------

    def run_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``forward`` while the strategy runs it: the arguments of a probing step,
        the pipeline's output to the last stage's step."""
        if self._mode == "probe":
            self._probed = args, kwargs
            raise _Probed
        if self._mode == "serve":
            self._mode = None
            return self._serve
        if self._mode == "profile":  # planning: the profiler runs the graph on these arguments
            self._mode = None
            return self._serve(args, kwargs)
        raise RuntimeError(
            "Under runtime='distributed' the module's forward runs through the pipeline only as the "
            "self(...) call of training_step, validation_step, test_step or predict_step, once per step. "
            "Call self(...) exactly once there."
        )

    def _forward_calls(self, hook: str, batches: list[Any], batch_idx: int, turn: int) -> list[Inputs]:
        """The arguments ``hook`` passes to ``self(...)`` for each of ``batches``: it runs up to
        that call, batch ``i`` under the random state of micro-batch ``i`` of step ``turn``
        (:meth:`_seeded`), without gradients, nothing logged and no metric updated (the
        metrics copied once for all the batches)."""
        calls: list[Inputs] = []
        with torch.no_grad(), silenced(self.module):
            for i, batch in enumerate(batches):
                self._mode, self._probed = "probe", None
                try:
                    with self._seeded(turn, i):
                        getattr(self.module, hook)(batch, batch_idx)
                except _Probed:
                    pass
                finally:
                    self._mode = None
                if self._probed is None:
                    raise RuntimeError(NO_FORWARD.format(hook=hook))
                calls.append(self._probed)
        return calls

    @contextmanager
    def _seeded(self, call: int, microbatch: int, *stage: int) -> Iterator[None]:
        """The random state of one call of the user's step on one micro-batch, the same on every
        rank of the pipeline: the code before ``self(...)`` draws what the stage feeding the
        pipeline drew, wherever it runs again. ``stage``: that of a stage's forward in the call.
        The process's own random state is left as it was."""
        cuda = self.root_device.type == "cuda"
        with torch.random.fork_rng(devices=[self.root_device] if cuda else []):
            seed = hash((self._seed, call, microbatch, *stage)) % 2**63
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed(seed)
            yield

    def _stage_seeded(self, stage: int, microbatch: int) -> AbstractContextManager[None]:
        """The random state of stage ``stage``'s forward of a micro-batch in the running training
        step (its dropout masks): the same under every schedule, each stage and micro-batch its own
        (ranks seeded alike by ``seed_everything`` have equal streams of their own)."""
        return self._seeded(self._calls - 1, microbatch, stage)

    def _step_inputs(self, hook: str, microbatches: list[Any], batch_idx: int, turn: int) -> list[dict[str, Any]]:
        """Each micro-batch's forward arguments by graph input, as ``hook`` passes them to
        ``self(...)`` under the micro-batch's random state; non-tensor arguments go to this
        rank's stages, which read them in place of the values of the first step."""
        pipe = self.pipe
        assert pipe is not None and self._graphs is not None
        bound = []
        for inputs in self._forward_calls(hook, microbatches, batch_idx, turn):
            if self._graphs.known(inputs) is not self._pipe_graph:
                raise RuntimeError(
                    f"{hook} called self(...) with arguments the captured graph does not admit (torch.export "
                    f"specialised it to the first step's non-tensor arguments), and under runtime='distributed' no "
                    f"rank holds the whole model to capture another. Pass a value that changes as a tensor."
                )
            bound.append(pipe.modules[0].program.bind(*inputs))
        fixed = constants(bound[0])
        for name, value in fixed.items():
            others = [b[name] for b in bound[1:] if b[name] != value]
            if others:
                raise ValueError(
                    f"{hook} passed self(...) {name}={value!r} on one micro-batch and {others[0]!r} on another of the "
                    f"same batch: a non-tensor argument must be one value per step. Pass it as a tensor."
                )
        pipe.set_arguments(fixed)
        return bound

    @contextmanager
    def _serving(self, output: Any) -> Iterator[None]:
        self._serve, self._mode = output, "serve"
        try:
            yield
        finally:
            self._serve, self._mode = None, None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Build the pipeline at the first training batch (planned by global rank 0)."""
        sizes = [batch_size(mb) for mb in scatter(batch, self.options.chunks)]
        if len(sizes) != self.options.chunks or len(set(sizes)) != 1:  # on every rank, before any collective
            raise ValueError(
                f"runtime='distributed' needs every training batch to split into chunks={self.options.chunks} equal "
                f"micro-batches (torch.distributed.pipelining has static shapes), got a batch of {sum(sizes)} samples "
                f"on this replica (micro-batches {sizes}). Use a per-replica batch size divisible by chunks and "
                f"drop_last=True in the DataLoader."
            )
        planned = self._planned
        self._batch = batch, batch_idx
        self._ensure_pipeline("training_step", batch, batch_idx, training=True)
        error = None
        if self.meter is not None:  # every rank loads the batch
            try:
                self.meter.charge_batch(0, [t for t in tree_flatten(batch)[0] if isinstance(t, Tensor)])
            except OUT_OF_MEMORY as oom:
                if not planned:  # (the first batch: no rank has agreed on anything yet)
                    raise
                error = oom
        if planned:
            self._agree(error, limits=self._planner_splits)

    def training_step(self, step: Callable[[], Any], forwards_only: bool, *args: Any, **kwargs: Any) -> Any:
        return self._training_step(*args, **kwargs)

    def _training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Tensor:
        pipe = self.pipe
        assert pipe is not None, "on_train_batch_start builds the pipeline"
        module, optimizer = self.module, self.optimizers[0]
        microbatches = scatter(batch, self.options.chunks)
        sizes = [batch_size(mb) for mb in microbatches]
        turn = self._calls
        self._calls += 1
        accumulate = module.trainer.accumulate_grad_batches
        weight = 1 / (self.options.chunks if self.options.loss_reduction == "mean" else 1) / accumulate
        # 16-mixed's grad scaler: the schedule runs the backward, so the loss is scaled here, as
        # Lightning's backward would (its optimizer step unscales the gradients; on a rank without
        # the loss, the scale is made for it)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            scaler.scale(torch.zeros((), device=self.root_device))
        losses: dict[int, Tensor] = {}
        with LogCollector(module, sizes, self.options.loss_reduction) as logs:

            def loss_fn(output: Any, target: Tensor) -> Tensor:
                i = int(target)
                with (
                    logs.microbatch(i), self.precision_plugin.train_step_context(), self._serving(output),
                    self._seeded(turn, i),
                ):
                    loss = _loss_of(module.training_step(microbatches[i], batch_idx, *args, **kwargs))
                logs.returned(i, loss)
                losses[i] = loss.detach()
                return loss * weight if scaler is None else scaler.scale(loss * weight)

            self._step_loss = loss_fn
            bound = self._step_inputs("training_step", microbatches, batch_idx, turn)
            # a copy: the first rank holds it beside the batch
            inputs = self._unrefused(lambda: gather(bound, self.root_device) if pipe.is_first else None)
            _before_step(module, optimizer, batch_idx)
            self.clock.reset()
            with self._running():
                pipe.rank.train_step(inputs)
            self._agree_on_step(turn)
            logged: Logged = []
            if pipe.is_last:
                with _recording(module, logged):
                    logs.flush()
        loss = torch.stack([losses[i] for i in sorted(losses)]).mean() if losses else None
        loss, logged = self._from_last_stage((loss, logged))
        if not pipe.is_last:
            _replay(module, logged)
        call_callback_hooks(module.trainer, "on_before_backward", loss / accumulate)
        call_module_hook(module.trainer, "on_before_backward", loss / accumulate)
        if self.stepping:
            self._unrefused(pipe.sync_gradients)
            self._agree_on_step(turn)
            if scaler is not None:
                self._overflow_everywhere()
        call_callback_hooks(module.trainer, "on_after_backward")
        call_module_hook(module.trainer, "on_after_backward")
        return cast(Tensor, loss).to(self.root_device)

    def _unrefused(self, run: Callable[[], _T]) -> _T:
        """``run()`` as this rank's, the meter refusing nothing inside (a collective in it must
        meet its peers'); where the rank went past its limit in it, the step has failed (every
        rank learns of it at :meth:`_agree_on_step`)."""
        assert self.pipe is not None
        if self.meter is None:
            with self._running():
                return run()
        with self.meter.unrefused(0) as inside, self._running():
            result = run()
        if inside.capacity is not None and inside.during > inside.capacity:
            self.pipe.failure.fail(StageOutOfMemoryError(0, inside.capacity, inside.during - inside.held, inside.held))
        return result

    def _agree_on_step(self, turn: int) -> None:
        """:meth:`_agree` on whether the step ran out of memory on a rank; if so, the step
        (call ``turn`` of the user's) runs again under the same random states."""
        assert self.pipe is not None
        try:
            self._agree(self.pipe.failure.clear())
        except OUT_OF_MEMORY:
            self._calls = turn
            raise

    def _overflow_everywhere(self) -> None:
        """Under 16-mixed, every rank skips the step (and lowers its scale) when any rank's
        gradients overflowed, as one device's scaler would: each rank's scaler sees only its
        own stages' gradients, so a rank whose are finite is handed an infinite entry."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        # one device-side reduction: no host sync per gradient
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        overflow = (~finite).to(self.root_device, torch.float32).reshape(1)
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
        if overflow.item() and bool(finite) and grads:
            grads[0].view(-1)[0] = float("inf")

    def _running(self) -> AbstractContextManager[None]:
        """What is allocated inside is this rank's (its stages are the meter's stage 0)."""
        return self.meter.running(0) if self.meter is not None else nullcontext()

    def _loss(self, output: Any, target: Tensor) -> Tensor:
        assert self._step_loss is not None, "the last stage computes losses only inside training_step"
        return self._step_loss(output, target)

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` as the last stage of this rank's pipeline has it."""
        box = [to_host(value)]
        pp = self.device_mesh.get_group("pp")
        dist.broadcast_object_list(box, group_src=self._placement[-1], group=pp)
        return to_device(box[0], self.root_device)

    def _eval_step(self, hook: str, batch: Any, batch_idx: int, *args: Any) -> Any:
        pipe = self._ensure_pipeline(hook, batch, batch_idx, training=False)
        module = self.module
        count = len(scatter(batch, self.options.chunks))
        turn = self._calls
        self._calls += 1
        ((forward_args, forward_kwargs),) = self._forward_calls(hook, [batch], batch_idx, turn)
        runners = self._runners_for(pipe, forward_args, forward_kwargs)
        inputs = runners[0].program.bind(forward_args, forward_kwargs)
        microbatches = scatter(inputs, count) if pipe.is_first else None
        output = pipe.rank.forward_only(runners, microbatches, count)
        result, logged = None, cast(Logged, [])
        if pipe.is_last:
            with _recording(module, logged), self._serving(output), self._seeded(turn, 0):
                result = getattr(module, hook)(batch, batch_idx, *args)
        result, logged = self._from_last_stage((result, logged))
        if not pipe.is_last:
            _replay(module, logged)
        return result

    def _runners_for(
        self, pipe: DistributedPipeline, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[StageRunner]:
        """This rank's stages of the graph for the module's current modes and these inputs: in
        evaluation, the evaluation graph (no dropout; batch norm's running statistics), split
        so that each stage reads the parameters its rank holds; built once per graph."""
        assert self._graphs is not None and self._pipe_graph is not None, "the pipeline captured the training graph"
        captured = self._graphs.known((args, kwargs))
        if captured is None and pipe.released and self._pipe_graph.front_end == "torch.export":
            raise RuntimeError(
                "Under runtime='distributed' each rank holds only its stage's parameters once training starts, so "
                "torch.export can capture no new graph of forward: evaluation runs the graph captured in evaluation "
                "mode from the first training batch's arguments. Call self(...) with the same arguments (names, "
                "shapes but the batch size) in every step (e.g. pass labels in predict_step too, pad to one length)."
            )
        captured = captured or self._graphs.get((args, kwargs))
        if captured is self._pipe_graph:
            return list(pipe.modules)
        if id(captured) not in self._runners:
            balance = follow_balance(captured, pipe.stage_of(), pipe.num_stages)
            program = build(captured, self.module, balance, [self.root_device] * pipe.num_stages, place=False)
            self._runners[id(captured)] = pipe.runners(program, self.module)
        return self._runners[id(captured)]

    def eval_step(self, hook: str, step: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        contexts = {"validation_step": "val_step_context", "test_step": "test_step_context",
                    "predict_step": "predict_step_context"}
        with getattr(self.precision_plugin, contexts[hook])():
            return self._eval_step(hook, *args, **kwargs)

    def log_step_metrics(self, step_ms: float) -> None:
        """Every rank's time and metered peaks, gathered and logged by global rank 0 under the
        one-process runtime's names (replica 0's stages; the step time of the slowest rank)."""
        trainer = self.module.trainer
        mine = {"step_ms": step_ms, "forward_ms": self.clock.forward_ms[0], "backward_ms": self.clock.backward_ms[0]}
        if self.meter is not None:
            mine.update(peak_bytes=self.meter.stages[0].peak,
                        activation_bytes=self.meter.stages[0].kind_peaks["activations"])
        if self.root_device.type == "cuda":  # the allocator's own count, beside the meter's
            mine["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.root_device)
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        if self.global_rank != 0:
            return
        replicas = self.world_size // self.num_stages
        stages = [parts[s * replicas] for s in range(self.num_stages)]
        metrics: dict[str, float] = {"pipe/step_ms": max(p["step_ms"] for p in parts)}
        for s, part in enumerate(stages):
            for key in ("forward_ms", "backward_ms", "peak_bytes", "activation_bytes", "cuda_peak_bytes"):
                if key in part:
                    metrics[f"pipe/stage{s}/{key}"] = part[key]
            if self.plan is not None:  # the process's, over its stages' action order
                metrics[f"pipe/stage{s}/predicted_peak_bytes"] = self.plan.process_peaks()[s]
            if self._checked_peaks is not None:  # the fake step of the plan, on that rank
                metrics[f"pipe/stage{s}/checked_peak_bytes"] = self._checked_peaks[s]
        metrics["pipe/bubble_fraction"] = self._bubble([(p["forward_ms"], p["backward_ms"]) for p in stages])
        log_step_metrics(trainer, metrics)

    def _bubble(self, ranks: list[tuple[float, float]]) -> float:
        """The step's bubble fraction, simulated on the schedule's action order from each rank's
        measured forward and backward time (ms, all its micro-batches), dealt to its stages as
        the plan's times share them (evenly without a plan)."""
        o, stages = self.options, self.num_stages * self._virtual
        share = [1.0] * stages
        if self.plan is not None and len(self.plan.stages) == stages:
            share = [max(r.forward_ms + r.backward_ms, 1e-9) for r in self.plan.stages]
        times = []
        for s, p in enumerate(self._placement):
            part = share[s] / sum(share[t] for t in self._stages_of(p)) / o.chunks
            times.append(StageTime(ranks[p][0] * part, ranks[p][1] * part))
        return simulate(times, actions(self._schedule, o.chunks, stages, self._virtual)).bubble

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        assert self.pipe is not None
        self.pipe.clip_grad_norm_(float(clip_val))

    # --- checkpoints ------------------------------------------------------------------------

    def module_state_dict(self) -> dict[str, Any]:
        """The plain module's ``state_dict``, gathered on global rank 0 (empty elsewhere); when
        sharded, each rank's own part."""
        if self.pipe is None:
            return self.module.state_dict() if self.global_rank == 0 or not self._sharded else {}
        if self._sharded:
            return self.pipe.owned_state()
        return self.pipe.state_dict() or {}  # (FSDP's shards gathered on every replica)

    @property
    def _sharded(self) -> bool:
        return self.options.state_dict_type == "sharded"

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state of every parameter, gathered on global rank 0."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        state = optimizer.state_dict()
        if self.pipe is None:
            return state if self.global_rank == 0 or not self._sharded else {**state, "state": {}}
        sharded = self.pipe.sharded  # each replica holds a shard of the state
        mine = state["state"] if self.pipe.replica == 0 or (sharded and self._sharded) else {}
        if self._sharded:
            return {**state, "state": mine}
        if sharded:  # every replica gathers each whole state tensor
            gathered = {k: {key: full_value(v) for key, v in s.items()} for k, s in state["state"].items()}
            mine = gathered if self.pipe.replica == 0 else {}
        mine = to_host(mine)
        parts: list[Any] = [None] * self.world_size if self.global_rank == 0 else []
        dist.gather_object(mine, parts if self.global_rank == 0 else None, dst=0)
        if self.global_rank != 0:
            return {}
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PATH) -> bool:
        """A sharded checkpoint is a directory every rank writes its part to."""
        if not self._sharded:
            return False
        save_sharded(checkpoint, Path(self.broadcast(filepath, 0)), self.global_rank)
        return True

    def load_checkpoint(self, checkpoint_path: PATH) -> dict[str, Any] | None:
        """A sharded checkpoint's tensors are read in place later, each rank its own."""
        path = Path(self.broadcast(checkpoint_path, 0))
        self._sharded_from = path if is_sharded(path) else None
        if self._sharded_from is None:
            if path.is_dir():
                raise FileNotFoundError(
                    f"{path} is a directory but not a sharded checkpoint of runtime='distributed' (it has no "
                    f"{METADATA_FILENAME}). Pass the directory trainer.save_checkpoint wrote, or a checkpoint file."
                )
            return None
        return load_meta(path)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool) -> bool:
        if self.pipe is None and has_meta(self.module):  # nothing to load into yet (restored before setup)
            self._deferred = (None if self._sharded_from else checkpoint["state_dict"], None)
        elif self._sharded_from is not None:  # every tensor before the first batch, then the held ones
            tensors = self.pipe.held_state() if self.pipe else self.module.state_dict(keep_vars=True)
            load_tensors(self._sharded_from, tensors)
        elif self.pipe is None:
            self.module.load_state_dict(checkpoint["state_dict"], strict=strict)
        else:
            self.pipe.load_state_dict(checkpoint["state_dict"])
        return True

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._deferred is not None and self._sharded_from is None:
            self._deferred = (self._deferred[0], checkpoint["optimizer_states"])
            return
        if self._sharded_from is not None:  # read once the pipeline says which parameters are this rank's
            self._optimizers_from = self._sharded_from
            if self._planned:
                self._load_sharded_optimizers()
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
            shard_optimizer(optimizer, {})
            for param in [p for p in optimizer.state if p.numel() == 0]:
                del optimizer.state[param]  # another rank holds it

    def _load_sharded_optimizers(self) -> None:
        if self._optimizers_from is None or self.pipe is None:
            return
        held = [p for p in self.pipe.held if isinstance(p, nn.Parameter)]
        for i, optimizer in enumerate(self.optimizers):
            load_optimizer(self._optimizers_from, i, optimizer, held)
        self._optimizers_from = None

    # --- collectives ------------------------------------------------------------------------

    def reduce(self, tensor: Tensor | Any, group: Any | None, reduce_op: Any) -> Tensor | Any:
        """Over the data-parallel replicas of this rank's stage by default: every rank of a
        pipeline logs its last stage's values, so each stage's replicas reduce the same values
        the last stage's do, and no rank waits on a rank of another stage."""
        if isinstance(tensor, Tensor):
            return sync(tensor, group or self.device_mesh.get_group("dp"), reduce_op)
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool) -> bool:
        """Over every process: a decision to stop or to save is the whole job's."""
        count = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(count)
        return bool(count == self.world_size) if all else bool(count)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int) -> Any:
        if not dist.is_initialized():
            return obj
        box = [to_host(obj)]
        dist.broadcast_object_list(box, src)
        return to_device(box[0], self.root_device)

    def all_gather(self, tensor: Tensor, group: Any | None, sync_grads: bool) -> Tensor:
        return all_gather(tensor, group=group, sync_grads=sync_grads)

    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that stopped first in every rank's error (its peers otherwise see only
        gloo's "Connection closed by peer"), and end the processes this one launched (for any
        Trainer's strategy: a later Trainer in the same script launches none): one may be
        blocked on a rank that never answers. An error every rank raised together (they agreed
        on it: running out of memory, a re-plan that failed) ends each rank by itself."""
        if getattr(exception, _EVERY_RANK, False):
            return
        waited = self._waited_for(exception)
        if waited is not None and isinstance(exception, RuntimeError):  # as add_note would, on Python 3.10
            exception.args = (f"{waited}\n{exception}",)
        first = _first_failure(self.global_rank, exception)
        if first is not None and isinstance(exception, RuntimeError):
            exception.args = (f"{exception}\n{first}",)
        for launcher in _LAUNCHERS:
            launcher.kill(sigkill_signal())

    def _waited_for(self, exception: BaseException) -> str | None:
        """For a wait that timed out: this rank, the operation, and the ranks of its pipeline it
        waits on (its stages' neighbours: a schedule talks only to adjacent stages)."""
        text = str(exception)
        coordinate = self._mesh.get_coordinate() if self._mesh is not None else None
        if "timed out" not in text.lower() or coordinate is None or self._mesh is None:
            return None
        position, replica = coordinate
        ranks, replicas = self._mesh.size(0), self._mesh.size(1)
        where = placement(self._schedule, ranks, self._virtual)
        neighbours = {where[t] for s, p in enumerate(where) if p == position for t in (s - 1, s + 1)
                      if 0 <= t < len(where)} - {position}
        peers = [str(q * replicas + replica) for q in sorted(neighbours)]
        operation = re.search(r"for (\w+) operation", text)
        return (
            f"rank {self.global_rank} (pipeline rank {position} of {ranks}, replica {replica}) timed out after "
            f"{self.options.timeout} waiting{' in ' + operation.group(1) if operation else ''} on a rank of its "
            f"pipeline that never answered: rank {' or '.join(peers)}"
        )

    def teardown(self, lightning_teardown: Callable[[], None]) -> None:
        self._metering.close()
        if self.meter is not None:
            self.meter.close()
        strategy = self.strategy
        module = strategy.lightning_module
        if module is not None and self.pipe is not None and self.pipe.released and self._partial_state is None:
            warning = _PartialStateWarning(self.global_rank, self.pipe)
            self._partial_state = module.register_state_dict_post_hook(warning)  # type: ignore[no-untyped-call]
        if self._empty and module is not None:  # Lightning's module.cpu(), but what has no storage stays on meta
            module_apply(module, lambda t: t if t.is_meta else t.cpu())
        if module is not None and (self._empty or (self.pipe is not None and self.pipe.sharded)):
            set_lightning_module(strategy, None)  # (FSDP's shards stay where they are, as Lightning's FSDP leaves them)
        try:
            lightning_teardown()
        finally:
            set_lightning_module(strategy, module)


_LAUNCHERS: list[SubprocessScriptLauncher] = []  # every one this process made, with the processes it started
_FAILURE = "lightning_pipe/first_failure"
_START_UP = timedelta(minutes=5)  # the least global rank 0 waits for the ranks it launches to start


_EVERY_RANK = "lightning_pipe_every_rank"  # an exception's attribute: every rank raised it at once


def _every_rank(error: _E) -> _E:
    """``error``, raised by every rank at once: no rank need end the others (:meth:`DistributedEngine.on_exception`)."""
    setattr(error, _EVERY_RANK, True)
    return error


def _first_failure(rank: int, exception: BaseException) -> str | None:
    """The first failure another rank recorded in the process group's store, or ``None`` after
    recording this one. The store lives in global rank 0: without it, ``None``."""
    try:
        store = default_store()
        if store.check([_FAILURE]):
            return store.get(_FAILURE).decode()
        store.set(_FAILURE, f"rank {rank} stopped first, with {type(exception).__name__}: {exception}")
    except (RuntimeError, ValueError):  # no process group, or its store is gone
        pass
    return None


class _Probed(Exception):
    """Ends a user step at its ``self(...)`` once the arguments are known."""


def _before_step(module: LightningModule, optimizer: Optimizer, batch_idx: int) -> None:
    """Zero the gradients at the start of an accumulation window, as Lightning would."""
    trainer = module.trainer
    if batch_idx % trainer.accumulate_grad_batches == 0:
        call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
        call_module_hook(trainer, "on_before_zero_grad", optimizer)
        call_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer)


class _PartialStateWarning:
    """A ``state_dict`` hook of the user's module once a distributed fit has ended: this rank
    holds only its stages' tensors, the others are empty. Says so at the first read."""

    def __init__(self, rank: int, pipe: DistributedPipeline) -> None:
        self.rank, self.stages, self.warned = rank, pipe.stages, False

    def __call__(self, module: nn.Module, *args: Any) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"Rank {self.rank} holds only the tensors of its pipeline stages {self.stages} after "
                f"runtime='distributed' training: the module's other parameters and buffers are empty here. Read "
                f"the whole model from a checkpoint: trainer.save_checkpoint(path) gathers it on global rank 0.",
                stacklevel=2,
            )


class _ReplicaSync:
    """A ``Metric``'s ``dist_sync_fn``: its states gathered over the data-parallel replicas of
    this rank's stage, not the world (the ranks of other stages never sync it at that time).
    Copies of a metric (``Metric.clone``) share it: a process group cannot be copied."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, tensor: Tensor, group: Any | None = None) -> list[Tensor]:
        return gather_all_tensors(tensor, group or self.group)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_ReplicaSync":
        return self


@dataclass
class _MetricState:
    """A logged ``Metric`` as the last stage holds it after the step: its states (on the CPU),
    update count and step value, loaded into the same metric of the pipeline's other ranks."""

    path: str
    states: dict[str, Any]
    updates: int
    step_value: Any


@contextmanager
def _recording(module: LightningModule, logged: Logged) -> Iterator[None]:
    """Log as usual, and keep each call (a ``Metric`` as its state) to replay elsewhere."""
    log = module.log

    def recording(name: str, value: Any, **kwargs: Any) -> None:
        log(name, value, **kwargs)
        logged.append((name, value, kwargs))

    module.log = recording  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del module.log
    paths = {}  # the states once the hook has updated them all, of the metrics logged
    if any(isinstance(value, Metric) for _, value, _ in logged):
        paths = {id(m): name for name, m in module.named_modules() if isinstance(m, Metric)}
    for k, (name, value, kwargs) in enumerate(logged):
        if isinstance(value, Metric) and id(value) in paths:
            value = _MetricState(paths[id(value)], to_host(value.metric_state), value.update_count,
                                 to_host(step_value(value)))
        logged[k] = (name, to_host(value), kwargs)


def _replay(module: LightningModule, logged: Logged) -> None:
    device = module.device
    for name, value, kwargs in logged:
        if isinstance(value, _MetricState):
            metric = cast(Metric, module.get_submodule(value.path))
            for state, held in value.states.items():
                setattr(metric, state, to_device(held, device))
            set_update_count(metric, value.updates)
            forget_computed(metric)
            set_step_value(metric, to_device(value.step_value, device))
            value = metric
        module.log(name, to_device(value, device), **kwargs)


@contextmanager
def _on_meta(precision: Precision) -> Iterator[None]:
    with torch.device("meta"), precision.tensor_init_context():
        yield
