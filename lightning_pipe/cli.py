"""``lightning-pipe plan``: profile a model on the CPU and print each partitioner's plan for a
device spec such as ``4x16GiB`` or ``8xA100-40GB`` at the largest micro-batch that fits: a
dry run before renting GPUs. Stages are planned as in training: to each device's memory
limit, less the memory model's error where a training step of the plan on fake tensors
measures one. For a named GPU the profile is made on fake tensors, its times
estimated for that GPU, and its memory, host link and link between stages come from its
datasheet. ``--precision`` (the Trainer's, or the config's ``trainer.precision``) plans the
bytes of that precision: see :class:`Precision`."""

import argparse
import importlib
import inspect
import json
import multiprocessing
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from copy import deepcopy
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import yaml
from rich.progress import Progress
from torch.nn.parameter import is_lazy

from lightning_pipe.autocast import cuda_policy
from lightning_pipe.graph.capture import Captured, CaptureError, capture
from lightning_pipe.graph.microbatch import scatter
from lightning_pipe.internals import FakeTensorMode, tree_flatten, tree_map
from lightning_pipe.measure.profiler import FAKE_DEVICE, profile_graph
from lightning_pipe.plan import report
from lightning_pipe.plan.devices import DEVICES, DeviceSpec, parse_devices
from lightning_pipe.plan.headroom import checked_largest_plan
from lightning_pipe.plan.partitioners import PARTITIONERS, Partitioner
from lightning_pipe.plan.plan import InfeasiblePlanError, Plan, make_plan
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanRequest, PlanSchedule, check_settings
from lightning_pipe.plan.schedule import MULTI_STAGE, SCHEDULES, Schedule
from lightning_pipe.plan.search import CHUNKS_PER_STAGE, SEARCHED_SCHEDULES, Cluster, Configuration, candidates, search
from lightning_pipe.progress import progress_bar, tracker
from lightning_pipe.runtime.build import Policy
from lightning_pipe.runtime.fake import fake_training, meta_copy
from lightning_pipe.units import format_bytes, parse_bytes

__all__ = ["PRECISIONS", "Precision", "main", "resolve_precision"]

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
# MemoryPipeStrategy's defaults, so that a plan made without a setting is the one training makes.
_CHUNKS, _SCHEDULE = 4, "gpipe"
# --search profiles a micro-batch of this many samples (scaled to each size it plans) and prints
# this many configurations.
_SEARCH_PROFILED, _TOP = 2, 10
#: The partitioners plan in processes of their own where profiling took at least this many CPU
#: seconds: forking and the copies its children make of the memory they touch cost some half a
#: second, which a check (a training step on fake tensors, some twice the profiling's run) repays.
FORK_AFTER_S = 1.0


@dataclass(frozen=True)
class Precision:
    """A Trainer precision as the dry run plans it, doing what Lightning's precision plugins
    do (this module may not import Lightning): under ``*-mixed`` the parameters, their
    gradients and the optimizer's state stay float32 (master weights) and each step runs
    under autocast; under ``bf16-true`` the model and the batch's floating tensors are
    bfloat16 (and so its gradients and optimizer state), and tensors a step makes default to
    it. ``16-mixed``'s grad scaler adds only a scale and a step counter per device (scalars)
    and unscales the gradients in place: no bytes to plan.

    Autocast casts as CUDA's does (:func:`~lightning_pipe.autocast.cuda_autocast`: layer norm,
    softmax and the losses in float32, matrix products and convolutions in the lower
    precision), run on the CPU: ``torch.autocast("cuda")`` needs a GPU. Where the config's
    ``trainer.accelerator`` is ``cpu``, as the CPU's does (``cuda=False``).
    """

    name: str
    autocast: torch.dtype | None  # the lower precision autocast runs in; None: no autocast
    params: torch.dtype
    cuda: bool = True  # autocast casts as CUDA's does, not as the CPU's

    def policy(self) -> AbstractContextManager[None]:
        """The context autocast casts in as on a GPU (:func:`~lightning_pipe.autocast.cuda_policy`),
        held for the whole dry run; none for the CPU's own policy or without autocast."""
        return cuda_policy() if self.cuda and self.autocast is not None else nullcontext()

    @contextmanager
    def step(self) -> Iterator[None]:
        """The context a training step (forward, loss) runs in, as Lightning's plugin's
        ``train_step_context``: within :meth:`policy`."""
        if self.autocast is not None:
            with torch.autocast("cpu", dtype=self.autocast, cache_enabled=False):  # (Lightning's setting)
                yield
            return
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.params)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def convert(self, value: Any) -> Any:
        """``value``'s floating tensors in the parameters' dtype under ``bf16-true``, as
        Lightning converts the model and each batch; unchanged otherwise."""
        if self.autocast is not None or self.params == torch.float32:
            return value
        if isinstance(value, torch.nn.Module):
            return value.to(dtype=self.params)
        return tree_map(lambda t: t.to(self.params) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        value)

    def describe(self) -> str:
        if self.autocast is not None:
            return (f"precision {self.name} ({'CUDA' if self.cuda else 'CPU'} autocast to {_dtype(self.autocast)}; "
                    f"parameters, gradients and optimizer state float32)")
        return f"precision {self.name} (parameters, activations, gradients and optimizer state {_dtype(self.params)})"


#: The precisions the dry run plans for, by the Trainer's names.
PRECISIONS = {p.name: p for p in (
    Precision("32-true", None, torch.float32), Precision("bf16-mixed", torch.bfloat16, torch.float32),
    Precision("16-mixed", torch.float16, torch.float32), Precision("bf16-true", None, torch.bfloat16),
)}
#: Lightning's older names for them, which a config may hold.
_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


