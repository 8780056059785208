"""What a user chose for :class:`~lightning_pipe.lightning.strategy.MemoryPipeStrategy`, checked
once: both engines read the same options, and a bad one is named before any device or process
work starts."""

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import UnionType
from typing import Literal, get_args

from lightning_pipe.lightning.microlog import LossReduction
from lightning_pipe.plan.partitioners import PARTITIONERS, Partitioner
from lightning_pipe.plan.plan import Plan
from lightning_pipe.plan.request import PlanSchedule, check_settings
from lightning_pipe.plan.schedule import (
    MULTI_STAGE,
    SCHEDULES,
    V_SHAPED,
    Schedule,
    check_schedule,
    stages_per_process,
    with_virtual_stages,
)
from lightning_pipe.units import MemorySize, parse_bytes

__all__ = ["DataParallel", "PipeOptions", "Runtime", "StateDictType", "check_balance_entries", "limits_per_stage"]

Runtime = Literal["local", "distributed"]
StateDictType = Literal["full", "sharded"]
DataParallel = Literal["ddp", "fsdp"]


@dataclass
class PipeOptions:
    """The strategy's arguments, checked and normalised (see its docstring for each)."""

    chunks: int = 4
    schedule: PlanSchedule = "gpipe"  # "auto": the distributed engine runs the plan's pick
    balance: list[int] | None = None
    leaf_modules: list[str] = field(default_factory=list)
    planner: Partitioner | None = "dawnpiper"
    memory_limit: list[int] | None = None  # bytes: one for every stage, or one per stage
    host_bandwidth: float | None = None
    link_bandwidth: float | None = None
    measure_memory: bool = False
    deferred_batch_norm: bool = False
    plan_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    loss_reduction: LossReduction = "mean"
    runtime: Runtime = "local"
    stages: int | None = None
    virtual_stages: int = 1  # stages per process, resolved (plan.schedule.stages_per_process; "auto": the pick's)
    timeout: timedelta = timedelta(minutes=30)
    state_dict_type: StateDictType = "full"
    max_replans: int = 3
    plan: Plan | None = None  # a saved plan to follow: no profiling, no planning
    data_parallel: DataParallel = "ddp"

    @classmethod
    def checked(
        cls,
        *,
        chunks: int,
        schedule: PlanSchedule,
        balance: list[int] | None,
        leaf_modules: list[str] | None,
        planner: Partitioner | None,
        memory_limit: MemorySize | list[MemorySize] | None,
        host_bandwidth: float | None,
        link_bandwidth: float | None,
        measure_memory: bool,
        deferred_batch_norm: bool,
        plan_shapes: dict[str, list[int]] | None,
        loss_reduction: LossReduction,
        runtime: Runtime,
        stages: int | None,
        virtual_stages: int | None,
        timeout: timedelta | None,
        state_dict_type: StateDictType,
        max_replans: int,
        plan: "str | os.PathLike[str] | None" = None,
        data_parallel: DataParallel = "ddp",
    ) -> "PipeOptions":
        """The options, each checked; a bad one raises an error naming it and the fix.

        Raises:
            TypeError: an argument of the wrong type.
            ValueError: a value out of range, or options that do not go together.
        """
        _check_types(chunks=(chunks, int), max_replans=(max_replans, int),
                     host_bandwidth=(host_bandwidth, float | None), link_bandwidth=(link_bandwidth, float | None),
                     measure_memory=(measure_memory, bool), deferred_batch_norm=(deferred_batch_norm, bool))
        check_settings(chunks, schedule, host_bandwidth, link_bandwidth, (*SCHEDULES, "auto"))
        if max_replans < 0:
            raise ValueError(f"max_replans must be >= 0 (0: never plan again after running out), got {max_replans}.")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(
                f"loss_reduction must be 'mean' (training_step returns a per-sample mean) or 'sum' "
                f"(a sum over the samples), got {loss_reduction!r}."
            )
        if planner is not None and planner not in PARTITIONERS:
            raise ValueError(f"planner must be one of {list(PARTITIONERS)} or None, got {planner!r}.")
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
        _check_data_parallel(data_parallel, runtime, schedule)  # (before 2bw's own check: named for FSDP)
        if schedule == "auto":
            _check_auto(runtime, virtual_stages, planner, balance, data_parallel)
        _check_runtime(runtime, stages, schedule, timeout, virtual_stages)
        # ("auto": one until the plan's pick, which the distributed engine runs)
        virtual_stages = 1 if schedule == "auto" else stages_per_process(schedule, virtual_stages)
        if data_parallel == "fsdp" and virtual_stages > 1:
            raise ValueError(
                f"data_parallel='fsdp' shards one stage per process; schedule={schedule!r} holds {virtual_stages} "
                f"stages per process, each its own FSDP root (a weight two of them read would be sharded apart). Use "
                f"schedule='gpipe' or '1f1b' with virtual_stages=1, or data_parallel='ddp'."
            )
        if balance is not None and len(balance) % virtual_stages:
            raise ValueError(
                f"balance has {len(balance)} stages, which virtual_stages={virtual_stages} (stages per process) does "
                f"not divide: give {virtual_stages} entries for each process."
            )
        # (stages None: at the first batch, once the processes are counted; "auto" weighs only what torch takes)
        if runtime == "distributed" and stages is not None and schedule != "auto":
            check_balance_entries(balance, stages, virtual_stages, schedule)
            check_schedule(schedule, chunks, stages * virtual_stages, virtual_stages, distributed=True)
        _check_state_dict_type(runtime, state_dict_type)
        # (a plan names "1f1b" with several stages per process by what it is: with_virtual_stages)
        running = schedule if schedule == "auto" else with_virtual_stages(schedule, virtual_stages)
        saved = _check_plan(plan, balance, running, chunks)
        return cls(
            chunks=chunks, schedule=schedule, balance=balance, leaf_modules=list(leaf_modules or []), planner=planner,
            memory_limit=parse_limits(memory_limit), host_bandwidth=host_bandwidth, link_bandwidth=link_bandwidth,
            measure_memory=measure_memory, deferred_batch_norm=deferred_batch_norm,
            plan_shapes={k: tuple(v) for k, v in (plan_shapes or {}).items()}, loss_reduction=loss_reduction,
            runtime=runtime, stages=stages, virtual_stages=virtual_stages, timeout=timeout or timedelta(minutes=30),
            state_dict_type=state_dict_type, max_replans=max_replans, plan=saved, data_parallel=data_parallel,
        )


