"""Side-by-side benchmark of the planners, by real execution, in one run.

    python -m benchmarks.run --quick     # 4 stages; about 10 minutes on a 2-core CPU (610 s last time)
    python -m benchmarks.run --full
    python -m benchmarks.run --quick --update-docs   # also rewrite the tracked page

Writes ``results.json`` and ``benchmarks.md`` to a folder of its own (``--out``, by default
``benchmark-results/<UTC time>-<commit>/``) and prints its path; only ``--update-docs`` also
rewrites the tracked ``benchmarks/results.json`` and ``docs/benchmarks.md`` (sections of that
page this run does not make, such as the fault injection's, are kept). Every number in the
markdown comes from this run, and its first lines name the commit and the machine. Memory is
the strategy's metered per-stage bytes (all stages share the CPU, so device statistics cannot
tell them apart); capacities are enforced by the meter.
"""

import argparse
import contextlib
import datetime
import functools
import io
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from benchmarks.models import Bench, suite
from benchmarks.peers import (
    ProcessMeter,
    SequentialModule,
    pipelining_steps,
    sequential_data,
    torchgpipe_steps,
)
from examples.models import loader
from lightning_pipe.lightning.strategy import MemoryPipeStrategy
from lightning_pipe.measure.meter import StageOutOfMemoryError
from lightning_pipe.plan.headroom import checked, checked_largest_plan
from lightning_pipe.plan.partitioners import BASELINES, PARTITIONERS
from lightning_pipe.plan.plan import PLANNING_HEADROOM, InfeasiblePlanError, make_plan
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanRequest

ROOT = Path(__file__).resolve().parent.parent
CHUNKS = 4
REFERENCE_MICROBATCH = 8
STEPS = 2  # step 1 has no gradients or optimizer state during its forward: step 2 is the steady peak
CAPACITY_SHARE = 0.6  # per-stage capacity: this share of the unplanned even split's max peak


@dataclass
class Settings:
    """What one run measures: quick runs every model over 4 stages, full over 4 and 8."""

    memory_runs: list[tuple[str, int]]  # (model, stage count)
    schedules_on: list[str]
    schedules_off: list[str]
    max_probes: int
    timed_steps: int
    warmup_steps: int = 3


MODELS = ("bert", "gpt", "t5", "unet")
QUICK = Settings([(m, 4) for m in MODELS], ["gpipe", "1f1b"], ["gpipe", "1f1b"], 6, 8)
FULL = Settings([(m, s) for m in MODELS for s in (4, 8)], ["gpipe", "1f1b"], ["gpipe", "1f1b"], 8, 20)
# Both modes. The cost model follows a stage node by node, so planning grows faster than
# linearly with the nodes per stage: 20,000 nodes over 4 stages takes minutes.


# --- running one fit ----------------------------------------------------------------------


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Hide Lightning's and the planner's per-fit output: a run makes hundreds of fits."""
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        yield


class StepTimer(Callback):
    """Wall time of each training step, and the strategy's summed stage compute time."""

    def __init__(self) -> None:
        self.step_ms: list[float] = []
        self.stage_ms: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.step_ms.append((time.perf_counter() - self._start) * 1e3)
        clock = getattr(trainer.strategy, "clock", None)
        if clock is not None:
            self.stage_ms.append(sum(clock.forward_ms) + sum(clock.backward_ms))


def fit(model: LightningModule, data: Any, batch: int, strategy: Any, devices: int, steps: int = 1,
        callbacks: Sequence[Callback] = ()) -> StepTimer:
    """Train ``steps`` batches of ``batch`` samples; returns the step timings."""
    timer = StepTimer()
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, callbacks=[timer, *callbacks],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with quiet():
        trainer.fit(model, loader(data, batch))
    return timer


def sample_profile(bench: Bench, microbatch: int) -> Profile:
    """The profile the strategy plans from, at one micro-batch, with memory to spare: the
    partitioners' input for runs without memory optimisation, and the base for predictions at
    other sizes. The strategy's, not a bare ``profile_graph``: it also measures the training
    batch and the loss, which the last stage holds."""
    strategy = MemoryPipeStrategy(chunks=CHUNKS, planner="uniform")
    fit(bench.model(), bench.data(microbatch * CHUNKS), microbatch * CHUNKS, strategy, 1)
    assert strategy.profile is not None
    return strategy.profile