@dataclass
class _Setup:
    """What to plan: the model and its whole batch, and the strategy's settings."""

    path: str
    model: torch.nn.Module
    inputs: tuple[tuple[Any, ...], dict[str, Any]]
    limits: list[int]
    chunks: int
    schedule: PlanSchedule
    host_bandwidth: float | None
    leaf_modules: list[str]
    precision: Precision
    device: DeviceSpec | None = None  # a named GPU: times estimated for it
    link_bandwidth: float | None = None
    batch: Any = None  # the training batch: the checks run training_step on it
    batch_from: str = "--batch"  # where the batch came from, for the header
    config: dict[str, Any] = field(default_factory=dict)  # the LightningCLI config (--config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-pipe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan", help="plan a model over a device spec", description=__doc__,
        epilog="With --config, a setting not given here comes from the config's trainer.strategy.init_args, "
               "else from MemoryPipeStrategy's default.",
    )
    plan.add_argument("--model", help="class path of the LightningModule, e.g. examples.models.GPT")
    plan.add_argument("--init-args", help="JSON object of the model's init arguments (with --config: overrides "
                                          "those of the config's model.init_args)")
    plan.add_argument("--config-json", help="a Hugging Face config as JSON (a file such as config.json): --model "
                                            "names a transformers model class, built from it without a wrapper, "
                                            "e.g. --model transformers.GPT2LMHeadModel --config-json cfg.json")
    plan.add_argument("--config", help="a LightningCLI YAML: model.class_path and model.init_args name the model, "
                                       "data.class_path and data.init_args the training batch; "
                                       "trainer.devices and trainer.strategy.init_args give the settings below")
    plan.add_argument("--input", action="append", default=[], metavar="NAME=DTYPE[SHAPE]",
                      help="a forward argument of the whole batch, e.g. image=float32[16,3,32,32] or "
                           "batch.input_ids=int64[16,64] (a dict argument); repeat for more. "
                           "Default: the model's example_input_array")
    plan.add_argument("--batch", action="append", default=[], metavar="NAME=DTYPE[SHAPE]",
                      help="a tensor of the training batch training_step takes, by its path in the batch: "
                           "input_ids=int64[16,64] for a dict, 0=... and 1=... for a tuple, batch=... for one "
                           "tensor; repeat for more. With it each plan's check runs the model's own training_step "
                           "(its loss, as training does). Default with --config: the first batch of the config's "
                           "data module (data.class_path); without either, the outputs' sum is the loss")
    plan.add_argument("--devices", help="each stage device's memory limit, with a unit: 4x16GiB or 16GiB,16GiB,8GiB; "
                                        f"or COUNTxGPU, one of {', '.join(DEVICES)}: 8xA100-40GB. "
                                        "Default with --config: trainer.devices x the strategy's memory_limit")
    plan.add_argument("--memory-limit", help="with a named GPU, each stage's memory limit instead of the GPU's memory")
    plan.add_argument("--chunks", type=int, help=f"micro-batches per batch (default {_CHUNKS})")
    plan.add_argument("--schedule", choices=(*SCHEDULES, "auto"),
                      help=f"pipeline schedule (default {_SCHEDULE}); auto: the planner picks the fastest for "
                           f"runtime='distributed' and lists the others")
    plan.add_argument("--precision", choices=PRECISIONS, help="the Trainer's precision the plan is for: activations, "
                                                              "parameters and optimizer state in its dtypes (default "
                                                              "with --config: trainer.precision, else 32-true)")
    plan.add_argument("--host-bandwidth", type=float, help="bytes/s to host memory; allows swap (default: a named "
                                                           "GPU's host link, else none)")
    plan.add_argument("--link-bandwidth", type=float, help="bytes/s between stage devices (default: a named GPU's "
                                                           "link, else transfers are free); with --search also "
                                                           "between replicas, for their gradient all-reduce")
    plan.add_argument("--out", help="a folder: each partitioner's plan shown, as OUT/NAME/plan.json and plan.png "
                                    "(with --search: the best configuration's, as OUT/dawnpiper/)")
    plan.add_argument("--search", action="store_true",
                      help="search the configurations of the --devices GPUs (COUNTxGPU or COUNTxSIZE): pipeline depth "
                           "x data-parallel width (their product the GPU count), schedule (gpipe, 1f1b: those "
                           "runtime='distributed' runs) and micro-batches per batch (divisors of a replica's batch, "
                           f"up to {CHUNKS_PER_STAGE} per stage; --chunks and --schedule given here fix one, a "
                           "config's are not read). The --input batch "
                           "is the global batch, split evenly over the replicas. Prints the top 10 by simulated "
                           "samples/s (the pipeline's step plus the gradient all-reduce over --link-bandwidth) and "
                           "the best's plan")
    plan.add_argument("--json", metavar="PATH", help="with --search: write every configuration that fits, best first, "
                                                     "as {\"configurations\": [...]}")
    args = parser.parse_args(argv)
    try:
        setup = _setup(args)
    except (ValueError, CaptureError) as err:
        plan.error(str(err))
    with setup.precision.policy():  # for the whole dry run: a recompute casts again in the backward
        return _dry_run(args, setup, plan.error)


