"""Real FSDP2 inside a real pipeline on CPU: per-rank peak bytes of training steps of a block
model split into the stages of a plan made for ``data_parallel="fsdp"`` (:func:`write_plans`),
each sharded by the runtime's :func:`~lightning_pipe.runtime.fsdp.shard_stages` into the plan's
units with its ``reshard_after_forward`` (:func:`~lightning_pipe.runtime.fsdp.planned_shardings`)
over its replicas, and driven by ``torch.distributed.pipelining``'s 1F1B, as
``runtime="distributed"`` drives them (every backward without reducing, one reduce-scatter at
the step's end). Counted as the project's :class:`~lightning_pipe.measure.meter.MemoryMeter`
counts (:class:`Live`): every storage an operator makes, from before the stage is built (on
the meta device, then materialised shard by shard) to the end of the last step, while it
lives, at its size after each operator. (The CPU allocator's events miss frees that gloo's
threads make, dropping a collective's buffers, at random: they drift by blocks.)

:func:`spawned` is one rank of a group it makes (``tests/plan/test_sharding.py``);
:func:`measure` runs on a group already made (the four-rank launch,
``tests/lightning/distributed_fit.py``). Each rank writes its peak per plan to
``out/fsdp-peaks-pp{P}-dp{D}-rank{r}.json``.
"""

import gc
import json
import os
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from lightning_pipe.plan.plan import Plan, make_plan, planning_stages
from lightning_pipe.plan.profile import Profile, block_of
from lightning_pipe.plan.request import PlanRequest
from lightning_pipe.plan.sharding import Sharding

WIDTH, HIDDEN, BLOCKS, ROWS, CHUNKS = 1024, 4096, 4, 64, 4  # a block: 33.6 MB of fp32 parameters


class Blocks(nn.Module):
    """Blocks of two linear layers, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH)) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return loss(self.head(x))


class Stage(nn.Module):
    """Blocks of a :class:`Blocks`, and its head where ``last``."""

    def __init__(self, root: Blocks, blocks: list[int], last: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(root.layers[k] for k in blocks)
        self.head = root.head if last else None

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if self.head is None else self.head(x)


def loss(output: Tensor, target: Any = None) -> Tensor:
    return output.square().mean()


def batch() -> Tensor:
    return torch.randn(ROWS, WIDTH)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), foreach=False)


def profile(precision: str = "32-true") -> Profile:
    """The model's profile at one micro-batch, under the Trainer ``precision``'s autocast."""
    from lightning_pipe.graph.capture import capture
    from lightning_pipe.measure.profiler import profile_graph

    torch.manual_seed(0)
    model, x = Blocks(), batch()[: ROWS // CHUNKS]
    with torch.no_grad():
        captured = capture(model, example_inputs=((x,), {}))
    mixed = precision == "bf16-mixed"
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if mixed else nullcontext():
        return profile_graph(captured, (x,), optimizer=optimizer(model), repeats=1, warmup=0)


def plans(pp: int, dp: int, mixed: bool = False) -> dict[str, Plan]:
    """The plan for ``pp`` stages each sharded over ``dp`` replicas (no recompute: each stage
    keeps it all), by ``reshard_after_forward``: the planner's (kept gathered, ``"False"``), and
    its stages resharded after forward as the planner prices them (``"True"``); ``mixed``: and
    the planner's under ``bf16-mixed`` (``"bf16-mixed"``: gathered in bfloat16, reduced in fp32)."""
    found = profile()
    asked = PlanRequest([2**40] * pp, "dawnpiper", "1f1b", CHUNKS, optimise_memory=False, carry=True, replicas=dp,
                        data_parallel="fsdp")
    kept = make_plan(found, asked)
    again = planning_stages(found, asked, sharding=Sharding(found, dp, CHUNKS, None, resharded=True))
    optima = again.pruned(kept.balance)
    stages = [replace(s, reshard_after_forward=True, peak=o.peak) for s, o in zip(kept.stages, optima)]
    made = {"False": kept, "True": replace(kept, stages=stages)}
    if mixed:
        made["bf16-mixed"] = replace(make_plan(profile("bf16-mixed"), asked), precision="bf16-mixed")
    return made