# --- memory efficiency: the largest micro-batch that really trains --------------------------


@dataclass
class Probe:
    """One real run at a micro-batch size: whether it fitted, and predicted vs metered peaks."""

    microbatch: int
    fits: bool
    error: str = ""
    predicted: list[int] = field(default_factory=list)
    metered: list[int] = field(default_factory=list)


@dataclass
class Config:
    """One row of the memory table."""

    model: str
    stages: int
    planner: str
    schedule: str
    memopt: bool
    capacity: int
    max_microbatch: int = 0
    exact: bool = False
    predicted_max: int | None = None
    probes: list[Probe] = field(default_factory=list)

    @property
    def limited_by(self) -> str:
        """Why the next size up did not fit: the planner refused, or the run went over."""
        above = [p for p in self.probes if not p.fits and p.microbatch > self.max_microbatch]
        return min(above, key=lambda p: p.microbatch).error if above else ""


def run_probe(bench: Bench, config: Config, microbatch: int, profile_at: Callable[[int], Profile]) -> Probe:
    """One training step at ``microbatch``; out of memory or no feasible plan = does not fit.
    ``profile_at``: the strategy's profile at a micro-batch size (memopt off plans from it as
    the strategy would, from a profile at the size it trains, not one scaled to it)."""
    try:
        if config.memopt:
            strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=config.schedule, planner=config.planner,
                                          memory_limit=config.capacity, measure_memory=True)
        else:  # the planner's split with every activation kept, planned and checked as the strategy plans
            profile = profile_at(microbatch)
            plan = checked(lambda t: make_plan(profile, PlanRequest(t, config.planner, config.schedule, CHUNKS,
                                                                    optimise_memory=False)),
                           limits(config), bench.check)
            strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=config.schedule, planner=None,
                                          balance=plan.balance, memory_limit=config.capacity, measure_memory=True)
        fit(bench.model(), bench.data(microbatch * CHUNKS * STEPS), microbatch * CHUNKS, strategy, config.stages, STEPS)
    except (StageOutOfMemoryError, InfeasiblePlanError) as error:
        return Probe(microbatch, False, type(error).__name__)
    predicted = [s.peak.total for s in (strategy.plan if config.memopt else plan).stages]
    return Probe(microbatch, True, "", predicted, strategy.meter.peaks())


def limits(config: Config) -> list[int]:
    """Per-stage memory limits: the capacity."""
    return [config.capacity] * config.stages


def search(fits: Callable[[int], bool], guess: int, limit: int) -> tuple[int, bool]:
    """Largest ``n >= 1`` with ``fits(n)`` (0 if none), in at most ``limit`` probes: from
    ``guess``, steps doubling up or down until the answer is bracketed, then bisection.
    The flag says whether the answer is bracketed exactly (``n`` fits, ``n + 1`` does not)."""
    known: dict[int, bool] = {}
    lo, hi, step = 0, None, 1
    n = max(1, guess)
    while len(known) < limit:
        known[n] = fits(n)
        lo, hi = (n, hi) if known[n] else (lo, n)
        if hi is None:
            n = lo + step
        elif lo == 0 and hi > 1:
            n = max(1, hi - step)
        elif hi - lo > 1:
            n = (lo + hi) // 2
        else:
            break
        step *= 2
    return lo, hi is not None and hi - lo == 1


def memory_config(
    bench: Bench, config: Config, profile_at: Callable[[int], Profile], guess: int, limit: int
) -> Config:
    """Fill ``config`` with its largest trainable micro-batch and every probe's peaks."""

    def fits(microbatch: int) -> bool:
        config.probes.append(run_probe(bench, config, microbatch, profile_at))
        return config.probes[-1].fits

    config.max_microbatch, config.exact = search(fits, guess, limit)
    return config