def _dry_run(args: argparse.Namespace, setup: _Setup, error: Callable[[str], NoReturn]) -> int:
    """``lightning-pipe plan`` once its settings are read (``error``: exits 2 with the message)."""
    try:
        if args.search:
            _check_search(args, setup)
            # profiled at a micro-batch of 2 samples and scaled to each size: checking that the model runs
            # on a micro-batch and capturing it cost far less than at the global batch's quarter
            setup.chunks = max(1, _global_batch(setup) // _SEARCH_PROFILED)
        elif args.json:
            raise ValueError("--json goes with --search: it writes the configurations searched.")
        sample_args, sample_kwargs = _microbatch(setup, args.input)
        if args.batch:
            given = "--batch " + " --batch ".join(args.batch)
            setup.batch = _training_batch(setup, _described_batch(args.batch), given)
        elif (not args.search and hasattr(setup.model, "training_step")
              and (batch := _config_batch(setup.config, args.config)) is not None):
            setup.batch = _training_batch(setup, batch, f"the data module of {args.config}")
            setup.batch_from = "the config's data module"
        # The training graph, as the strategy plans it; torch.export captures what fx cannot.
        captured = capture(setup.model.train(), setup.leaf_modules, example_inputs=(sample_args, sample_kwargs))
        if args.search:  # a layout of the batch over the GPUs exists before profiling for it
            candidates(len(setup.limits), _global_batch(setup), len(captured.nodes), _searched_schedules(args),
                       args.chunks)
    except (ValueError, CaptureError) as err:
        error(str(err))
    if args.search:
        return _search(args, setup, captured, sample_args, sample_kwargs)
    with progress_bar() as bar:
        profiling = time.process_time()
        profile = _profile(setup, captured, sample_args, sample_kwargs, bar)
        profiling = time.process_time() - profiling
    results = list(zip(PARTITIONERS, _plans(profile, setup, captured, forked=profiling >= FORK_AFTER_S)))
    loss = (f"training_step on {setup.batch_from}" if setup.batch is not None
            else "loss not checked: the outputs' sum stands in; give --batch, or a config with a data module, "
                 "to run training_step")
    print(f"{_profiled(setup, captured, profile)}; "
          f"{len(setup.limits)} stages, {setup.schedule}, {setup.chunks} micro-batches; "
          f"memory limit {_sizes(setup.limits)}, each plan checked by a training step on fake tensors ({loss}) "
          f"and planned below the limit by the error that measures; host link "
          f"{_rate(setup.host_bandwidth)}, link between stages {_rate(setup.link_bandwidth)}; "
          f"{_optimizer_note(setup.model)}\n")
    for name, result in results:
        if isinstance(result, InfeasiblePlanError):
            print(f"== {name}: does not fit: {result}\n")
        else:
            print(f"== {name}: largest micro-batch that fits: {result.microbatch_size}"
                  f"{_against_input(result.microbatch_size, profile.microbatch_size)}")
            print(result.table() + "\n")
            if args.out:
                report.save(replace(result, precision=setup.precision.name), Path(args.out) / name)
    if args.out:
        print(f"plans written to {args.out}/<partitioner>/plan.json and plan.png")
    return 0


def _profile(setup: _Setup, captured: Captured, sample_args: tuple[Any, ...], sample_kwargs: dict[str, Any],
             bar: Progress) -> Profile:
    """The graph's profile on its first micro-batch under the precision's step context: on fake
    tensors with the named GPU's times, else on the CPU."""
    with setup.precision.step():
        return profile_graph(captured, sample_args, sample_kwargs, optimizer=_optimizer(setup.model),
                             fake=setup.device is not None, device=setup.device or FAKE_DEVICE,
                             progress=tracker(bar, "profiling nodes", len(captured.nodes)))


def _profiled(setup: _Setup, captured: Captured, profile: Profile) -> str:
    """The header's first words: what was profiled, where, at what size and precision."""
    where = f"on fake tensors, times for {setup.device.name}," if setup.device else f"on {profile.device}"
    return (f"profiled {len(profile.nodes)} nodes ({captured.front_end}) {where} at micro-batch "
            f"{profile.microbatch_size}; {setup.precision.describe()}")


def _check_search(args: argparse.Namespace, setup: _Setup) -> None:
    """Settings ``--search`` cannot take: GPUs of different sizes, a fixed 2BW schedule, a
    training batch (the search plans by the memory model, without fake training steps)."""
    if len(set(setup.limits)) > 1:
        raise ValueError(f"--search regroups the GPUs into pipelines of any depth, so they must be alike: --devices "
                         f"gives stages of {_sizes(setup.limits)}. Give COUNTxGPU or COUNTxSIZE, e.g. 32xA100-80GB.")
    if args.schedule is not None and args.schedule not in SEARCHED_SCHEDULES:
        why = {"2bw": "runs only with runtime='local', one process without data-parallel replicas",
               "auto": "weighs schedules holding several stages per process, which --search does not lay out"}.get(
            args.schedule, "holds several stages per process, which --search does not lay out")
        raise ValueError(f"--schedule {args.schedule} {why}; with --search give one of "
                         f"{', '.join(SEARCHED_SCHEDULES)}, or leave --schedule out to search them.")
    if args.batch:
        raise ValueError("--batch goes without --search: the search plans every configuration by the memory model, "
                         "below the limit by the flat headroom, and runs no training step to check them.")


def _searched_schedules(args: argparse.Namespace) -> tuple[Schedule, ...]:
    """The schedules ``--search`` tries: the one ``--schedule`` fixes, else all it can."""
    return (args.schedule,) if args.schedule is not None else SEARCHED_SCHEDULES


def _global_batch(setup: _Setup) -> int:
    """The samples per step of the whole ``--input`` batch (the leading size its tensors share)."""
    sizes = {t.shape[0] for t in tree_flatten(setup.inputs)[0] if isinstance(t, torch.Tensor) and t.dim()}
    if len(sizes) != 1:
        raise ValueError(f"--search needs the global batch: the --input tensors' leading sizes are "
                         f"{sorted(sizes) or 'none'}; give tensors that share one batch size.")
    return sizes.pop()


def _search(args: argparse.Namespace, setup: _Setup, captured: Captured, sample_args: tuple[Any, ...],
            sample_kwargs: dict[str, Any]) -> int:
    """``--search``: profile once, plan every configuration, print the top 10 and the best's plan."""
    gpus, limit, batch = len(setup.limits), setup.limits[0], _global_batch(setup)
    cluster = Cluster(gpus, limit, setup.link_bandwidth, setup.host_bandwidth)
    with progress_bar() as bar:
        profile = _profile(setup, captured, sample_args, sample_kwargs, bar)
        found = search(profile, cluster, batch, schedules=_searched_schedules(args), chunks=args.chunks,
                       top=_TOP, progress=tracker(bar, "configurations"))
    name = setup.device.name if setup.device else format_bytes(limit)
    chunks = (f"{args.chunks} micro-batches" if args.chunks else
              f"micro-batches per batch dividing a replica's batch, up to {CHUNKS_PER_STAGE} per stage")
    link = ("all-reduce and sends free (no link bandwidth)" if setup.link_bandwidth is None
            else f"all-reduce and sends over a link of {_rate(setup.link_bandwidth)}")
    print(f"{_profiled(setup, captured, profile)}; searched {gpus} x {name} for a global batch "
          f"of {batch} as depth x width "
          f"(pipelines of depth stages, width data-parallel replicas, runtime='distributed'), schedules "
          f"{', '.join(_searched_schedules(args))}, {chunks}: {found.planned + found.skipped} configurations, "
          f"{found.planned} planned, {len(found.configurations)} fit, {found.skipped} skipped (their bound cannot "
          f"reach the top {_TOP}); memory limit {format_bytes(limit)}, each stage planned below it by the flat "
          f"headroom (no training step checks them); {link}, host link {_rate(setup.host_bandwidth)}; "
          f"{_optimizer_note(setup.model)}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"configurations": [f.to_dict() for f in found.configurations], "gpus": gpus, "device": name,
             "global_batch": batch, "planned": found.planned, "infeasible": found.infeasible,
             "skipped": found.skipped}, indent=1))
    if not found.configurations:
        print("no configuration fits: add GPUs or memory, or give a smaller global batch.")
        return 1
    print(_ranking(found.configurations[:_TOP]) + "\n")
    best = found.configurations[0]
    c = best.candidate
    print(f"== best: depth {c.depth} x width {c.width}, {c.schedule}, {c.chunks} "
          f"micro-batch{'es' if c.chunks > 1 else ''} of {c.microbatch_size} per replica: "
          f"{best.samples_per_second:.1f} samples/s; each replica's pipeline:")
    print(best.plan.table())
    saved = ""
    if args.out:
        report.save(replace(best.plan, precision=setup.precision.name), Path(args.out) / "dawnpiper")
        saved = f', plan="{Path(args.out) / "dawnpiper" / "plan.json"}"'
    print(f"\ntrain it on {gpus} GPUs (Trainer devices x num_nodes) with batches of {c.chunks * c.microbatch_size} "
          f"per replica: MemoryPipeStrategy(runtime=\"distributed\", stages={c.depth}, schedule=\"{c.schedule}\", "
          f"chunks={c.chunks}{saved})")
    if args.json:
        print(f"configurations written to {args.json}")
    return 0


