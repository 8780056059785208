"""``lightning-pipe plan``: profile a model on the CPU and print each partitioner's plan for a
device spec such as ``4x16GiB``, with the largest micro-batch that fits: a dry run before
renting GPUs."""

import argparse
import importlib
import json
import os
import re
import sys
from typing import Any

import torch
import yaml

from lightning_pipe.graph.capture import CaptureError, capture
from lightning_pipe.graph.microbatch import scatter
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.partitioners import PARTITIONERS
from lightning_pipe.plan.plan import InfeasiblePlanError, make_plan, max_microbatch
from lightning_pipe.units import parse_bytes

__all__ = ["main"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-pipe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="plan a model over a device spec")
    plan.add_argument("--model", help="class path of the LightningModule, e.g. examples.models.GPT")
    plan.add_argument("--init-args", default="{}", help="JSON object of the model's init arguments")
    plan.add_argument("--config", help="a LightningCLI YAML whose model section names the class and init args")
    plan.add_argument("--input", action="append", default=[], metavar="NAME=DTYPE[SHAPE]",
                      help="a forward argument of the whole batch, e.g. image=float32[16,3,32,32] or "
                           "batch.input_ids=int64[16,64] (a dict argument); repeat for more. "
                           "Default: the model's example_input_array")
    plan.add_argument("--devices", required=True, help="stage devices, e.g. 4x16GiB or 16GiB,16GiB,8GiB")
    plan.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    plan.add_argument("--schedule", choices=["gpipe", "1f1b", "2bw"], default="1f1b")
    plan.add_argument("--host-bandwidth", type=float, help="bytes/s to host memory; allows swap")
    args = parser.parse_args(argv)
    try:
        model = _model(args)
        inputs = _inputs(args.input, model)
        capacities = _devices(args.devices)
    except ValueError as err:
        parser.error(str(err))
    if args.chunks < 1:
        parser.error(f"--chunks must be >= 1, got {args.chunks}.")
    try:
        captured = capture(model)
    except CaptureError as err:
        parser.error(str(err))
    sample_args, sample_kwargs = scatter(inputs, args.chunks)[0]
    optimizer = _optimizer(model)
    profile = profile_graph(captured, sample_args, sample_kwargs, optimizer=optimizer)
    print(f"profiled {len(profile.nodes)} nodes on {profile.device} at micro-batch {profile.microbatch_size}; "
          f"{len(capacities)} stages, {args.schedule}, {args.chunks} micro-batches\n")
    for name in PARTITIONERS:
        try:
            chosen = make_plan(profile, capacities, name, args.schedule, args.chunks, args.host_bandwidth)
            largest = max_microbatch(profile, capacities, name, args.schedule, args.chunks, args.host_bandwidth)
            print(f"== {name}: largest micro-batch that fits: {largest}")
            print(chosen.table() + "\n")
        except InfeasiblePlanError as err:
            print(f"== {name}: does not fit: {err}\n")
    return 0


def _model(args: argparse.Namespace) -> torch.nn.Module:
    if args.config:
        with open(args.config) as f:
            section = (yaml.safe_load(f) or {}).get("model") or {}
        path, init = section.get("class_path"), section.get("init_args") or {}
        if path is None:
            raise ValueError(f"{args.config} has no model.class_path.")
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.config)))
    elif args.model:
        path = args.model
        try:
            init = json.loads(args.init_args)
        except json.JSONDecodeError as err:
            raise ValueError(f"--init-args is not a JSON object: {err}") from None
    else:
        raise ValueError("give --model CLASS_PATH or --config FILE.")
    sys.path.insert(0, os.getcwd())  # user modules next to where the command runs
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"cannot import {path!r}: give a class path such as examples.models.GPT.") from None
    return cls(**init)


def _inputs(specs: list[str], model: torch.nn.Module) -> tuple[tuple, dict[str, Any]]:
    if not specs:
        example = getattr(model, "example_input_array", None)
        if example is None:
            raise ValueError("give the batch with --input NAME=DTYPE[SHAPE] (the model has no example_input_array).")
        return (example if isinstance(example, tuple) else (example,)), {}
    kwargs: dict[str, Any] = {}
    for spec in specs:
        match = re.fullmatch(r"([\w.]+)=(\w+)\[([\d,\s]+)\]", spec.strip())
        if match is None or match.group(2) not in _DTYPES:
            raise ValueError(
                f"cannot read --input {spec!r}: use NAME=DTYPE[SHAPE] with DTYPE one of "
                f"{sorted(_DTYPES)}, e.g. image=float32[16,3,32,32]."
            )
        name, dtype, shape = match.group(1), _DTYPES[match.group(2)], [int(d) for d in match.group(3).split(",")]
        value = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
        *parents, leaf = name.split(".")
        target = kwargs
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return (), kwargs


def _devices(spec: str) -> list[int]:
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(.+)", spec)
    if match:
        if int(match.group(1)) < 1:
            raise ValueError(f"--devices {spec!r} has no stages.")
        return [parse_bytes(match.group(2))] * int(match.group(1))
    return [parse_bytes(part) for part in spec.split(",")]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer | None:
    """The model's own optimizer when it configures one, for optimizer-state bytes."""
    try:
        configured = model.configure_optimizers()
    except Exception:
        return None
    first = configured[0] if isinstance(configured, (list, tuple)) else configured
    first = first[0] if isinstance(first, (list, tuple)) else first
    if isinstance(first, dict):
        first = first.get("optimizer")
    return first if isinstance(first, torch.optim.Optimizer) else None


if __name__ == "__main__":
    sys.exit(main())