def _check_plan(
    plan: "str | os.PathLike[str] | None", balance: list[int] | None, schedule: PlanSchedule, chunks: int
) -> Plan | None:
    """A saved plan to follow, read and checked against the settings it was made for."""
    if plan is None:
        return None
    saved = Plan.read(plan)
    if balance is not None:
        raise ValueError("give plan or balance, not both: a plan has its own split (plan.balance).")
    if (saved.schedule, saved.chunks) != (schedule, chunks):
        made = f"schedule={saved.schedule!r}, chunks={saved.chunks}" + (  # (a count other than the schedule's own)
            f", virtual_stages={saved.virtual_stages}" if saved.schedule in MULTI_STAGE
            and saved.virtual_stages != stages_per_process(saved.schedule, None) else "")
        raise ValueError(
            f"the plan was made for {made}, not schedule={schedule!r}, chunks={chunks}: pass {made} with it, or plan "
            f"again."
        )
    return saved


def parse_limits(limit: MemorySize | list[MemorySize] | None) -> list[int] | None:
    """A memory limit as bytes: one for every stage, or one per stage."""
    if limit is None:
        return None
    return [parse_bytes(v) for v in (limit if isinstance(limit, list) else [limit])]


def limits_per_stage(limits: list[int] | None, stages: int, what: str) -> list[int] | None:
    """``memory_limit`` (``limits``) with an entry per stage, ``None`` for none; ``what``: the
    ``stages`` as the error names them.

    Raises:
        ValueError: neither one entry nor one per stage.
    """
    if limits is None or len(limits) == 1:
        return None if limits is None else limits * stages
    if len(limits) != stages:
        raise ValueError(
            f"memory_limit has {len(limits)} entries but there are {stages} {what}; "
            f"give one value for all stages or one per stage."
        )
    return list(limits)


def check_balance_entries(balance: list[int] | None, processes: int, virtual_stages: int, schedule: Schedule) -> None:
    """A balance under ``runtime="distributed"`` needs one entry per stage: ``processes`` (a
    pipeline's) times ``virtual_stages``, placed on the processes by ``schedule``
    (:func:`~lightning_pipe.plan.schedule.placement`).

    Raises:
        ValueError: it has another number of entries.
    """
    stages = processes * virtual_stages
    if balance is not None and len(balance) != stages:
        where = (f"stages r and {stages - 1} - r on process r" if schedule in V_SHAPED
                 else f"stage s on process s % {processes}")
        raise ValueError(
            f"balance has {len(balance)} entries, but runtime='distributed' runs {stages} stages ({processes} "
            f"processes x virtual_stages={virtual_stages}; {where}). Give one node count per stage, in order."
        )