def _ranking(configurations: list[Configuration]) -> str:
    """The configurations as a table within 100 columns, with each one's fullest stage."""
    head = ["#", "depth", "width", "schedule", "chunks", "micro", "samples/s", "step ms", "reduce ms",
            "fullest stage"]
    rows = [head]
    for k, f in enumerate(configurations, 1):
        c, worst = f.candidate, max(f.peaks)
        rows.append([str(k), str(c.depth), str(c.width), c.schedule, str(c.chunks), str(c.microbatch_size),
                     f"{f.samples_per_second:.1f}", f"{f.step_ms:.1f}", f"{f.allreduce_ms:.1f}",
                     f"{format_bytes(worst)}/{format_bytes(f.memory_limit)}"])
    widths = [max(len(row[k]) for row in rows) for k in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows)


def _setup(args: argparse.Namespace) -> _Setup:
    """The model and the settings: the command line's, else the config's, else the strategy's defaults."""
    config = _read_config(args.config) if args.config else {}
    trainer = config.get("trainer") or {}
    strategy = trainer.get("strategy")
    settings = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    precision = resolve_precision(args.precision, trainer.get("precision"), args.config)
    if trainer.get("accelerator") == "cpu":
        precision = replace(precision, cuda=False)
    device, limits = _limits(args, trainer, settings)
    path, model = _model(args, config, unfilled=device is not None)  # a named GPU's profile reads no values
    model = precision.convert(model)
    chunks = args.chunks if args.chunks is not None else settings.get("chunks", _CHUNKS)
    schedule = args.schedule or settings.get("schedule", _SCHEDULE)
    host_bandwidth = _given(args.host_bandwidth, settings.get("host_bandwidth"), device and device.host_bandwidth)
    link_bandwidth = _given(args.link_bandwidth, settings.get("link_bandwidth"), device and device.link_bandwidth)
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}.")
    for name, rate in (("host_bandwidth", host_bandwidth), ("link_bandwidth", link_bandwidth)):
        if rate is not None and not isinstance(rate, (int, float)):
            raise ValueError(f"{name} must be a positive number of bytes per second, got {rate!r}.")
    check_settings(chunks, schedule, host_bandwidth, link_bandwidth, (*SCHEDULES, "auto"))
    return _Setup(path, model, precision.convert(_inputs(args.input, model, path)), limits, chunks, schedule,
                  host_bandwidth, list(settings.get("leaf_modules") or []), precision, device, link_bandwidth,
                  config=config)