def predicted_max(bench: Bench, profile: Profile, config: Config) -> int | None:
    """The planner's own prediction of the largest micro-batch, each plan checked by a fake
    training step as the strategy checks its own (``None``: not even one)."""
    try:
        request = PlanRequest(limits(config), config.planner, config.schedule, CHUNKS,
                              optimise_memory=config.memopt)
        return checked_largest_plan(profile, request, bench.check).microbatch_size
    except InfeasiblePlanError:
        return None


def reference_capacity(bench: Bench, stages: int) -> int:
    """Per-stage capacity: a share of the max metered stage peak of the unplanned even split
    at the reference micro-batch, so memory binds for every planner."""
    strategy = MemoryPipeStrategy(chunks=CHUNKS, planner=None, measure_memory=True)
    batch = REFERENCE_MICROBATCH * CHUNKS
    fit(bench.model(), bench.data(batch * STEPS), batch, strategy, stages, STEPS)
    return int(CAPACITY_SHARE * max(strategy.meter.peaks()))


def memory_benchmark(benches: dict[str, Bench], settings: Settings, profiles: dict[str, Profile]) -> list[Config]:
    """Every planner x schedule x memory optimisation on/off, per model and stage count."""
    configs: list[Config] = []
    variants = [(s, True) for s in settings.schedules_on] + [(s, False) for s in settings.schedules_off]
    for name, stages in settings.memory_runs:
        bench = benches[name]
        capacity = reference_capacity(bench, stages)
        profile_at = functools.cache(functools.partial(sample_profile, bench))
        for schedule, memopt in variants:
            for planner in PARTITIONERS:
                config = Config(name, stages, planner, schedule, memopt, capacity)
                config.predicted_max = predicted_max(bench, profiles[name], config)
                guess = config.predicted_max or 1
                configs.append(memory_config(bench, config, profile_at, guess, settings.max_probes))
                print(f"  {name} x{stages} {schedule:<5} {planner:<9} memopt={'on ' if memopt else 'off'} "
                      f"max micro-batch {config.max_microbatch}{'' if config.exact else '+'} "
                      f"({len(config.probes)} runs)", flush=True)
    return configs


def accuracy(configs: list[Config]) -> list[dict[str, Any]]:
    """Predicted vs metered per-stage peaks over every run that fitted, all planners together
    (they share one cost model), per model x stages x schedule x memopt. Under-prediction is
    what turns into out-of-memory."""
    rows = []
    for key in dict.fromkeys((c.model, c.stages, c.schedule, c.memopt) for c in configs):
        pairs = [(p, m) for c in configs if (c.model, c.stages, c.schedule, c.memopt) == key
                 for probe in c.probes if probe.fits for p, m in zip(probe.predicted, probe.metered)]
        if pairs:
            errors = [(p - m) / m for p, m in pairs]
            rows.append({"model": key[0], "stages": key[1], "schedule": key[2], "memopt": key[3],
                         "stage_runs": len(pairs), "max_rel_error": max(map(abs, errors)),
                         "mean_rel_error": statistics.fmean(map(abs, errors)),
                         "max_over": max(0.0, max(errors)), "max_under": max(0.0, -min(errors))})
    return rows


def capacity_use(config: Config) -> float | None:
    """The fullest stage's metered peak over the capacity, at the largest micro-batch that trained."""
    fitted = [p for p in config.probes if p.fits and p.microbatch == config.max_microbatch]
    return max(fitted[0].metered) / config.capacity if fitted else None


def planned_oom(configs: list[Config]) -> list[str]:
    """Runs of a plan the planner accepted (every run: a refused plan does not run) that
    still went over a stage's capacity."""
    return [f"{c.model} x{c.stages} {c.schedule} {c.planner} memopt {'on' if c.memopt else 'off'} "
            f"micro-batch {p.microbatch}"
            for c in configs for p in c.probes if p.error == "StageOutOfMemoryError"]


def ratios(configs: list[Config]) -> list[dict[str, Any]]:
    """Headline: dawnpiper's largest micro-batch over every baseline's."""
    rows = []
    for c in configs:
        if c.planner != "dawnpiper":
            continue
        peers = {p.planner: p.max_microbatch for p in configs
                 if (p.model, p.stages, p.schedule, p.memopt) == (c.model, c.stages, c.schedule, c.memopt)}
        rows.append({"model": c.model, "stages": c.stages, "schedule": c.schedule, "memopt": c.memopt,
                     "dawnpiper": c.max_microbatch,
                     **{f"vs_{name}": c.max_microbatch / peers[name] if peers.get(name) else None
                        for name in BASELINES}})
    return rows