def _check_runtime(
    runtime: Runtime, stages: int | None, schedule: PlanSchedule, timeout: timedelta | None, virtual_stages: int | None
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
    if runtime == "local" and schedule in MULTI_STAGE:
        raise ValueError(
            f"schedule={schedule!r} runs only with runtime='distributed': it places several stages on each process, "
            f"on torch.distributed.pipelining. Pass runtime='distributed', or use 'gpipe', '1f1b' or '2bw' locally."
        )
    if virtual_stages is None:
        return
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive int (stages per process), got {virtual_stages!r}.")
    if schedule in V_SHAPED and virtual_stages != 2:
        raise ValueError(
            f"schedule={schedule!r} always holds 2 stages per process (a V: process r runs stages r and 2p - 1 - r), "
            f"got virtual_stages={virtual_stages}: leave virtual_stages unset, or use schedule='interleaved-1f1b' or "
            f"'interleaved-zb' for {virtual_stages} stages per process."
        )
    if virtual_stages > 1 and (runtime != "distributed" or schedule not in ("1f1b", *MULTI_STAGE)):
        raise ValueError(
            f"virtual_stages={virtual_stages} puts several stages on each process, which only runtime='distributed' "
            f"runs, under schedule='interleaved-1f1b' (or '1f1b', its alias then) or 'interleaved-zb': use those, "
            f"or leave virtual_stages unset."
        )


def _check_auto(
    runtime: Runtime, virtual_stages: int | None, planner: Partitioner | None, balance: list[int] | None,
    data_parallel: DataParallel,
) -> None:
    """``schedule="auto"``: the planner picks among the distributed engine's schedules, under
    which ``training_step`` runs once per micro-batch whichever it picks. The local engine's
    differ in what the user's code sees (GPipe runs it once on the whole batch, 2BW keeps two
    weight versions): a pick among them would change the training, not only its speed."""
    if runtime != "distributed":
        raise ValueError(
            "schedule='auto' picks among the schedules of runtime='distributed' (the planner weighs each by its "
            "simulated step). Pass runtime='distributed', or with runtime='local' name the schedule: 'gpipe' "
            "(training_step once per batch), '1f1b' (once per micro-batch, fewer activations held) or '2bw' (two "
            "weight versions, no flush); `lightning-pipe plan --schedule gpipe` and `--schedule 1f1b` show each plan."
        )
    if virtual_stages is not None:
        raise ValueError(f"schedule='auto' picks the stages per process itself, got virtual_stages={virtual_stages}: "
                         f"leave it unset, or name a schedule.")
    if planner is None or balance is not None:
        raise ValueError(
            f"schedule='auto' is the planner's pick, made with its split: it needs a planner and no balance (got "
            f"planner={planner!r}, balance={balance}). Leave planner='dawnpiper' and balance unset, or name a "
            f"schedule."
        )
    if data_parallel == "fsdp":
        raise ValueError(
            "data_parallel='fsdp' shards one stage per process, and schedule='auto' may pick several stages per "
            "process. Name the schedule ('gpipe' or '1f1b'), or use data_parallel='ddp'."
        )


def _check_state_dict_type(runtime: Runtime, state_dict_type: StateDictType) -> None:
    if state_dict_type not in ("full", "sharded"):
        raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")
    if state_dict_type == "sharded" and runtime != "distributed":
        raise ValueError(
            "state_dict_type='sharded' writes one shard per process: it needs runtime='distributed'. With "
            "runtime='local' one process holds every stage; leave state_dict_type='full'."
        )


def _check_data_parallel(data_parallel: DataParallel, runtime: Runtime, schedule: PlanSchedule) -> None:
    """How a stage's replicas share its work: a whole copy each (``"ddp"``), or shards (``"fsdp"``),
    which needs processes (the replicas) and one version of every weight."""
    if data_parallel not in ("ddp", "fsdp"):
        raise ValueError(
            f"data_parallel must be 'ddp' (each replica of a stage holds it whole) or 'fsdp' (the replicas shard it), "
            f"got {data_parallel!r}."
        )
    if data_parallel == "fsdp" and runtime != "distributed":
        raise ValueError(
            "data_parallel='fsdp' shards each stage over its data-parallel replicas, which are processes: it needs "
            "runtime='distributed' (with more devices than stages). With runtime='local' leave data_parallel='ddp'."
        )
    if data_parallel == "fsdp" and schedule == "2bw":
        raise ValueError(
            "schedule='2bw' keeps two versions of every weight, which data_parallel='fsdp' does not shard. Use "
            "schedule='1f1b' or 'gpipe' with data_parallel='fsdp', or data_parallel='ddp'."
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