def write_plans(out: Path, pp: int, dp: int, mixed: bool = False) -> dict[str, Plan]:
    """:func:`plans`, written where :func:`measure` reads them."""
    made = plans(pp, dp, mixed)
    Path(out, f"fsdp-plans-pp{pp}-dp{dp}.json").write_text(json.dumps({k: p.to_json() for k, p in made.items()}))
    return made


def spawned(index: int, world: int, pp: int, out: str, port: int) -> None:
    """One of ``world`` ranks spawned on this host: a gloo group, then :func:`measure`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=index, world_size=world)
    measure(Path(out), pp)
    dist.destroy_process_group()


def measure(out: Path, pp: int) -> None:
    """On the default group, ``pp`` stages over its ranks each sharded over the rest, by each
    plan :func:`write_plans` wrote: this rank's peak (:func:`peak`)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    written = json.loads(Path(out, f"fsdp-plans-pp{pp}-dp{dp}.json").read_text())
    peaks = {key: peak(mesh, Plan.from_json(text)) for key, text in written.items()}
    Path(out, f"fsdp-peaks-pp{pp}-dp{dp}-rank{rank}.json").write_text(json.dumps(peaks))


def peak(mesh: Any, plan: Plan) -> int:
    """This rank's stage of ``plan`` built on the meta device, sharded as planned (in the
    plan's precision, as the runtime takes it from the Trainer's), materialised, and three
    steps of 1F1B run: the highest bytes alive (:class:`Live`) from before it was built (the
    second and third steps hold the optimizer's state)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from lightning_pipe.runtime.fsdp import mixed_precision, planned_shardings, shard_stages

    index, pp = mesh.get_coordinate()[0], mesh.size(0)
    report = plan.stages[index]
    names = plan.nodes[report.start:report.stop]
    blocks = sorted({int(b.rsplit("_", 1)[1]) for n in names if (b := block_of(n))})
    assert all(block_of(n) or n in ("head", "square", "mean") for n in names), names  # cut between blocks
    planned = planned_shardings(plan)
    assert planned is not None
    gc.collect()
    dist.barrier()
    live = Live()
    with live:
        torch.manual_seed(0)
        with torch.device("meta"):
            root = Blocks()
        stage = Stage(root, blocks, index == pp - 1)
        shard_stages([stage], root, mesh["dp"], mixed_precision(plan.precision), [planned[index]])
        stage.to_empty(device="cpu")
        with torch.no_grad():
            for p in stage.parameters():
                p.to_local().normal_(0, 0.02)
        pipe = PipelineStage(stage, index, pp, torch.device("cpu"), group=mesh.get_group("pp"))
        schedule = Schedule1F1B(pipe, CHUNKS, loss_fn=loss)
        adam = optimizer(stage)
        x = batch() if index == 0 else None
        target = torch.zeros(ROWS, 1) if index == pp - 1 else None  # (the loss reads none: pipelining asks one)
        mixed = plan.precision == "bf16-mixed"
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if mixed else nullcontext()
        for _ in range(3):
            with autocast:  # (the Trainer's step context)
                if x is not None:
                    schedule.step(x, target=target)
                else:
                    schedule.step(target=target)
            adam.step()
            adam.zero_grad(set_to_none=True)
    dist.barrier()
    return live.peak


class Live(TorchDispatchMode):
    """The highest sum of the bytes of the storages operators made (a sharded tensor's: its
    shard) that are alive, summed after each operator: FSDP frees and refills its gathered
    parameters' storages in place (``resize_``), which no operator makes."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            t = t._local_tensor if isinstance(t, DTensor) else t
            if isinstance(t, Tensor) and t.device.type == "cpu":
                self.seen[t.untyped_storage()] = None
        self.peak = max(self.peak, sum(s.nbytes() for s in list(self.seen.keys())))
        return out


def compared(out: Path, pp: int, dp: int) -> list[tuple[str, int, int, int]]:
    """Per plan :func:`write_plans` wrote and rank: its key, the rank, its stage's predicted
    peak and the peak :func:`measure` wrote."""
    written = json.loads(Path(out, f"fsdp-plans-pp{pp}-dp{dp}.json").read_text())
    found = []
    for rank in range(pp * dp):
        measured = json.loads(Path(out, f"fsdp-peaks-pp{pp}-dp{dp}-rank{rank}.json").read_text())
        for key, text in written.items():
            found.append((key, rank, Plan.from_json(text).stages[rank // dp].peak.total, measured[key]))
    return found