def resolve_precision(given: str | None, configured: Any, config: str | None) -> Precision:
    """The command line's precision, else the config's ``trainer.precision``, else ``32-true``."""
    if given is not None:
        return PRECISIONS[given]  # (argparse checked it)
    if configured is None:
        return PRECISIONS["32-true"]
    name = _ALIASES.get(str(configured), str(configured))
    if name not in PRECISIONS:
        raise ValueError(f"trainer.precision in {config} is {configured!r}, which a dry run cannot plan for: give "
                         f"--precision, one of {', '.join(PRECISIONS)}.")
    return PRECISIONS[name]


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _limits(
    args: argparse.Namespace, trainer: dict[str, Any], settings: dict[str, Any]
) -> tuple[DeviceSpec | None, list[int]]:
    """The named GPU, if any, and each stage's memory limit."""
    named = parse_devices(args.devices) if args.devices else None
    if named is not None:
        device, count = named
        if count < 1:
            raise ValueError(f"--devices {args.devices!r} has no stages.")
        return device, [parse_bytes(args.memory_limit) if args.memory_limit else device.memory] * count
    if args.memory_limit:
        raise ValueError("--memory-limit goes with a named GPU such as 8xA100-40GB; with memory sizes, "
                         "--devices gives each stage's limit.")
    if args.devices:
        return None, _devices(args.devices)
    if args.config:
        return None, _config_limits(args.config, trainer.get("devices"), settings.get("memory_limit"))
    raise ValueError("give --devices, each stage device's memory limit (e.g. 4x16GiB) or a GPU (e.g. 8xA100-40GB).")


def _given(*choices: Any) -> Any:
    """The first setting given: the command line's, the config's, the named GPU's."""
    return next((c for c in choices if c is not None), None)