# --- simulated step time at equal batch -----------------------------------------------------


def simulated(profiles: dict[str, Profile], configs: list[Config]) -> list[dict[str, Any]]:
    """Each planner's plan at the largest micro-batch every memory-optimised planner trained,
    priced by the simulator (not measured)."""
    rows = []
    groups = {(c.model, c.stages, c.schedule, c.capacity) for c in configs if c.memopt}
    for name, stages, schedule, capacity in sorted(groups):
        key = (name, stages, schedule)
        sizes = [c.max_microbatch for c in configs if c.memopt and (c.model, c.stages, c.schedule) == key]
        microbatch = max(1, min(sizes))
        capacities = [capacity] * stages
        for planner in PARTITIONERS:
            row = {"model": name, "stages": stages, "schedule": schedule, "microbatch": microbatch, "planner": planner}
            try:
                plan = make_plan(profiles[name].scaled(microbatch), PlanRequest(capacities, planner, schedule, CHUNKS))
                row.update(step_ms=plan.step_ms, bubble=plan.bubble)
            except InfeasiblePlanError:
                row.update(step_ms=None, bubble=None)
            rows.append(row)
    return rows


# --- runtime overhead -----------------------------------------------------------------------


def median_after(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:])


def overhead(bench: Bench, settings: Settings, batch: int = 32) -> dict[str, Any]:
    """Step time of plain Lightning vs a 1-stage pipeline on the same model and batch, and a
    4-stage pipeline's step time vs the sum of its stages' compute times."""
    steps = settings.warmup_steps + settings.timed_steps
    plain = fit(bench.model(), bench.data(batch * steps), batch, "auto", 1, steps)
    one = fit(bench.model(), bench.data(batch * steps), batch, MemoryPipeStrategy(chunks=1, planner=None), 1, steps)
    four = fit(
        bench.model(), bench.data(batch * steps), batch, MemoryPipeStrategy(chunks=CHUNKS, planner=None), 4, steps
    )
    w = settings.warmup_steps
    return {
        "model": bench.name, "batch": batch, "timed_steps": settings.timed_steps,
        "plain_ms": median_after(plain.step_ms, w), "pipe1_ms": median_after(one.step_ms, w),
        "pipe4_ms": median_after(four.step_ms, w), "pipe4_stage_sum_ms": median_after(four.stage_ms, w),
    }


# --- peers ----------------------------------------------------------------------------------


def ours_process_peak(batch: int) -> int:
    """Our whole process's peak bytes during the last of ``STEPS`` steps, on the peers' meter."""
    meter = ProcessMeter()
    module = SequentialModule()
    meter.own(0, module.parameters())

    class LastStep(Callback):
        def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, index: int) -> None:
            if index == STEPS - 1:
                meter.reset_peaks()

    with meter:
        fit(module, sequential_data(batch * STEPS), batch, MemoryPipeStrategy(chunks=CHUNKS, planner="time"), 4,
            STEPS, [LastStep()])
    return meter.peak


