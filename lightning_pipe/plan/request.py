"""What a plan is asked for: the planning targets and the settings every entry point of
:mod:`lightning_pipe.plan.plan` takes besides the profile, in one value checked once."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_pipe.plan.partitioners import PARTITIONERS, Partitioner
from lightning_pipe.plan.schedule import (
    MULTI_STAGE,
    SCHEDULES,
    Schedule,
    check_schedule,
    stages_per_process,
    with_virtual_stages,
)
from lightning_pipe.plan.sharding import DATA_PARALLEL, DataParallel

__all__ = ["PlanRequest", "PlanSchedule", "check_settings"]

#: What a plan may be asked to run: a schedule, or ``"auto"``, the planner's pick
#: (:func:`~lightning_pipe.plan.auto.auto_plan`).
PlanSchedule = Literal[Schedule, "auto"]  # (one Literal: LightningCLI names its values)


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for besides the profile: a profile says what the model costs, a
    request what it is planned to fit and how it runs. The planner's entry points take one
    (``make_plan(profile, request)``); a caller trying other targets or settings makes another
    with :func:`dataclasses.replace`.

    ``capacities``: one planning target (bytes) per process (device), below the device's memory
    limit by the planning headroom (:data:`~lightning_pipe.plan.plan.PLANNING_HEADROOM`); a list
    is stored as a tuple. ``partitioner`` splits the nodes over the stages; ``schedule`` orders
    ``chunks`` micro-batches per step (``"auto"``: the planner picks it), each process holding
    ``virtual_stages`` stages (``None``: :func:`~lightning_pipe.plan.schedule.stages_per_process`;
    ``"1f1b"`` with more is ``"interleaved-1f1b"``); the multi-stage schedules run only as
    processes (``carry``). ``host_bandwidth`` (bytes/s) lets stages swap saved
    activations to the host (``None``: no swap); ``link_bandwidth`` (bytes/s between stage
    devices) prices the values crossing each cut (``None``: free). ``optimise_memory`` false:
    no stage recomputes or swaps. ``carry``: stages run as processes (``runtime="distributed"``)
    and pass on what later stages read, holding it for every micro-batch of a step, and reduce
    their gradients over ``replicas`` data-parallel copies: each a whole copy of its stage
    (``data_parallel="ddp"``), or the stage sharded over them by FSDP (``"fsdp"``,
    :mod:`~lightning_pipe.plan.sharding`).

    Raises:
        ValueError: a setting out of range, naming it and the fix.
    """

    capacities: Sequence[int]  # stored as a tuple
    partitioner: Partitioner = "dawnpiper"
    schedule: PlanSchedule = "1f1b"
    chunks: int = 1
    host_bandwidth: float | None = None
    link_bandwidth: float | None = None
    optimise_memory: bool = True
    carry: bool = False
    replicas: int = 1
    virtual_stages: int | None = None
    data_parallel: DataParallel = "ddp"

    @property
    def virtual(self) -> int:
        """Stages per process (``virtual_stages`` or the schedule's default)."""
        return 1 if self.schedule == "auto" else stages_per_process(self.schedule, self.virtual_stages)

    @property
    def stage_count(self) -> int:
        return len(self.capacities) * self.virtual

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacities", tuple(self.capacities))  # frozen: hashable, not shared
        if not self.capacities:
            raise ValueError("capacities is empty: give one planning target (bytes) per stage.")
        bad = [c for c in self.capacities if c <= 0]
        if bad:
            raise ValueError(
                f"capacities {list(self.capacities)} has a planning target of {bad[0]} bytes; every stage's target "
                f"must be positive: give each stage's device memory (bytes) times PLANNING_HEADROOM."
            )
        if self.partitioner not in PARTITIONERS:
            raise ValueError(
                f"partitioner must be one of {', '.join(map(repr, PARTITIONERS))}, got {self.partitioner!r}."
            )
        check_settings(self.chunks, self.schedule, self.host_bandwidth, self.link_bandwidth, (*SCHEDULES, "auto"))
        if self.schedule == "auto":
            if self.virtual_stages is not None:
                raise ValueError(f"schedule='auto' picks the virtual stages itself, got virtual_stages="
                                 f"{self.virtual_stages}: leave it out, or give a schedule.")
        else:
            object.__setattr__(self, "schedule", with_virtual_stages(self.schedule, self.virtual))
            check_schedule(self.schedule, self.chunks, self.stage_count, self.virtual)
        if self.schedule in MULTI_STAGE and not self.carry:
            raise ValueError(
                f"schedule {self.schedule!r} runs only on the distributed engine, one process per device holding "
                f"{self.virtual} stages: plan it with carry=True (runtime='distributed'), or use 'gpipe', '1f1b' "
                f"or '2bw' in one process."
            )
        if self.replicas < 1:
            raise ValueError(
                f"replicas must be >= 1, got {self.replicas}: give the number of data-parallel copies of the "
                f"pipeline (1 for none)."
            )
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {', '.join(map(repr, DATA_PARALLEL))}, got "
                             f"{self.data_parallel!r}.")
        if self.data_parallel == "fsdp" and self.replicas == 1:
            raise ValueError("data_parallel='fsdp' with replicas=1 has nothing to shard over: give replicas >= 2 "
                             "(the data-parallel copies of each stage), or data_parallel='ddp'.")
        if self.data_parallel == "fsdp" and self.schedule == "2bw":
            raise ValueError("data_parallel='fsdp' cannot keep PipeDream-2BW's two weight versions sharded: use "
                             "schedule '1f1b' or 'gpipe' with FSDP, or data_parallel='ddp' with '2bw'.")
        if self.data_parallel == "fsdp" and self.schedule != "auto" and self.virtual > 1:
            raise ValueError(f"data_parallel='fsdp' shards one stage per process; schedule {self.schedule!r} holds "
                             f"{self.virtual}: use 'gpipe' or '1f1b' with FSDP, or data_parallel='ddp'.")


def check_settings(
    chunks: int, schedule: str, host_bandwidth: float | None, link_bandwidth: float | None,
    schedules: Sequence[str] = SCHEDULES,
) -> None:
    """The settings a plan and the strategy's options both take, checked alike; ``schedules``:
    the schedule names the caller takes.

    Raises:
        ValueError: one out of range, naming it and the fix.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}: give the number of micro-batches per batch.")
    if schedule not in schedules:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, schedules))}, got {schedule!r}.")
    if host_bandwidth is not None and host_bandwidth <= 0:
        raise ValueError(
            f"host_bandwidth must be positive (bytes per second), got {host_bandwidth}; give None to plan without "
            f"swapping."
        )
    if link_bandwidth is not None and link_bandwidth <= 0:
        raise ValueError(
            f"link_bandwidth must be positive (bytes per second), got {link_bandwidth}; give None to leave sends "
            f"between stages unpriced."
        )