def _read_mapping(option: str, path: str, not_one: str) -> dict[str, Any]:
    """The mapping a YAML or JSON file (JSON is YAML) holds; ``not_one``: what to say when it holds none."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise ValueError(f"cannot read {option} {path!r}: {err.strerror}.") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{option} {path!r} is not valid YAML or JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{option} {path!r} {not_one}.")
    return data


def _read_config(path: str) -> dict[str, Any]:
    config = _read_mapping("--config", path, "is not a LightningCLI config: it has no model: or trainer: section")
    # A module next to the config, named by its class_path, imports as it would beside the script.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    return config


def _model(args: argparse.Namespace, config: dict[str, Any], unfilled: bool = False) -> tuple[str, torch.nn.Module]:
    """The model the arguments name, built by :func:`_unfilled` where ``unfilled``."""
    section = config.get("model") or {}
    path = args.model or section.get("class_path")
    if path is None:
        raise ValueError(f"{args.config} has no model.class_path; give it or --model." if args.config
                         else "give --model CLASS_PATH or --config FILE.")
    init = {} if args.model else dict(section.get("init_args") or {})
    if args.init_args is not None:
        try:
            given = json.loads(args.init_args)
        except json.JSONDecodeError as err:
            raise ValueError(f"--init-args is not JSON: {err}.") from None
        if not isinstance(given, dict):
            raise ValueError(f"--init-args must be a JSON object such as '{{\"layers\": 24}}', got {args.init_args!r}.")
        init.update(given)
    sys.path.insert(0, os.getcwd())  # user modules next to where the command runs
    cls = _class(path)
    if args.config_json is not None:
        return path, _from_config_json(cls, path, args.config_json, init)
    try:
        inspect.signature(cls).bind(**init)
    except TypeError as err:
        accepted = ", ".join(inspect.signature(cls).parameters)
        raise ValueError(f"{path} does not take init args {init}: {err}. It takes: {accepted}.") from None
    try:
        model = _unfilled(cls, init) if unfilled else cls(**init)
    except Exception as err:
        raise ValueError(f"{path}(**{init}) failed: {type(err).__name__}: {err}") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{path} is not a torch.nn.Module (a LightningModule), it is a {type(model).__name__}.")
    return path, model


def _unfilled(cls: Any, init: dict[str, Any]) -> Any:
    """``cls(**init)`` with its parameters and buffers in CPU memory never written, for a dry
    run on fake tensors, which reads none of their values: built on ``meta`` (no
    initialisation runs), then each tensor given memory in place (tied ones stay tied). Pages
    never written are not resident: GPT-2 large's 3.1 GB of weights, written by its
    initialisation, were half the dry run's peak memory. A class that cannot be built on
    ``meta``, or has lazy parameters (its first forward makes them), is built as usual."""
    try:
        with torch.device("meta"):
            model = cls(**init)
    except Exception:
        return cls(**init)
    if isinstance(model, torch.nn.Module):
        tensors = [*model.parameters(), *model.buffers()]
        if any(map(is_lazy, tensors)):
            return cls(**init)
        seen: set[int] = set()
        for t in tensors:
            if id(t) not in seen and t.is_meta:
                seen.add(id(t))
                empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                torch.utils.swap_tensors(t, torch.nn.Parameter(empty, t.requires_grad)  # type: ignore[no-untyped-call]
                                         if isinstance(t, torch.nn.Parameter) else empty)
    return model


def _from_config_json(cls: Any, path: str, file: str, init: dict[str, Any]) -> torch.nn.Module:
    """A Hugging Face model class built from its config class, read from ``file`` (with
    ``--init-args`` overriding the file's entries)."""
    config_class = getattr(cls, "config_class", None)
    if config_class is None or not hasattr(config_class, "from_dict"):
        raise ValueError(f"--config-json goes with a transformers model class (one with a config_class, such as "
                         f"transformers.GPT2LMHeadModel); {path} has none.")
    data = _read_mapping("--config-json", file, f"must hold a JSON object of {config_class.__name__}'s arguments")
    try:
        model = cls(config_class.from_dict({**data, **init}))
    except Exception as err:
        raise ValueError(f"{path} from {config_class.__name__}({file}) failed: {type(err).__name__}: {err}") from None
    return cast(torch.nn.Module, model)


def _class(path: str) -> Any:
    """The class ``path`` names; a module it imports that is not installed is named as such."""
    module_name, _, class_name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and not (module_name == missing or module_name.startswith(missing + ".")):
            extra = " (pip install -e '.[hf]' installs it with lightning_pipe)" if missing == "transformers" else ""
            raise ValueError(f"{module_name} imports {missing!r}, which is not installed: pip install "
                             f"{missing.split('.')[0]}{extra}.") from None
        raise ValueError(f"cannot import {path!r}: there is no module {module_name!r}; give a class path importable "
                         f"from the current directory, such as examples.models.GPT run from the repository "
                         f"root.") from None
    except (ImportError, ValueError):
        raise ValueError(f"cannot import {path!r}: give a class path importable from the current directory, such as "
                         f"examples.models.GPT run from the repository root.") from None
    if not hasattr(module, class_name):
        raise ValueError(f"{module_name} has no {class_name!r}; give a class path such as examples.models.GPT.")
    return getattr(module, class_name)


def _inputs(specs: list[str], model: torch.nn.Module, path: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not specs:
        example = getattr(model, "example_input_array", None)
        if example is None:
            raise ValueError("give the batch with --input NAME=DTYPE[SHAPE] (the model has no example_input_array).")
        return (example if isinstance(example, tuple) else (example,)), {}
    parameters = inspect.signature(model.forward).parameters
    any_name = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs: dict[str, Any] = {}
    for spec in specs:
        name, value = _tensor(spec, "--input")
        if not any_name and name.split(".")[0] not in parameters:
            raise ValueError(f"--input {spec!r}: {path}.forward has no argument {name.split('.')[0]!r}; "
                             f"its arguments are {', '.join(parameters)}.")
        _nest(kwargs, name, value)
    return (), kwargs


def _nest(tree: dict[str, Any], path: str, value: torch.Tensor) -> None:
    """Put ``value`` at the dotted ``path`` of ``tree`` (``batch.input_ids``: a dict argument's key)."""
    *parents, leaf = path.split(".")
    for parent in parents:
        tree = tree.setdefault(parent, {})
    tree[leaf] = value


def _tensor(spec: str, option: str) -> tuple[str, torch.Tensor]:
    """``NAME=DTYPE[SHAPE]``: the name and a tensor of that dtype and shape (random floats,
    integer zeros: valid token ids and labels)."""
    match = re.fullmatch(r"([\w.]+)=(\w+)\[([\d,\s]+)\]", spec.strip())
    if match is None or match.group(2) not in _DTYPES:
        raise ValueError(f"cannot read {option} {spec!r}: use NAME=DTYPE[SHAPE] with DTYPE one of {sorted(_DTYPES)}, "
                         f"e.g. image=float32[16,3,32,32].")
    dtype, shape = _DTYPES[match.group(2)], [int(d) for d in match.group(3).split(",")]
    return match.group(1), torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)


def _microbatch(setup: _Setup, specs: list[str]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The first micro-batch, after checking that the model runs on it: a wrong name, dtype or
    shape fails here with the inputs named, not deep inside the profiler."""
    sample_args, sample_kwargs = scatter(setup.inputs, setup.chunks)[0]
    try:
        with torch.no_grad(), setup.precision.step():
            if _on_fake(setup.model, lambda model, a, k: model(*a, **k), sample_args, sample_kwargs) is None:
                setup.model(*sample_args, **sample_kwargs)
    except Exception as err:
        given = "--input " + " --input ".join(specs) if specs else "its example_input_array"
        raise ValueError(
            f"{setup.path} fails on a micro-batch of {given}: {type(err).__name__}: {err}. Check each input's "
            f"name, dtype and shape against {setup.path}.forward and the init args they depend on."
        ) from None
    return sample_args, sample_kwargs


def _on_fake(model: torch.nn.Module, call: Callable[..., Any], *inputs: Any) -> Any:
    """What ``call(copy, *inputs)`` returns on fake copies of ``inputs``' tensors (shapes and
    dtypes, no data, no compute: GPT-2 large's forward on a micro-batch costs minutes of CPU,
    which a dry run spent on this check alone), ``copy`` a copy of ``model`` sharing its
    tensors, so that what a forward keeps (a cache, a count) stays off the model. ``None``
    where it fails or returns nothing, or where ``model`` has lazy parameters (its first
    forward makes them), for the caller to run the real inputs: an operator fake tensors
    cannot run (a value read from data) is no error, and a wrong input is reported with the
    error a real run gives."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(map(is_lazy, tensors)):
        return None
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        copy = deepcopy(model, {id(t): t for t in tensors})
        with mode:
            return call(copy, *tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, inputs))
    except Exception:
        return None