def peers(settings: Settings, batch: int = 64, stages: int = 4) -> dict[str, Any]:
    """Our strategy (planner 'time', gpipe), torchgpipe (its own balance_by_time) and
    torch.distributed.pipelining (our split, one gloo process per stage) on one nn.Sequential."""
    steps, w = settings.warmup_steps + settings.timed_steps, settings.warmup_steps
    strategy = MemoryPipeStrategy(chunks=CHUNKS, planner="time")
    ours = fit(SequentialModule(), sequential_data(batch * steps), batch, strategy, stages, steps)
    metered = MemoryPipeStrategy(chunks=CHUNKS, planner="time", measure_memory=True)
    fit(SequentialModule(), sequential_data(batch * STEPS), batch, metered, stages, STEPS)
    balance = strategy.plan.balance
    pipelining = pipelining_steps(balance, batch, CHUNKS, steps, w)
    result: dict[str, Any] = {
        "batch": batch, "chunks": CHUNKS, "stages": stages, "torch": torch.__version__,
        "ours_ms": median_after(ours.step_ms, w), "ours_balance": balance,
        "ours_peaks": metered.meter.peaks(), "ours_process_peak": ours_process_peak(batch),
        "pipelining_ms": median_after(pipelining["step_ms"], w), "pipelining_peaks": pipelining["peaks"],
        "pipelining_threads": pipelining["threads"],
    }
    try:
        import torchgpipe
    except ImportError:
        result["torchgpipe"] = "skipped: not installed (pip install torchgpipe==0.0.7)"
        return result
    theirs = torchgpipe_steps(batch, CHUNKS, stages, steps, w)
    result.update(
        torchgpipe=f"measured, version {torchgpipe.__version__}", torchgpipe_ms=median_after(theirs["step_ms"], w),
        torchgpipe_balance=theirs["balance"], torchgpipe_process_peak=theirs["process_peak"],
    )
    return result


# --- output ---------------------------------------------------------------------------------


def commit(root: Path = ROOT) -> str:
    """``git rev-parse --short HEAD``, with ``-dirty`` where the work tree has changes; ``unknown``
    without git or outside a repository."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if status.strip() else head or "unknown"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    return {
        "commit": commit(), "cpu": cpu_model(),
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "lightning": lightning.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def provenance(m: dict[str, Any]) -> str:
    """Which commit and machine made the numbers."""
    return (f"Commit {m.get('commit', 'unknown')}; machine: {m.get('cpu', m['processor'])}, {m['cpu_count']} CPUs, "
            f"{m['platform']}; Python {m['python']}, torch {m['torch']}, lightning {m['lightning']}.")


def table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


def _cell(value: Any) -> str:
    if value is None:
        return "–"  # noqa: RUF001 (an en dash marks an empty cell)
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def markdown(results: dict[str, Any]) -> str:
    """The generated docs page: every number comes from ``results``."""
    m = results["machine"]
    configs = [Config(**{**c, "probes": [Probe(**p) for p in c["probes"]]}) for c in results["memory"]]
    parts = [
        "# Benchmarks",
        f"Generated by `python -m benchmarks.run --{results['mode']}` on {m['date']} (do not edit by hand; "
        f"took {results['seconds']:.0f} s). {provenance(m)}",
        "## Largest trainable micro-batch (real execution)",
        f"{CHUNKS} micro-batches per batch. Each configuration trains {STEPS} steps per probe (the first step's "
        f"forward runs before any gradient or optimizer state exists) under a per-stage "
        f"capacity of {CAPACITY_SHARE:.0%} of the largest metered stage peak of the unplanned even split at "
        f"micro-batch {REFERENCE_MICROBATCH}; a run that raises `StageOutOfMemoryError` or `InfeasiblePlanError` "
        f"does not fit. Plans are made as the strategy makes them: to the capacity, and where a stage is "
        f"predicted above {PLANNING_HEADROOM:.0%} of it, checked by a training step on fake tensors and, if that goes "
        f"over, made again below the capacity by the error it measured. *memopt off*: the partitioner's split "
        f"planned with every activation kept (`PlanRequest(..., optimise_memory=False)`), from the strategy's "
        f"profile at that micro-batch, checked the same way. `+`: the probe cap "
        f"({results['settings']['max_probes']}) was reached before the answer was bracketed. "
        f"*predicted*: the planner's own largest micro-batch, from the profile at micro-batch "
        f"{REFERENCE_MICROBATCH} scaled (`Profile.scaled`), its plans checked on fake tensors "
        f"(`checked_largest_plan`, as `lightning-pipe plan` reports it). *capacity use*: the fullest stage's "
        f"metered peak over the capacity at the max micro-batch. *next size up*: what stopped the smallest size "
        f"that did not fit (`InfeasiblePlanError`: the planner refused it; `StageOutOfMemoryError`: the run went "
        f"over).",
        table(["model", "stages", "schedule", "memopt", "capacity", "planner", "max micro-batch", "predicted",
               "capacity use", "next size up", "runs"],
              [[c.model, c.stages, c.schedule, "on" if c.memopt else "off", _mib(c.capacity), c.planner,
                f"{c.max_microbatch}{'' if c.exact else '+'}", c.predicted_max,
                None if (u := capacity_use(c)) is None else f"{u:.0%}", c.limited_by or None, len(c.probes)]
               for c in configs]),
        _fill_section(configs),
        "### Ratios: dawnpiper over every baseline",
        "dawnpiper's max micro-batch over each baseline's, per row group.",
        table(["model", "stages", "schedule", "memopt", "dawnpiper", *(f"÷ {b}" for b in BASELINES)],
              [[r["model"], r["stages"], r["schedule"], "on" if r["memopt"] else "off", r["dawnpiper"],
                *(r[f"vs_{b}"] for b in BASELINES)] for r in results["ratios"]]),
        "## Prediction accuracy of per-stage peaks",
        "Predicted peak (`plan.stages[s].peak.total` of the plan that ran; memopt off: the plan made with every "
        "activation kept) against the metered peak, over every stage of every run that fitted, all planners "
        "together (they share one cost model; per-run values are in the `results.json` written with it). Error = "
        "(predicted - metered) / metered; *worst under*: the largest under-prediction, the error that ends in "
        "out-of-memory.",
        table(["model", "stages", "schedule", "memopt", "stage runs", "max abs. error", "mean abs. error",
               "worst over", "worst under"],
              [[r["model"], r["stages"], r["schedule"], "on" if r["memopt"] else "off", r["stage_runs"],
                f"{r['max_rel_error']:.1%}", f"{r['mean_rel_error']:.1%}", f"{r['max_over']:.1%}",
                f"{r['max_under']:.1%}"]
               for r in results["accuracy"]]),
        "## Simulated step time at equal batch (simulated, not measured)",
        "`plan.step_ms` and `plan.bubble` from the planner's event simulation, at the largest micro-batch every "
        "memory-optimised planner trained for that model and schedule, planned offline from this run's own profile "
        "of one micro-batch (profiled times vary between runs, so a time-driven balance can differ from the one "
        "the real run used). – : no feasible plan from that profile.",  # noqa: RUF001 (the empty-cell mark)
        table(["model", "stages", "schedule", "micro-batch", "planner", "simulated step ms", "simulated bubble"],
              [[r["model"], r["stages"], r["schedule"], r["microbatch"], r["planner"], r["step_ms"],
                None if r["bubble"] is None else f"{r['bubble']:.1%}"] for r in results["simulated"]]),
        _overhead_section(results["overhead"]),
        _peer_section(results["peers"]),
    ]
    return "\n\n".join(parts) + "\n"


def _fill_section(configs: list[Config]) -> str:
    uses = sorted(u for c in configs if c.planner == "dawnpiper" and (u := capacity_use(c)) is not None)
    oom = planned_oom(configs)
    return "\n\n".join([
        "### Capacity use and planned runs that ran out of memory",
        f"dawnpiper's capacity use at its max micro-batch over {len(uses)} rows: median "
        f"{statistics.median(uses):.0%}, lowest {uses[0]:.0%}, {sum(u >= 0.9 for u in uses)} rows at 90% or more. "
        f"Runs of an accepted plan (every run: a refused plan does not run) that raised "
        f"`StageOutOfMemoryError`: {len(oom)}{': ' + '; '.join(oom) if oom else ''}.",
    ])


def _overhead_section(o: dict[str, Any]) -> str:
    return "\n\n".join([
        "## Runtime overhead (measured)",
        f"Model `{o['model']}`, batch {o['batch']}, median of {o['timed_steps']} steps after warm-up.",
        table(["run", "step ms", "vs plain"], [
            ["plain Lightning (strategy='auto')", o["plain_ms"], 1.0],
            ["1-stage pipeline (chunks=1, planner=None)", o["pipe1_ms"], o["pipe1_ms"] / o["plain_ms"]],
            [f"4-stage pipeline (gpipe, chunks={CHUNKS})", o["pipe4_ms"], o["pipe4_ms"] / o["plain_ms"]],
            [
                "  sum of its stages' forward + backward", o["pipe4_stage_sum_ms"],
                o["pipe4_stage_sum_ms"] / o["plain_ms"],
            ],
        ]),
        f"The 4-stage step takes {o['pipe4_ms'] / o['pipe4_stage_sum_ms']:.2f} x the sum of its stage compute times "
        f"(one process runs every stage in turn, so the sum is the floor; the rest is the pipeline's own work). "
        f"Its stages compute on micro-batches of {o['batch'] // CHUNKS}, which on a CPU is slower per sample than "
        f"the whole batch.",
    ])


def _peer_section(p: dict[str, Any]) -> str:
    rows = [["lightning_pipe (planner='time', gpipe), one process", p["ours_ms"], p["ours_balance"],
             ", ".join(_mib(n) for n in p["ours_peaks"]), _mib(p["ours_process_peak"])],
            [f"torch.distributed.pipelining {p['torch']} (ScheduleGPipe, gloo, a process per stage)",
             p["pipelining_ms"], p["ours_balance"], ", ".join(_mib(n) for n in p["pipelining_peaks"]),
             f"{_mib(sum(p['pipelining_peaks']))} (sum over its processes)"]]
    if "torchgpipe_ms" in p:
        rows.append(["torchgpipe (its balance_by_time, checkpoint='never'), one process", p["torchgpipe_ms"],
                     p["torchgpipe_balance"], "not separable", _mib(p["torchgpipe_process_peak"])])
    return "\n\n".join([
        "## Peers (measured)",
        f"nn.Sequential of 16 Linear(256)+ReLU and a head, SGD, batch {p['batch']}, {p['chunks']} micro-batches over "
        f"{p['stages']} CPU stages; median step time. torch.distributed.pipelining gets our planner's split.",
        table(["system", "step ms", "split (layers per stage)", "peak per stage", "peak of the process"], rows),
        "- Peaks are live tensor bytes observed by our meter's dispatch mode, never a formula: per stage from "
        "`measure_memory=True` for lightning_pipe, per rank process for torch.distributed.pipelining (its receive "
        "buffers included), and for the whole process where stages share one (torchgpipe's partitions share one "
        "allocator and thread, so they cannot be told apart; its worker threads are metered too).",
        f"- torch.distributed.pipelining runs {p['stages']} processes on this machine's cores, "
        f"{p['pipelining_threads']} intra-op thread(s) each, and exchanges activations over gloo; its step time is "
        "the slowest rank's. Its static shapes need the batch to divide evenly into micro-batches.",
        f"- torchgpipe: {p['torchgpipe']}",
    ])


def summary(results: dict[str, Any]) -> str:
    lines = ["", "Headline: dawnpiper's largest trainable micro-batch over time's and params'"]
    for r in results["ratios"]:
        lines.append(f"  {r['model']:<5} x{r['stages']} {r['schedule']:<5} memopt={'on ' if r['memopt'] else 'off'} "
                     f"dawnpiper {r['dawnpiper']:>3}  "
                     + "  ".join(f"/ {b} {_cell(r[f'vs_{b}'])}" for b in BASELINES))
    for r in results["accuracy"]:
        lines.append(f"  peak prediction {r['model']:<5} x{r['stages']} {r['schedule']:<5} "
                     f"memopt={'on ' if r['memopt'] else 'off'} max {r['max_rel_error']:.1%} "
                     f"mean {r['mean_rel_error']:.1%} over {r['max_over']:.1%} under {r['max_under']:.1%} "
                     f"({r['stage_runs']} stage runs)")
    o = results["overhead"]
    lines.append(f"  overhead: plain {o['plain_ms']:.1f} ms, 1-stage pipe {o['pipe1_ms']:.1f} ms, "
                 f"4-stage {o['pipe4_ms']:.1f} ms vs stage sum {o['pipe4_stage_sum_ms']:.1f} ms "
                 f"(x{o['pipe4_ms'] / o['pipe4_stage_sum_ms']:.2f})")
    p = results["peers"]
    theirs = f"{p['torchgpipe_ms']:.1f} ms" if "torchgpipe_ms" in p else p["torchgpipe"]
    lines.append(f"  peers (sequential, 4 stages): lightning_pipe {p['ours_ms']:.1f} ms, torchgpipe {theirs}, "
                 f"torch.distributed.pipelining {p['pipelining_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="every model over 4 stages, about 10 minutes on 2 CPU cores (default)")
    mode.add_argument("--full", action="store_true", help="every model over 4 and 8 stages")
    parser.add_argument("--out", type=Path, help="folder for results.json and benchmarks.md (default: "
                                                  "benchmark-results/<UTC time>-<commit>/)")
    parser.add_argument("--update-docs", action="store_true",
                        help="also rewrite the tracked docs/benchmarks.md and benchmarks/results.json")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results = measure(full=args.full)
    print(summary(results))
    written = write(results, args.out, update_docs=args.update_docs)
    print(f"wrote {' and '.join(map(str, written))} in {results['seconds']:.0f} s")
    return results


def measure(full: bool = False) -> dict[str, Any]:
    """Every benchmark of a quick (or ``full``) run: the results ``markdown`` renders."""
    settings = FULL if full else QUICK
    start = time.perf_counter()
    benches = suite(full=full)
    print("memory efficiency (real runs):", flush=True)
    profiles = {name: sample_profile(benches[name], REFERENCE_MICROBATCH) for name, _ in settings.memory_runs}
    configs = memory_benchmark(benches, settings, profiles)
    results: dict[str, Any] = {
        "mode": "full" if full else "quick", "machine": machine(), "settings": asdict(settings),
        "memory": [asdict(c) for c in configs], "ratios": ratios(configs), "accuracy": accuracy(configs),
        "simulated": simulated(profiles, configs),
        "overhead": overhead(benches["gpt"], settings), "peers": peers(settings),
    }
    results["seconds"] = time.perf_counter() - start
    return results


def default_out(results: dict[str, Any], root: Path | None = None) -> Path:
    """``benchmark-results/<UTC time>-<commit>`` under ``root`` (the repository; ignored by git)."""
    root = ROOT if root is None else root
    m = results["machine"]
    stamp = re.sub(r"[^0-9T]", "", m["date"].split("+")[0])
    return root / "benchmark-results" / f"{stamp}-{m.get('commit', 'unknown')}"


def write(results: dict[str, Any], out: Path | None = None, *, update_docs: bool = False,
          root: Path | None = None) -> list[Path]:
    """Write ``results.json`` and ``benchmarks.md`` to ``out`` (default: :func:`default_out`);
    with ``update_docs`` also the tracked ``benchmarks/results.json`` and ``docs/benchmarks.md``
    under ``root``, keeping the sections of that page this run does not make. Returns the paths."""
    root = ROOT if root is None else root
    out = out or default_out(results, root)
    page = markdown(results)
    targets = [(out / "results.json", json.dumps(results, indent=1)), (out / "benchmarks.md", page)]
    if update_docs:
        docs = root / "docs" / "benchmarks.md"
        kept = docs.read_text() if docs.exists() else ""
        targets += [(root / "benchmarks" / "results.json", json.dumps(results, indent=1)),
                    (docs, with_other_sections(page, kept))]
    for path, text in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return [path for path, _ in targets]


def _sections(page: str) -> list[tuple[str, str]]:
    """A page as ``(## heading, text)`` pairs; the text before the first is under ``""``."""
    parts = re.split(r"(?m)^(?=## )", page)
    return [(p.splitlines()[0] if p.startswith("## ") else "", p) for p in parts if p]


def with_other_sections(page: str, earlier: str) -> str:
    """``page`` with the ``##`` sections of ``earlier`` it does not have (written by another
    benchmark, such as the fault injection's), each after the section it followed there."""
    new = _sections(page)
    made = {heading for heading, _ in new}
    after: dict[str, list[str]] = {}
    previous = ""
    for heading, text in _sections(earlier):
        if heading in made:
            previous = heading
        else:
            after.setdefault(previous, []).append(text)
    merged = []
    for heading, text in new:
        merged.append(text)
        merged += after.pop(heading, [])
    merged += [text for texts in after.values() for text in texts]
    return "".join(t if t.endswith("\n\n") else t.rstrip("\n") + "\n\n" for t in merged).rstrip("\n") + "\n"


if __name__ == "__main__":
    main()