def _devices(spec: str) -> list[int]:
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(.+)", spec)
    if match and int(match.group(1)) < 1:
        raise ValueError(f"--devices {spec!r} has no stages.")
    parts = [match.group(2)] * int(match.group(1)) if match else spec.split(",")
    for part in parts:
        if re.fullmatch(r"\s*[0-9.eE+]+\s*", part):
            raise ValueError(
                f"--devices {spec!r}: {part.strip()!r} has no unit (it would be read as bytes). Give each stage "
                f"device's memory limit with a unit: 4x16GiB for four devices of 16 GiB, or 16GiB,16GiB,8GiB."
            )
    return [parse_bytes(part) for part in parts]


def _config_limits(path: str, devices: Any, limit: Any) -> list[int]:
    """The stages' memory limits from the config: ``memory_limit`` per stage, or one for
    each of ``trainer.devices``."""
    if limit is None:
        raise ValueError(f"give --devices, e.g. 4x16GiB: {path} sets no trainer.strategy.init_args.memory_limit.")
    try:
        if isinstance(limit, list):
            return [parse_bytes(v) for v in limit]
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"give --devices, e.g. 4x16GiB: trainer.devices in {path} is {devices!r}, not a "
                             f"number of stages.")
        return [parse_bytes(limit)] * devices
    except ValueError as err:
        raise ValueError(f"trainer.strategy.init_args.memory_limit in {path}: {err}") from None


def _plans(profile: Profile, setup: _Setup, captured: Captured, forked: bool) -> list[Plan | InfeasiblePlanError]:
    """Each partitioner's :func:`_plan`, in :data:`PARTITIONERS`' order.
    They share nothing once the model is profiled, so where ``forked`` they run in processes
    forked from this one, one per CPU this process may run on (on two CPUs the dry run of
    GPT-2 large takes a third less time), the first (dawnpiper, whose search takes the
    longest) first. Forked, not spawned: the model and its graph are the children's as they
    are here, unpickled; and before the progress bar's thread starts, which could hold a lock
    of stderr as it forks."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(cpus, len(PARTITIONERS)) if forked and "fork" in multiprocessing.get_all_start_methods() else 1
    if workers == 1:
        plans: Iterator[Plan | InfeasiblePlanError] = (_plan(profile, name, setup, captured) for name in PARTITIONERS)
    else:  # (a child that dies, killed for memory, breaks the pool: an error, not a wait)
        pool = ProcessPoolExecutor(workers, multiprocessing.get_context("fork"), _adopt, (profile, setup, captured))
        plans = pool.map(_forked_plan, PARTITIONERS)
    done: list[Plan | InfeasiblePlanError] = []
    try:
        with progress_bar() as bar:
            advance = tracker(bar, "planning", len(PARTITIONERS))
            for plan in plans:
                done.append(plan)
                advance(len(done), len(PARTITIONERS))
    finally:
        if workers > 1:
            pool.shutdown(cancel_futures=True)
    return done


_adopted: tuple[Profile, _Setup, Captured] | None = None  # what a process _plans forked plans for


def _adopt(profile: Profile, setup: _Setup, captured: Captured) -> None:
    global _adopted
    _adopted = profile, setup, captured


def _forked_plan(name: Partitioner) -> Plan | InfeasiblePlanError:
    assert _adopted is not None, "runs in a process _plans forked"
    profile, setup, captured = _adopted
    return _plan(profile, name, setup, captured)


def _plan(profile: Profile, name: Partitioner, setup: _Setup, captured: Captured) -> Plan | InfeasiblePlanError:
    """The partitioner's plan at its largest micro-batch, checked as the strategy checks its
    plan (:func:`_fake_peaks`), or why not even one sample fits."""
    check = partial(_fake_peaks, setup, captured)
    processes = setup.schedule == "auto" or setup.schedule in MULTI_STAGE  # only runtime='distributed' runs them
    request = PlanRequest(setup.limits, name, setup.schedule, setup.chunks, setup.host_bandwidth, setup.link_bandwidth,
                          carry=processes)
    try:
        # at the input's micro-batch and unchecked: the one-process fake step runs no multi-stage schedule
        return make_plan(profile, request) if processes else checked_largest_plan(profile, request, check)
    except InfeasiblePlanError as err:
        return err


def _against_input(largest: int, given: int) -> str:
    """Where the plan shown, made at the largest micro-batch, stands against the input's."""
    if largest == given:
        return " (the input's)"
    return f"; planned at it, not at the input's {given}" + (", which does not fit" if largest < given else "")


def _fake_peaks(setup: _Setup, captured: Captured, plan: Plan) -> list[int]:
    """Each stage's peak when ``plan`` trains, from a fake training step of a copy of the
    model on batches of the plan's size: the model's ``training_step`` on the training batch
    (``--batch``), else the sum of the outputs on the forward's inputs as the loss."""
    model, graph = meta_copy(setup.model, captured)
    optimizer = _optimizer(model) or torch.optim.SGD(model.parameters(), lr=0.0)
    size = plan.microbatch_size * plan.chunks
    batch = tree_map(lambda t: torch.empty((size, *t.shape[1:]), dtype=t.dtype, device="meta")
                     if isinstance(t, torch.Tensor) else t, setup.inputs if setup.batch is None else setup.batch)
    loss = _output_sum if setup.batch is None else partial(_training_step, model)

    def step(forward: Callable[..., Any], microbatch: Any) -> torch.Tensor:
        with setup.precision.step():
            return loss(forward, microbatch)

    policies = {n.name: cast(Policy, p) for n, p in zip(graph.nodes, plan.policies) if p != "keep"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        # (CPU autocast casts fake tensors standing on the CPU, not meta ones)
        meter = fake_training(model, graph, batch, step, optimizer, plan.balance, policies,
                              schedule=cast(Schedule, plan.schedule), chunks=plan.chunks,
                              tensors="meta" if setup.precision.autocast is None else "cpu",
                              cuda=setup.device is not None and setup.device.cuda)  # a named GPU's attention
    return meter.peaks()


def _training_step(model: torch.nn.Module, forward: Callable[..., Any], microbatch: Any) -> torch.Tensor:
    """The loss ``model.training_step`` returns on ``microbatch``, its ``self(...)`` answered by
    ``forward`` (the pipeline)."""
    module: Any = model  # a LightningModule: nn.Module types training_step as a submodule or tensor
    module.forward = forward  # an instance attribute over the class's forward
    returned = module.training_step(microbatch, 0)
    return cast(torch.Tensor, returned["loss"] if isinstance(returned, dict) else returned)


def _described_batch(specs: list[str]) -> Any:
    """The training batch ``--batch`` describes: one tensor, a tuple or a (nested) dict."""
    tensors = dict(_tensor(spec, "--batch") for spec in specs)
    if set(tensors) == {"batch"}:
        return tensors["batch"]
    if all(name.isdigit() for name in tensors):
        return tuple(tensors[str(k)] for k in range(len(tensors)))
    batch: dict[str, Any] = {}
    for name, value in tensors.items():
        _nest(batch, name, value)
    return batch


def _config_batch(config: dict[str, Any], path: str) -> Any:
    """The first training batch of the config's data module (``data.class_path``), or ``None``
    where the config names none. Only its tensors' shapes and dtypes are used."""
    section = config.get("data")
    if not isinstance(section, dict) or "class_path" not in section:
        return None
    cls = _class(section["class_path"])
    try:
        data = cls(**(section.get("init_args") or {}))
        data.prepare_data()
        data.setup("fit")
        return next(iter(data.train_dataloader()))
    except Exception as err:
        raise ValueError(f"{path}'s data module {section['class_path']} gives no training batch: "
                         f"{type(err).__name__}: {err}. Check data.init_args, or give the batch with "
                         f"--batch.") from None


def _training_batch(setup: _Setup, batch: Any, given: str) -> Any:
    """``batch`` (``given``: where it came from), after checking that the model's
    ``training_step`` runs on its first micro-batch and returns a loss."""
    if not callable(getattr(setup.model, "training_step", None)):
        raise ValueError(f"--batch goes with a LightningModule: {setup.path} has no training_step.")
    batch = setup.precision.convert(batch)
    microbatch = scatter(((batch,), {}), setup.chunks)[0][0][0]
    try:
        with torch.no_grad(), warnings.catch_warnings(), setup.precision.step():
            warnings.simplefilter("ignore")
            loss = _on_fake(setup.model, lambda model, batch: _training_step(model, model.forward, batch), microbatch)
            if loss is None:
                loss = _training_step(setup.model, setup.model.forward, microbatch)
    except Exception as err:
        raise ValueError(f"{setup.path}.training_step fails on a micro-batch of {given}: "
                         f"{type(err).__name__}: {err}.") from None
    finally:
        vars(setup.model).pop("forward", None)  # the class's forward again
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"{setup.path}.training_step returns {type(loss).__name__}, not a loss (a tensor, or a dict "
                         f"with 'loss').")
    return batch


def _output_sum(forward: Callable[..., Any], inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> torch.Tensor:
    """A loss for a model without a training batch: the sum of its floating outputs."""
    outputs = [t for t in tree_flatten(forward(*inputs[0], **inputs[1]))[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.stack([t.float().sum() for t in outputs]).sum()


def _rate(bytes_per_s: float | None) -> str:
    return "none" if bytes_per_s is None else f"{bytes_per_s / 1e9:g} GB/s"


def _sizes(values: list[int]) -> str:
    """``4 x 16.0GiB``, or every stage's size where they differ."""
    if len(set(values)) == 1:
        return f"{len(values)} x {format_bytes(values[0])}"
    return ", ".join(format_bytes(v) for v in values)


def _optimizer_note(model: torch.nn.Module) -> str:
    """Which optimizer's state the plans count."""
    optimizer = _optimizer(model)
    if optimizer is None:
        return "no optimizer state counted (the model configures no optimizer)"
    return f"optimizer {type(optimizer).__name__} (the model's)"


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """The model's own optimizer when it configures one, for optimizer-state bytes."""
    configure = getattr(model, "configure_optimizers", None)
    try:
        configured = configure() if callable(configure) else None
    except Exception:
        return None
    first = configured[0] if isinstance(configured, (list, tuple)) else configured
    first = first[0] if isinstance(first, (list, tuple)) else first
    if isinstance(first, dict):
        first = first.get("optimizer")
    return first if isinstance(first, torch.optim.Optimizer) else None


if __name__ == "__main__":
    sys.exit(main())
