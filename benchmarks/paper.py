"""DawnPiper's Tables 1 and 2 at paper scale without a GPU: the largest micro-batch that trains
on 4 and 8 A100-40GB, by fake execution on this CPU.

    python -m benchmarks.paper           # the tables' settings (GPipe, 2BW; time and dawnpiper)
    python -m benchmarks.paper --full    # also 1F1B and the params, uniform and capslog partitioners (hours)
    python -m benchmarks.paper --models bert unet    # a part of the grid (minutes; the default run: 19)
    python -m benchmarks.paper --models amoebanet    # the paper's CNN, AmoebaNet-D (about 9 minutes)
    python -m benchmarks.paper --precision bf16-mixed --models bert gpt2    # Lightning's bf16-mixed (48 minutes)
    python -m benchmarks.paper --models bert gpt2 --schedules all    # the distributed engine's schedules and "auto"
    python -m benchmarks.paper --bounds    # B_agg of every row of the results file again (no fake run)

BERT-large (seq 512), GPT-2 large (seq 1024) and T5-large (seq 512) are built from their
``transformers`` configs, AmoebaNet-D at the paper's 28M parameters from ``benchmarks.amoebanet``
and a U-Net of 25M parameters from ``examples.models`` (224x224 images, both), all on the meta
device: nothing is allocated. Each is captured and
profiled on fake tensors, its times the A100-40GB's roofline. For every configuration
(stages, schedule, memory optimisation on or off, partitioner) the planner predicts the
largest micro-batch its plan fits in (91% of 40 GiB per stage, Adam in fp32, one micro-batch
per stage as the paper's synchronous runs); a fake execution of that plan under the meter's
40 GiB cap per stage (:mod:`lightning_pipe.runtime.fake`) confirms it, and where the meter
refuses, smaller sizes are tried until one trains. The size above is refused by the planner.
``--precision bf16-mixed`` profiles and runs the training step under CUDA's autocast to
bfloat16 (on the CPU, :mod:`lightning_pipe.autocast`), parameters, gradients and Adam in fp32.
Writes ``benchmarks/paper_results.json`` and ``docs/paper-scale.md``.
"""

import argparse
import datetime
import itertools
import json
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import Tensor, nn
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

import lightning_pipe
from benchmarks import fsdp_scale
from benchmarks.amoebanet import AmoebaNetD
from benchmarks.run import quiet
from examples.models import UNet
from lightning_pipe.cli import PRECISIONS
from lightning_pipe.graph.capture import Captured, capture
from lightning_pipe.internals import tree_map
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.auto import CANDIDATES
from lightning_pipe.plan.devices import DEVICES, DeviceSpec
from lightning_pipe.plan.memory import CostModel
from lightning_pipe.plan.optimize import optimize_stage
from lightning_pipe.plan.partitioners import PARTITIONERS
from lightning_pipe.plan.plan import (
    PLANNING_HEADROOM,
    InfeasiblePlanError,
    Plan,
    fitting_plan,
    largest_plan,
)
from lightning_pipe.plan.profile import Profile
from lightning_pipe.plan.request import PlanRequest, PlanSchedule
from lightning_pipe.plan.schedule import Schedule, check_schedule, in_flight, weight_versions
from lightning_pipe.runtime.distributed import silent_mesh
from lightning_pipe.runtime.fake import TrainingStep, fake_rank_training, fake_training, meta_copy

ROOT = Path(__file__).resolve().parent.parent
DEVICE = DEVICES["A100-40GB"]
PROFILED = 2  # micro-batch of the profile; the planner scales it to other sizes
PROBES = 5  # fake runs per configuration at most


@dataclass
class Workload:
    """A model at one input shape: built on the meta device, with a batch of meta tensors."""

    name: str
    label: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, Tensor]]
    inputs: Callable[[dict[str, Tensor]], tuple[tuple[Any, ...], dict[str, Any]]]  # forward's arguments
    step: TrainingStep


def _tokens(seq: int) -> Callable[[int], dict[str, Tensor]]:
    def batch(n: int) -> dict[str, Tensor]:
        ids = torch.zeros(n, seq, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids}

    return batch


def _keywords(batch: dict[str, Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (), batch


def _hf_loss(forward: Callable[..., Any], batch: dict[str, Tensor]) -> Tensor:
    return forward(**batch).loss


def _images(n: int) -> dict[str, Tensor]:
    image = torch.zeros(n, 3, 224, 224, device="meta")
    return {"image": image, "target": image}


def _denoising_loss(forward: Callable[..., Any], batch: dict[str, Tensor]) -> Tensor:
    return F.mse_loss(forward(batch["image"]), batch["target"])


def _labelled_images(n: int) -> dict[str, Tensor]:
    image = torch.zeros(n, 3, 224, 224, device="meta")
    return {"image": image, "label": torch.zeros(n, dtype=torch.long, device="meta")}


def _classification_loss(forward: Callable[..., Any], batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(forward(batch["image"]), batch["label"])


def _image(batch: dict[str, Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (batch["image"],), {}


def _hf(model: Callable[[Any], nn.Module], config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.device("meta"):
            return model(config)

    return build


def paper_models() -> dict[str, Workload]:
    """The paper's four models at its shapes, and a U-Net: a CNN with long skips."""
    t = transformers
    bert = t.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    gpt2 = t.GPT2Config(n_layer=36, n_embd=1280, n_head=20, n_positions=1024, use_cache=False)
    t5 = t.T5Config(d_model=1024, d_ff=4096, num_layers=24, num_decoder_layers=24, num_heads=16, d_kv=64,
                    use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    workloads = [
        Workload("bert", "BERT-large, seq 512", _hf(t.BertForMaskedLM, bert), _tokens(512), _keywords, _hf_loss),
        Workload("gpt2", "GPT-2 large, seq 1024", _hf(t.GPT2LMHeadModel, gpt2), _tokens(1024), _keywords, _hf_loss),
        Workload("t5", "T5-large, seq 512", _hf(t.T5ForConditionalGeneration, t5), _tokens(512), _keywords, _hf_loss),
        Workload("amoebanet", "AmoebaNet-D 28M, 224x224", _amoebanet, _labelled_images, _image, _classification_loss),
        Workload("unet", "U-Net 25M, 224x224", _unet, _images, _image, _denoising_loss),
    ]
    return {w.name: w for w in workloads}


def _amoebanet() -> nn.Module:
    """28M parameters, the paper's size for it (it does not give the cells and filters):
    GPipe's 6 normal cells per stack with 120 filters."""
    with torch.device("meta"):
        return AmoebaNetD(normal=6, filters=120)


def _unet() -> nn.Module:
    with torch.device("meta"):
        return UNet(channels=40, depth=5)


PAPER_MODELS = ("bert", "gpt2", "t5", "amoebanet")  # the paper's tables' columns
MODELS = (*PAPER_MODELS, "unet")


@dataclass
class Settings:
    """Which configurations run."""

    models: list[str]
    stages: list[int]
    schedules: list[str]
    partitioners: list[str]
    memopt: list[bool] = field(default_factory=lambda: [False, True])
    precision: str = "32-true"


QUICK = Settings(["bert", "gpt2", "t5", "unet"], [4, 8], ["gpipe", "2bw"], ["time", "dawnpiper"])
FULL = Settings(list(MODELS), [4, 8], ["gpipe", "1f1b", "2bw"], list(PARTITIONERS))


@dataclass
class Row:
    """One configuration: the largest micro-batch that trained under fake execution, and the
    planner's prediction."""

    model: str
    stages: int
    schedule: str
    memopt: bool
    partitioner: str
    chunks: int
    max_microbatch: int  # 0: not even one trains
    predicted: int  # the planner's largest micro-batch (0: none fits)
    batch: int = 0  # max_microbatch x chunks, the paper's "batch size"
    fake_peak_gib: float = 0.0  # the fullest stage's metered peak at max_microbatch
    predicted_peak_gib: float = 0.0  # the plan's prediction for it
    fake_runs: int = 0  # fake executions this row needed
    refused: list[int] = field(default_factory=list)  # sizes over the device's memory on a stage
    exact: bool = True  # max_microbatch + 1 did not train (else PROBES ran out first)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # CPU time of the process measuring it
    precision: str = "32-true"  # the Trainer's: "32-true" or "bf16-mixed"
    b_agg: int = 0  # aggregate_bound of the row's settings (0: not computed yet, see --bounds)
    # rows of --schedules (the distributed engine): its plan at max_microbatch
    step_ms: float = 0.0  # simulated step (0: not simulated)
    samples_per_s: float = 0.0  # max_microbatch x chunks per simulated step
    virtual_stages: int = 1  # stages per process
    picked: str = ""  # "auto": the schedule and stages per process it picked


PAPER_PRECISIONS = ("32-true", "bf16-mixed")

# (name, label, device, precision): a workload's model, graph and profile, made once per process
# (a run over several stage counts, or several runs, measure one profile; a fake run copies the model)
_PROFILED: dict[tuple[str, str, str, str], tuple[nn.Module, Captured, Profile]] = {}


class Bench:
    """One workload at one precision, captured and profiled once, measured in many configurations.

    Under ``bf16-mixed`` the profile and every fake run are under CUDA's autocast policy on the
    CPU (a recompute casts again in the backward), the training step under CPU autocast: it
    casts tensors on the CPU, never meta ones. So the profiled model's parameters and inputs
    stand on the CPU, uninitialised (a fake profile reads no page), and fake runs use fake CPU
    tensors."""

    def __init__(self, workload: Workload, device: DeviceSpec, precision: str = "32-true") -> None:
        self.workload = workload
        self.device = device
        self.precision = PRECISIONS[precision]
        key = (workload.name, workload.label, repr(device), precision)
        if key not in _PROFILED:
            model = workload.build().train()
            inputs = workload.inputs(workload.batch(PROFILED))
            with quiet():
                captured = capture(model, example_inputs=inputs)
                if self.precision.autocast is not None:
                    _on_cpu(model)
                    inputs = tree_map(lambda t: torch.empty_like(t, device="cpu") if isinstance(t, Tensor) else t,
                                      inputs)
                with self.precision.policy(), self.precision.step():
                    profile = profile_graph(captured, *inputs, optimizer=self._optimizer(model), fake=True,
                                            device=device)
            _PROFILED[key] = model, captured, profile
        self.model, self.captured, self.profile = _PROFILED[key]
        self._runs: dict[tuple[Any, ...], list[int]] = {}
        self._bounds: dict[tuple[Any, ...], int] = {}
        self._plans: dict[tuple[Any, ...], Plan | None] = {}  # distributed plans: auto weighs the rows' again

    @staticmethod
    def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
        """Adam as a GPU runs it: ``foreach``, its default there (a fake run's tensors are on
        the meta device, where it steps parameter by parameter), whose temporaries are a
        stage's square roots."""
        return torch.optim.Adam(model.parameters(), foreach=True)

    def _step(self, forward: Callable[..., Any], batch: dict[str, Tensor]) -> Tensor:
        """The workload's training step (forward and loss) in the precision's context, as
        Lightning's precision plugin runs it."""
        with self.precision.step():
            return self.workload.step(forward, batch)

    def plan(self, stages: int, schedule: str, memopt: bool, partitioner: str, microbatch: int) -> Plan | None:
        """The strategy's plan at ``microbatch``, or ``None`` where the planner refuses."""
        return fitting_plan(self.profile.scaled(microbatch), self._request(stages, schedule, memopt, partitioner))

    def largest(self, stages: int, schedule: str, memopt: bool, partitioner: str, at_least: int = 0) -> Plan | None:
        """The planner's plan at its largest micro-batch (``None``: none fits), the search started
        from ``at_least`` where given: a size known to fit (dawnpiper fits whatever another
        partitioner's plan fits)."""
        try:
            return largest_plan(self.profile, self._request(stages, schedule, memopt, partitioner),
                                at_least=max(at_least, 1))
        except InfeasiblePlanError:
            return None

    def run(self, plan: Plan, schedule: str) -> list[int]:
        """Each stage's metered peak in a fake execution of ``plan``. The meter runs without
        capacities, so that a refused size still says by how much: a capped meter refuses a
        run exactly when a stage's peak would pass its capacity, and stops there."""
        key = (schedule, plan.microbatch_size, tuple(plan.balance), tuple(plan.policies))
        if key not in self._runs:
            policies = {n.name: p for n, p in zip(self.captured.nodes, plan.policies) if p != "keep"}
            batch = self.workload.batch(plan.microbatch_size * plan.chunks)
            model, graph = meta_copy(self.model, self.captured)  # a model runs fake once
            with self.precision.policy():
                meter = fake_training(model, graph, batch, self._step, self._optimizer(model), plan.balance,
                                      policies, schedule=schedule, chunks=plan.chunks,
                                      tensors="meta" if self.precision.autocast is None else "cpu",
                                      cuda=self.device.cuda)
            self._runs[key] = meter.peaks()
        return self._runs[key]

    def _request(self, stages: int, schedule: str, memopt: bool, partitioner: str) -> PlanRequest:
        """What the strategy asks of the planner on ``stages`` of this device: ``stages``
        micro-batches, each stage planned to the device's memory times the headroom."""
        return PlanRequest([int(self.device.memory * PLANNING_HEADROOM)] * stages, partitioner, schedule, stages,
                           self.device.host_bandwidth, self.device.link_bandwidth, optimise_memory=memopt)

    def measure(self, stages: int, schedule: str, memopt: bool, partitioner: str, at_least: int = 0) -> Row:
        """The row of one configuration: a fake run of the predicted size, and where a stage
        goes over the device's memory, smaller sizes (each planned and run), guessed from
        the peaks measured so far, until the largest that trains is bracketed or
        :data:`PROBES` runs are spent."""
        start, cpu = time.perf_counter(), time.process_time()
        runs_before = len(self._runs)
        largest = self.largest(stages, schedule, memopt, partitioner, at_least)
        predicted = largest.microbatch_size if largest else 0
        row = Row(self.workload.name, stages, schedule, memopt, partitioner, stages, 0, predicted,
                  precision=self.precision.name)
        low, high = 0, predicted + 1  # low trains (0: none yet), high does not (the planner refuses it)
        peaks: dict[int, int] = {}  # size -> the fullest stage's metered peak
        size = predicted
        while high - low > 1 and len(peaks) < PROBES:
            plan = largest if size == predicted else self.plan(stages, schedule, memopt, partitioner, size)
            if plan is not None:
                peaks[size] = max(self.run(plan, schedule))
            if plan is not None and peaks[size] <= self.device.memory:
                low = size
                row.fake_peak_gib = peaks[size] / 2**30
                row.predicted_peak_gib = max(s.peak.total for s in plan.stages) / 2**30
            else:
                high = size
                row.refused.append(size)
            size = _next_size(low, high, peaks, self.device.memory)
        row.max_microbatch, row.batch, row.exact = low, low * stages, high - low == 1
        row.b_agg = self.bound(row)
        row.fake_runs = len(self._runs) - runs_before
        row.seconds, row.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        return row

    def bound(self, row: "Row") -> int:
        """:func:`aggregate_bound` of ``row``'s settings: the largest over its schedules (cached
        per schedule: it does not depend on the partitioner, and ``"auto"``'s candidates are
        the other rows' schedules)."""
        devices = self.device.memory * row.stages
        for s, v in (found := _bounded_schedules(row.schedule, row.stages, row.chunks)):
            key = (row.stages, s, v, row.memopt, row.chunks)
            if key not in self._bounds:
                self._bounds[key] = aggregate_bound(self.profile, s, row.chunks, row.stages * v, v, row.memopt,
                                                    devices, self.device.host_bandwidth, row.max_microbatch)
        return max(self._bounds[(row.stages, s, v, row.memopt, row.chunks)] for s, v in found)

    def run_ranks(self, plan: Plan) -> list[int]:
        """Each process's metered peak in a fake execution of ``plan`` on the distributed engine:
        every rank's training step on ``torch.distributed.pipelining``'s own schedule (its action
        order), one rank at a time on a silent mesh in a fake process group."""
        key = (plan.schedule, plan.virtual_stages, plan.microbatch_size, tuple(plan.balance), tuple(plan.policies))
        if key not in self._runs:
            processes = len(plan.targets)
            policies = {n.name: p for n, p in zip(self.captured.nodes, plan.policies) if p != "keep"}
            batch = self.workload.batch(plan.microbatch_size * plan.chunks)
            tensors = "meta" if self.precision.autocast is None else "cpu"
            peaks = []
            for rank in range(processes):
                dist.init_process_group("fake", rank=rank, world_size=processes, store=FakeStore())
                try:
                    model, graph = meta_copy(self.model, self.captured)
                    with quiet(), self.precision.policy():
                        meter = fake_rank_training(
                            model, graph, batch, self.workload.inputs(batch),
                            lambda output, microbatch: self.workload.step(lambda *_, **__: output, microbatch),
                            self._optimizer(model), plan.balance, policies, silent_mesh(processes, 1),
                            schedule=plan.schedule, chunks=plan.chunks, tensors=tensors,
                            step_context=self.precision.step, cuda=self.device.cuda)
                finally:
                    dist.destroy_process_group()
                peaks.append(meter.stages[0].peak)
            self._runs[key] = peaks
        return self._runs[key]

    def _distributed_request(self, processes: int, label: str, memopt: bool) -> PlanRequest:
        """What the strategy asks of the planner under ``runtime="distributed"`` on ``processes``
        of this device: :data:`DISTRIBUTED_CHUNKS` micro-batches per process."""
        schedule, virtual = DISTRIBUTED[label]
        return PlanRequest([int(self.device.memory * PLANNING_HEADROOM)] * processes, "dawnpiper", schedule,
                           DISTRIBUTED_CHUNKS * processes, self.device.host_bandwidth, self.device.link_bandwidth,
                           optimise_memory=memopt, carry=True, virtual_stages=None if label == "auto" else virtual)

    def distributed_plan(self, processes: int, schedule: PlanSchedule, virtual: int, memopt: bool,
                         size: int) -> Plan | None:
        """:func:`fitting_plan` of ``schedule`` with ``virtual`` stages per process at ``size``
        (``None``: it does not fit), as :meth:`measure_distributed` asks it (cached)."""
        key = (processes, schedule, virtual, memopt, size)
        if key not in self._plans:
            request = replace(self._distributed_request(processes, "auto", memopt), schedule=schedule,
                              virtual_stages=virtual)
            self._plans[key] = fitting_plan(self.profile.scaled(size), request)
        return self._plans[key]

    def auto_plan(self, processes: int, memopt: bool, size: int) -> Plan | None:
        """``schedule="auto"``'s pick at ``size`` (``None``: no candidate fits): the fastest
        simulated step among the :data:`~lightning_pipe.plan.auto.CANDIDATES` torch runs, the
        first of equals, as :func:`~lightning_pipe.plan.auto.auto_plan` picks; made of
        :meth:`distributed_plan`'s plans (the other rows planned some) without the reasons
        auto's plan gives for the candidates that do not fit, which the row does not show and
        which cost more than a plan."""
        found = [p for s, v in _bounded_schedules("auto", processes, DISTRIBUTED_CHUNKS * processes)
                 if (p := self.distributed_plan(processes, s, v, memopt, size)) is not None]
        return min(found, key=lambda p: p.step_ms, default=None)

    def measure_distributed(self, processes: int, label: str, memopt: bool, at_least: int = 0) -> Row:
        """The row of one schedule of :data:`DISTRIBUTED` on ``processes`` devices (dawnpiper):
        as :meth:`measure`, each size planned for the distributed engine and run fake rank by
        rank (:meth:`run_ranks`); ``"auto"`` is planned at ``at_least`` (the micro-batch of the
        fastest of the other rows, in samples per second) and below, where
        :func:`~lightning_pipe.plan.auto.auto_plan` picks the fastest simulated step among its
        candidates: at least as fast as that row's."""
        start, cpu = time.perf_counter(), time.process_time()
        runs_before = len(self._runs)
        request = self._distributed_request(processes, label, memopt)

        def planned(size: int) -> Plan | None:
            if label == "auto":
                return self.auto_plan(processes, memopt, size)
            return self.distributed_plan(processes, *DISTRIBUTED[label], memopt, size)

        if label == "auto":
            largest = planned(at_least) if at_least else None
        else:
            try:
                largest = largest_plan(self.profile, request, at_least=max(at_least, 1))
            except InfeasiblePlanError:
                largest = None
            if largest is not None:  # fitting_plan's at its size
                self._plans[(processes, *DISTRIBUTED[label], memopt, largest.microbatch_size)] = largest
        predicted = largest.microbatch_size if largest else 0
        row = Row(self.workload.name, processes, label, memopt, "dawnpiper", request.chunks, 0, predicted,
                  precision=self.precision.name, virtual_stages=request.virtual)
        low, high = 0, predicted + 1
        peaks: dict[int, int] = {}
        size, fitted = predicted, None
        while high - low > 1 and len(peaks) < PROBES:
            plan = largest if size == predicted else planned(size)
            if plan is not None:
                peaks[size] = max(self.run_ranks(plan))
            if plan is not None and peaks[size] <= self.device.memory:
                low, fitted = size, plan
                row.fake_peak_gib = peaks[size] / 2**30
                row.predicted_peak_gib = max(plan.process_peaks()) / 2**30
            else:
                high = size
                row.refused.append(size)
            size = _next_size(low, high, peaks, self.device.memory)
        row.max_microbatch, row.batch, row.exact = low, low * request.chunks, high - low == 1
        if fitted is not None:
            row.step_ms = fitted.step_ms
            row.samples_per_s = low * request.chunks * 1e3 / fitted.step_ms
            row.virtual_stages = fitted.virtual_stages
            row.picked = f"{fitted.schedule} x{fitted.virtual_stages}" if label == "auto" else ""
        row.b_agg = self.bound(row)
        row.fake_runs = len(self._runs) - runs_before
        row.seconds, row.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        return row


def _on_cpu(model: nn.Module) -> None:
    """``model``'s meta parameters and buffers made uninitialised CPU tensors in place: the
    same objects, so the captured graph holds them and tied weights stay tied (``to_empty``
    makes new parameters, one per module holding it)."""
    for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        empty = torch.empty_like(t, device="cpu")
        torch.utils.swap_tensors(t, nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty)


def _next_size(low: int, high: int, peaks: dict[int, int], memory: int) -> int:
    """The size to try between ``low`` (trains) and ``high`` (does not): where the peak,
    straight between the two measured sizes around the answer (or from nothing to ``high``),
    meets ``memory``; bisection where that falls outside."""
    if high in peaks and peaks[high] > peaks.get(low, 0):
        base = peaks.get(low, 0)
        guess = low + (memory - base) * (high - low) // (peaks[high] - base)
        if low < guess < high:
            return guess
    return (low + high) // 2

# --- issue #48: the distributed engine's schedules, and the aggregate-memory bound ------------

#: The rows of ``--schedules``: each runs on the distributed engine (one process per device),
#: as (schedule, stages per process); ``"dist-1f1b"`` is 1F1B there, the baseline ``"auto"``
#: is held against at the same micro-batches, and ``"auto"`` the planner's pick.
DISTRIBUTED: dict[str, tuple[PlanSchedule, int]] = {
    "dist-1f1b": ("1f1b", 1), "interleaved-1f1b": ("interleaved-1f1b", 2), "interleaved-zb": ("interleaved-zb", 2),
    "zbv": ("zbv", 2), "dualpipev": ("dualpipev", 2), "auto": ("auto", 1),
}
#: Micro-batches per process of a ``--schedules`` row: zero-bubble and V-shape schedules need
#: at least two per process (DualPipeV one per stage), so all run two.
DISTRIBUTED_CHUNKS = 2
#: Every schedule a row may have, in the page's order.
SCHEDULE_ORDER = ("gpipe", "1f1b", "2bw", *DISTRIBUTED)


def aggregate_bound(profile: Profile, schedule: Schedule, chunks: int, stages: int, virtual: int, memopt: bool,
                    memory: int, host_bandwidth: float | None, near: int = 1) -> int:
    """B_agg: the largest micro-batch whose bytes, every stage's together, fit ``memory`` (all
    the devices' memory summed). The whole model is priced as one stage by the planner's cost
    model (:class:`~lightning_pipe.plan.memory.CostModel`, ``schedule`` with ``chunks``
    micro-batches, its weight versions), holding as many micro-batches as the stage of
    ``schedule`` over ``stages`` (``virtual`` per process) that holds the fewest
    (:func:`~lightning_pipe.plan.schedule.in_flight`): every stage holds at least that many,
    so no split's stages together hold less. With ``memopt`` the memory optimiser may recompute
    and swap over ``host_bandwidth`` to get the stage under ``memory``, as a row's planner
    does per stage; without, every activation is kept. Per-device limits, what crosses a
    cut (boundaries, receive buffers) and the optimiser's cost in time are left out: a split
    adds to each, so no row's plan should train a larger micro-batch (0: not even one fits).
    ``near``: a size likely to fit (a row's max), where the search starts doubling."""
    held = min(in_flight(schedule, chunks, stages, virtual))
    versions = weight_versions(schedule)

    @cache  # (near is probed twice where it fits)
    def fits(size: int) -> bool:
        model = CostModel(profile.scaled(size), schedule=schedule, chunks=chunks)
        return optimize_stage(model, 0, model.n, held, memory, versions, host_bandwidth, memopt).fits

    return fsdp_scale.largest_fitting(fits, near if near > 1 and fits(near) else 1)


def _bounded_schedules(label: str, processes: int, chunks: int) -> list[tuple[Schedule, int]]:
    """The (schedule, stages per process) a row's bound is the largest of: its own, or under
    ``"auto"`` every candidate that can run ``chunks`` micro-batches."""
    if label not in DISTRIBUTED:
        return [(label, 1)]
    if label != "auto":
        return [DISTRIBUTED[label]]
    found = []
    for schedule, virtual in CANDIDATES:
        try:
            check_schedule(schedule, chunks, processes * virtual, virtual, distributed=True)
        except ValueError:
            continue
        found.append((schedule, virtual))
    return found


# --- the run --------------------------------------------------------------------------------


def measure_group(bench: Bench, stages: int, schedule: str, memopt: bool, partitioners: Sequence[str]) -> list[Row]:
    """Every partitioner's row in one (stages, schedule, memopt) group, dawnpiper's last: its
    search starts from the largest size another partitioner's plan fits."""
    done: list[Row] = []
    for partitioner in sorted(partitioners, key=lambda p: p == "dawnpiper"):
        at_least = max((r.predicted for r in done), default=0) if partitioner == "dawnpiper" else 0
        done.append(bench.measure(stages, schedule, memopt, partitioner, at_least))
    return sorted(done, key=lambda r: list(partitioners).index(r.partitioner))


def measure_stages(workload: Workload, stages: int, settings: Settings, device: DeviceSpec) -> list[Row]:
    """Every configuration of one workload over ``stages`` stages."""
    bench = Bench(workload, device, settings.precision)
    return [r for schedule in settings.schedules for memopt in settings.memopt
            for r in measure_group(bench, stages, schedule, memopt, settings.partitioners)]


_BENCHES: dict[str, Bench] = {}  # built before the workers fork, so each model is profiled once


def _paper_task(task: tuple[str, int, str, bool, list[str]]) -> list[Row]:
    name, stages, schedule, memopt, partitioners = task
    return measure_group(_BENCHES[name], stages, schedule, memopt, partitioners)


def measure_schedules(bench: Bench, processes: int, memopt: bool, labels: Sequence[str]) -> list[Row]:
    """The rows of ``labels`` (of :data:`DISTRIBUTED`) on ``processes`` devices, ``"auto"``
    last: it is planned at the micro-batch of the fastest of the others (samples per second;
    the largest micro-batch is rarely the fastest: more of it is recomputed or swapped)."""
    rows = [bench.measure_distributed(processes, label, memopt) for label in labels if label != "auto"]
    if "auto" in labels:
        fastest = max(rows, key=lambda r: r.samples_per_s)
        rows.append(bench.measure_distributed(processes, "auto", memopt, fastest.max_microbatch))
    return rows


def _schedules_task(task: tuple[str, int, bool, list[str]]) -> list[Row]:
    name, processes, memopt, labels = task
    return measure_schedules(_BENCHES[name], processes, memopt, labels)


def run_schedules(workloads: Sequence[Workload], settings: Settings, device: DeviceSpec = DEVICE, jobs: int = 1,
                  finished_task: Callable[[list[Row]], object] = lambda rows: None) -> list[Row]:
    """``--schedules``: :func:`measure_schedules` for each workload, device count and memopt
    of ``settings`` (its ``schedules`` the labels), ``jobs`` at a time, as :func:`run`."""
    _BENCHES.update((w.name, Bench(w, device, settings.precision)) for w in workloads)
    tasks = [(w.name, s, memopt, settings.schedules) for w in workloads for s in settings.stages
             for memopt in settings.memopt]
    tasks.sort(key=lambda t: (-t[1], not t[2]))  # the longest first
    pool = multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else None
    finished = pool.imap_unordered(_schedules_task, tasks) if pool else map(_schedules_task, tasks)

    def report(part: list[Row]) -> None:
        for r in part:
            print(f"{r.model} {r.precision} x{r.stages} {r.schedule:<16} {_mo(r.memopt):<4} max {r.max_microbatch}"
                  f"{'' if r.exact else '+'} predicted {r.predicted} B_agg {r.b_agg} {r.samples_per_s:.1f}/s "
                  f"{r.picked} ({r.fake_runs} fake runs, {r.seconds:.0f} s)", flush=True)

    rows = _gathered(finished, pool, report, finished_task)
    names = [w.name for w in workloads]
    return sorted(rows, key=lambda r: (names.index(r.model), r.stages, r.memopt, SCHEDULE_ORDER.index(r.schedule)))


def fill_bounds(results: dict[str, Any], workloads: dict[str, Workload], device: DeviceSpec) -> dict[str, Any]:
    """``--bounds``: every row's B_agg (:func:`aggregate_bound`) made again from its model's
    profile, without a fake run; ``workloads``: the rows' models, by name."""
    rows = [Row(**r) for r in results["rows"]]
    for model, precision in dict.fromkeys((r.model, r.precision) for r in rows):
        bench = Bench(workloads[model], device, precision)
        for r in rows:
            if (r.model, r.precision) == (model, precision):
                r.b_agg = bench.bound(r)
    return {**results, "rows": [asdict(r) for r in rows]}


def run(workloads: Sequence[Workload], settings: Settings, device: DeviceSpec = DEVICE, jobs: int = 1,
        finished_task: Callable[[list[Row]], object] = lambda rows: None) -> list[Row]:
    """Every configuration of ``settings`` for each workload, with a progress bar. With
    ``jobs`` above one, the paper's workloads are profiled here, then ``jobs`` groups (model,
    stage count, schedule, memopt) run at a time, each in a worker process, the longest
    first: a fake run keeps one core busy, and one model's searches with memory optimisation
    take most of a run. ``finished_task`` is called with every row so far as each task (a
    group, or inline a model and stage count) ends: a run cut short keeps what it measured."""
    pool = None
    if jobs > 1:
        _BENCHES.update((w.name, Bench(w, device, settings.precision)) for w in workloads)
        groups = [(w.name, s, schedule, memopt, settings.partitioners) for w in workloads for s in settings.stages
                  for schedule in settings.schedules for memopt in settings.memopt]
        groups.sort(key=lambda g: (not g[3], -g[1], ("t5", "gpt2", "amoebanet", "bert", "unet").index(g[0]),
                                   g[2] != "2bw"))
        pool = multiprocessing.get_context("fork").Pool(jobs)
        finished: Iterable[list[Row]] = pool.imap_unordered(_paper_task, groups)
    else:
        finished = (measure_stages(w, s, settings, device) for w in workloads for s in settings.stages)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        total = len(workloads) * len(settings.stages) * len(settings.schedules) * len(settings.memopt)
        progress = bar.add_task(f"paper-scale, {jobs} at a time", total=total * len(settings.partitioners))

        def report(part: list[Row]) -> None:
            for r in part:
                bar.console.print(f"{r.model} {r.precision} x{r.stages} {r.schedule:<5} {_mo(r.memopt):<4} "
                                  f"{r.partitioner:<9} max {r.max_microbatch}{'' if r.exact else '+'} "
                                  f"predicted {r.predicted} ({r.fake_runs} fake runs, {r.seconds:.0f} s)")
            bar.advance(progress, len(part))

        rows = _gathered(finished, pool, report, finished_task)
    names = [w.name for w in workloads]
    return sorted(rows, key=lambda r: (names.index(r.model), settings.stages.index(r.stages),
                                       settings.schedules.index(r.schedule), settings.memopt.index(r.memopt),
                                       settings.partitioners.index(r.partitioner)))


def _gathered(finished: Iterable[list[Row]], pool: Any, report: Callable[[list[Row]], object],
              finished_task: Callable[[list[Row]], object]) -> list[Row]:
    """The rows of the tasks as each ends (``report`` shown them, ``finished_task`` every row
    so far: a run cut short keeps what it measured); the worker ``pool`` (``None``: inline)
    closed at the end, however it ends."""
    rows: list[Row] = []
    try:
        for part in finished:
            rows += part
            report(part)
            finished_task(list(rows))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return rows


def ratios(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per configuration, dawnpiper's largest micro-batch over each other partitioner's."""
    result = []
    for r in rows:
        if r.partitioner != "dawnpiper" or r.schedule in DISTRIBUTED:  # (those have no peers)
            continue
        peers = {p.partitioner: p.max_microbatch for p in rows if (p.model, p.precision, p.stages, p.schedule, p.memopt)
                 == (r.model, r.precision, r.stages, r.schedule, r.memopt)}
        result.append({"model": r.model, "precision": r.precision, "stages": r.stages, "schedule": r.schedule,
                       "memopt": r.memopt,
                       **{f"vs_{name}": r.max_microbatch / n if n else None
                          for name, n in peers.items() if name != "dawnpiper"}})
    return result


def merged(earlier: dict[str, Any] | None, run: dict[str, Any], device: DeviceSpec, labels: dict[str, str],
           rows: Sequence[Row]) -> dict[str, Any]:
    """The results file after ``run``: its ``rows`` replace the earlier rows of the same
    configuration and the others stay, so that the grid can be filled one part at a time (on
    one device only: an earlier file for another device is replaced). Each run is listed.
    Rows of a file from before rows had a precision are ``32-true``'s."""
    if earlier is not None and earlier.get("device", {}).get("name") != device.name:
        earlier = None
    earlier = earlier or {"runs": [], "labels": {}, "rows": []}
    new = [asdict(r) for r in rows]
    ran = {_key(r) for r in new}
    kept = [asdict(Row(**r)) for r in earlier["rows"] if _key(r) not in ran]
    every = sorted(kept + new, key=_order)
    runs = [r for r in earlier["runs"] if not _configurations(r["settings"]) <= ran]  # those with rows left
    return {"runs": [*runs, run], "device": asdict(device), "labels": {**earlier["labels"], **labels},
            "rows": every, "ratios": ratios([Row(**r) for r in every]),
            **({"fsdp": earlier["fsdp"]} if "fsdp" in earlier else {})}


def _configurations(settings: dict[str, Any]) -> set[tuple[Any, ...]]:
    """The configuration keys (:func:`_key`) a run of ``settings`` measures."""
    return set(itertools.product(settings["models"], settings["stages"], settings["schedules"], settings["memopt"],
                                 settings["partitioners"], [settings.get("precision", "32-true")]))


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["model"], row["stages"], row["schedule"], row["memopt"], row["partitioner"],
            row.get("precision", "32-true"))


def _order(row: dict[str, Any]) -> tuple[Any, ...]:
    """Models as the paper's columns, each precision's rows together, then stages, schedule,
    memopt, partitioner."""
    model = MODELS.index(row["model"]) if row["model"] in MODELS else len(MODELS)
    return (model, row["model"], PAPER_PRECISIONS.index(row["precision"]), row["stages"],
            SCHEDULE_ORDER.index(row["schedule"]), row["memopt"], list(PARTITIONERS).index(row["partitioner"]))


def _cpu_seconds(rows: Sequence[Row], workers: bool) -> float:
    """CPU time of this process and, with ``workers``, of theirs, counted per row measured: the
    system counts a worker's time only once it has exited, and a run cut short saves its rows
    before (wall time overstates a run on a machine others share)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime + (sum(r.cpu_seconds for r in rows) if workers else 0.0)


def _commit() -> str:
    """The checkout's commit (a results file may join runs of several)."""
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return found.stdout.strip() or "?"


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lightning_pipe": lightning_pipe.__version__, "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# --- the page -------------------------------------------------------------------------------

#: DawnPiper's Tables 1 and 2 (8 A100-40GB): batch sizes by (stages, memory optimisation,
#: method), for BERT, GPT-2, T5 and AmoebaNet. Table 1's memory-optimised GPipe recomputes (R),
#: the others swap and recompute (S+R).
PAPER_TABLE_1 = {
    (4, False): {"GPipe": (52, 8, 144, 280), "vPipe-S": (60, 8, 144, 188), "DPiper-S": (72, 8, 160, 360)},
    (4, True): {"GPipe": (120, 28, 348, 644), "vPipe-S": (128, 28, 348, 720), "DPiper-S": (160, 32, 424, 1220)},
    (8, False): {"GPipe": (88, 16, 256, 480), "vPipe-S": (88, 16, 256, 264), "DPiper-S": (136, 16, 320, 560)},
    (8, True): {"GPipe": (208, 48, 664, 1384), "vPipe-S": (208, 56, 664, 1424), "DPiper-S": (280, 60, 800, 2180)},
}
PAPER_TABLE_2 = {
    (4, False): {"PipeDream": (16, 2, 40, 70), "vPipe-AS": (16, 2, 40, 48), "DPiper-AS": (32, 3, 78, 150)},
    (4, True): {"vPipe-AS": (46, 8, 110, 300), "DPiper-AS": (84, 10, 192, 480)},
    (8, False): {"PipeDream": (16, 2, 44, 64), "vPipe-AS": (16, 2, 44, 32), "DPiper-AS": (40, 5, 84, 128)},
    (8, True): {"vPipe-AS": (58, 16, 144, 214), "DPiper-AS": (100, 22, 248, 528)},
}
#: Per table, the paper's method our ``time`` partitioner stands in for, and DawnPiper's row.
PAPER_PEER = {"gpipe": (PAPER_TABLE_1, "GPipe", "DPiper-S"), "2bw": (PAPER_TABLE_2, "PipeDream", "DPiper-AS")}
TITLES = {"gpipe": "Table 1: synchronous (GPipe schedule)", "1f1b": "1F1B (synchronous, not in the paper)",
          "2bw": "Table 2: asynchronous (PipeDream-2BW schedule)"}


def _cell(value: Any) -> str:
    if value is None:
        return "–"  # noqa: RUF001 (an en dash marks an empty cell)
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


def _mo(memopt: bool) -> str:
    return "S+R" if memopt else "none"


def markdown(results: dict[str, Any]) -> str:
    """The generated page: every figure of ours comes from ``results``; the paper's are its tables'."""
    rows = [Row(**r) for r in results["rows"]]
    labels, device, runs = results["labels"], results["device"], results["runs"]
    m = runs[-1]["machine"]
    models = [name for name in MODELS if name in labels]
    columns = [(name, precision) for name in models for precision in PAPER_PRECISIONS
               if any((r.model, r.precision) == (name, precision) for r in rows)]
    parts = [
        "# Paper-scale evaluation",
        "Generated by `python -m benchmarks.paper` (do not edit by hand); each run replaces its configurations' "
        "rows and keeps the others. Runs behind this page:",
        "\n".join(f"- `python -m benchmarks.{r['command']}`: {r['configurations']} configurations on "
                  f"{r['machine']['date']} in {r['seconds']:.0f} s, {_cpu_time(r['cpu_seconds'])} "
                  f"(lightning_pipe {r['machine']['lightning_pipe']}, commit {r['machine'].get('commit', '?')})"
                  for r in runs),
        f"Machine: {m['platform']}, {m['processor']}, {m['cpu_count']} CPUs; Python {m['python']}, torch "
        f"{m['torch']}, transformers {m['transformers']}.",
        "DawnPiper's memory-efficiency experiment (its Tables 1 and 2: the largest batch that trains on 4 and 8 "
        f"A100-40GB) repeated without a GPU. Models: {', '.join(labels[n] for n in models)}; Adam, fp32 unless "
        "marked bf16-mixed, one micro-batch per stage per batch (as the paper's synchronous runs), so *batch* = "
        "micro-batch x stages. "
        f"Device: {device['name']} ({device['memory'] / 2**30:g} GiB, host link "
        f"{device['host_bandwidth'] / 1e9:g} GB/s, stage link {device['link_bandwidth'] / 1e9:g} GB/s; "
        "see [the device table](#devices)).",
        "How each figure is made: the model is built from its config on the meta device, captured, and "
        "profiled on fake tensors (bytes as measured, times the device's roofline). The planner predicts the "
        f"largest micro-batch whose plan fits {PLANNING_HEADROOM:.0%} of the device per stage (*predicted*). "
        "That plan then trains by fake execution (`lightning_pipe.runtime.fake`: the real runtime, schedule, "
        "recompute, swap and Adam step on meta tensors, a short step then a steady one) and trains if every "
        "stage's metered peak stays within the device's memory, as a meter capped there decides; where a stage "
        "goes over, smaller sizes, guessed from the peaks measured so far, are planned and run until the largest "
        f"that trains is bracketed (*max*; `+`: {PROBES} runs were spent first, so it is a lower bound). One size "
        "more than the prediction is refused by the planner. *S+R*: the planner may swap and recompute "
        "(memopt on); *none*: every activation kept. Partitioners: `time` (torchgpipe's balance by time, our "
        "stand-in for GPipe's and PipeDream's splits), `params` (DeepSpeed's), `uniform`, `capslog`, `dawnpiper`.",
    ]
    if any(r.precision == "bf16-mixed" for r in rows):
        parts.append(BF16)
    for schedule in [s for s in TITLES if any(r.schedule == s for r in rows)]:
        parts.append(f"## {TITLES[schedule]}")
        parts.append("Max micro-batch that trains by fake execution (the planner's prediction); batch = micro-batch "
                     "x stages.")
        found = {(r.model, r.precision, r.stages, r.memopt, r.partitioner): r for r in rows if r.schedule == schedule}
        table = []
        for stages, memopt, partitioner in sorted({k[2:] for k in found},
                                                  key=lambda k: (k[0], k[1], list(PARTITIONERS).index(k[2]))):
            cells = [f"{r.max_microbatch}{'' if r.exact else '+'} ({r.predicted})"
                     if (r := found.get((*column, stages, memopt, partitioner))) else None for column in columns]
            table.append([stages, _mo(memopt), partitioner, *cells])
        parts.append(_table(["stages", "memopt", "partitioner", *(_column(labels, *c) for c in columns)], table))
        if schedule in PAPER_PEER:
            paper, peer, _ = PAPER_PEER[schedule]
            paper_rows = [[stages, "R" if memopt and method == "GPipe" else _mo(memopt), method, *values]
                          for (stages, memopt), methods in paper.items() for method, values in methods.items()]
            parts.append(f"The paper's batch sizes for comparison (BERT, GPT-2, T5, AmoebaNet; its {peer} is the "
                         f"row our `time` stands in for):")
            parts.append(_table(["stages", "memopt", "method", "BERT", "GPT-2", "T5", "AmoebaNet"], paper_rows))
    parts.append("## Ratios: dawnpiper over the other partitioners")
    parts.append(_ratio_section(results, models))
    parts.append(_targets_section(results))
    parts += _schedule_sections(rows, labels)
    parts.append(_scope_section(results))
    parts.append(_accuracy_section(rows, device["memory"]))
    parts.append(DIFFERENCES)
    if "fsdp" in results:
        parts.append(fsdp_scale.section(results["fsdp"]))
    parts.append(_devices_section())
    return "\n\n".join(parts) + "\n"


BF16 = """*bf16-mixed* columns: Lightning's `precision="bf16-mixed"` on an A100. Parameters, gradients and
Adam's state stay fp32 (master weights); the training step, forward and loss, runs under autocast to
bfloat16 with CUDA's policy (matrix products in bf16; layer norm, softmax, `pow` and the loss in fp32)
and its cache off, as Lightning runs it, so each micro-batch casts the weights again and keeps the bf16
copies its backward needs. The profile and the fake runs are on CPU tensors (fake where the runs are)
under CPU autocast casting as CUDA's does (`lightning_pipe.autocast.cuda_policy`, held for the whole
run: a recompute casts again in the backward). Attention runs the fused kernel an A100 picks for bf16
([what differs](#what-differs-from-the-paper)); the bf16-mixed rows on this page are from a run before
that (2026-11-29T07:00), whose attention with dropout ran the math kernel in fp32: there bf16 saved no
attention memory. The paper's tables are fp32."""


def _column(labels: dict[str, str], model: str, precision: str) -> str:
    return labels[model] + ("" if precision == "32-true" else f", {precision}")


def _paper_ratio(schedule: str, stages: int, memopt: bool, model: str) -> float | None:
    """DawnPiper over the method our ``time`` stands in for, in the paper's table."""
    if schedule not in PAPER_PEER or model not in PAPER_MODELS:
        return None
    paper, peer, ours = PAPER_PEER[schedule]
    methods = paper.get((stages, memopt), {})
    if peer not in methods:
        return None
    k = PAPER_MODELS.index(model)
    return methods[ours][k] / methods[peer][k]


def _ratio_section(results: dict[str, Any], models: list[str]) -> str:
    every = results["ratios"]
    peers = sorted({k[3:] for r in every for k in r if k.startswith("vs_")}, key=list(PARTITIONERS).index)
    rows = []
    for r in every:
        fp32 = r["precision"] == "32-true"
        paper = _paper_ratio(r["schedule"], r["stages"], r["memopt"], r["model"]) if fp32 else None
        rows.append([r["model"], r["precision"], r["stages"], r["schedule"], _mo(r["memopt"]),
                     *(r.get(f"vs_{p}") for p in peers), paper])
    text = [_table(["model", "precision", "stages", "schedule", "memopt", *(f"÷ {p}" for p in peers),
                    "paper: DawnPiper ÷ GPipe (Table 1) / PipeDream (Table 2)"], rows)]
    ratios = _fp32(every)
    ours = [r["vs_time"] for r in ratios if r.get("vs_time")]
    theirs = [x for x in (_paper_ratio(r["schedule"], r["stages"], r["memopt"], r["model"]) for r in ratios) if x]
    if ours:
        text.append(f"Mean dawnpiper ÷ time over these configurations: **{statistics.fmean(ours):.2f}x** "
                    f"(geometric {statistics.geometric_mean(ours):.2f}x; {len(ours)} configurations). The paper's "
                    f"own tables give {statistics.fmean(theirs):.2f}x for DawnPiper over GPipe and PipeDream in the "
                    f"same cells; its text reports 1.29x over GPipe and 1.71x over vPipe on average, and 2.14x "
                    f"and 2.73x over vPipe without memory optimisation in asynchronous mode (4 and 8 stages). "
                    f"vPipe has no counterpart here." if theirs else "")
    if bf16 := [r["vs_time"] for r in every if r["precision"] == "bf16-mixed" and r.get("vs_time")]:
        text.append(f"Those means are fp32's, as the paper's tables; over the {len(bf16)} bf16-mixed configurations "
                    f"dawnpiper ÷ time is **{statistics.fmean(bf16):.2f}x**.")
    return "\n\n".join(text)


def _fp32(ratios: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ratios at the paper's precision, which its tables and the issue's targets are in."""
    return [r for r in ratios if r.get("precision", "32-true") == "32-true"]


def _targets_section(results: dict[str, Any]) -> str:
    """The issue's targets against our ratios, each beside the paper's own tables in the same
    cells (where they hold DawnPiper's baseline): the targets come from the paper's averages."""
    fp32 = _fp32(results["ratios"])
    compared = [r for r in fp32 if any(k.startswith("vs_") for k in r)]
    beaten = [f"{r['model']} x{r['stages']} {r['schedule']} {_mo(r['memopt'])} ({', '.join(lost)})" for r in compared
              if (lost := [k[3:] for k, v in r.items() if k.startswith("vs_") and v is not None and v < 1])]
    lines = [f"- dawnpiper at least every other partitioner in every group: {len(compared) - len(beaten)} of "
             f"{len(compared)} groups" + (f"; not in {'; '.join(beaten)}" if beaten else "")]
    for label, target, chosen in (
        ("synchronous schedules (GPipe, 1F1B)", 1.3, lambda r: r["schedule"] != "2bw"),
        ("2BW", 2.0, lambda r: r["schedule"] == "2bw"),
        ("the CNN (AmoebaNet-D)", 2.0, lambda r: r["model"] == "amoebanet"),
    ):
        ratios = [r for r in fp32 if chosen(r) and r.get("vs_time")]
        if ratios:
            lines.append(f"- mean dawnpiper ÷ time on {label} (target {target:g}x): {_mean_ratio(ratios)}")
            lines += [f"  - memopt {_mo(memopt)}: {_mean_ratio(part)}" for memopt in (False, True)
                      if (part := [r for r in ratios if r["memopt"] == memopt])]
    note = ("With memopt on, `time` gets the same swap and recompute search as dawnpiper (the paper's "
            "GPipe recomputes whole stages, and its Table 2 has no PipeDream row with memory optimisation): "
            "those ratios measure the split alone. The paper's 2.14x-2.73x over vPipe in asynchronous mode "
            "are without memory optimisation.")
    return "## Targets\n\n" + "\n".join(lines) + "\n\n" + note


def _mean_ratio(ratios: Sequence[dict[str, Any]]) -> str:
    """Mean dawnpiper ÷ time over ``ratios``, and the paper's own tables' in the cells they cover."""
    theirs = [x for r in ratios if (x := _paper_ratio(r["schedule"], r["stages"], r["memopt"], r["model"]))]
    paper = (f"; the paper's own tables in the {len(theirs)} of these cells they cover: "
             f"{statistics.fmean(theirs):.2f}x" if theirs else "")
    return f"**{statistics.fmean(r['vs_time'] for r in ratios):.2f}x** over {len(ratios)} configurations{paper}"


def _scope_section(results: dict[str, Any]) -> str:
    """Which part of the issue's full grid the page holds, and what it cost: a reader must not
    take the default run's two partitioners for all five."""
    full = FULL
    configurations = _configurations(asdict(full))
    grid = len(configurations)
    rows = [Row(**r) for r in results["rows"]]
    fp32 = [r for r in rows if r.precision == "32-true"]
    everything = {_key(asdict(r)) for r in fp32} >= configurations
    listed = [r for r in rows if r.precision != "32-true" or not everything]
    bf16 = f", and {len(rows) - len(fp32)} in bf16-mixed" if len(rows) > len(fp32) else ""
    held = ("Every model, stage count, schedule and partitioner of the full grid ran in fp32" if everything else
            f"{len(fp32)} of the full grid's {grid} configurations ran in fp32") + bf16
    if listed:
        held += ":\n\n" + "\n".join(
            f"- {_column({model: model}, model, precision)} x{stages}: "
            f"{', '.join(sorted({r.schedule for r in part}, key=SCHEDULE_ORDER.index))}; "
            f"{', '.join(sorted({r.partitioner for r in part}, key=list[str](PARTITIONERS).index))}"
            for (model, precision, stages), part in _groups(listed))
    else:
        held += "."
    slowest = max(rows, key=lambda r: r.seconds)
    seconds = sum(r["seconds"] for r in results["runs"])
    cpu = sum(r["cpu_seconds"] or 0 for r in results["runs"])
    counted = "" if all(r["cpu_seconds"] is not None for r in results["runs"]) else "at least "
    total = sum(r.seconds for r in rows)
    searched = sum(r.seconds for r in rows if r.memopt and r.partitioner == "dawnpiper")
    return (
        f"## Scope\n\n{held}\n\n"
        f"The runs took {seconds / 60:.0f} minutes with {counted}{cpu / 60:.0f} minutes of CPU time in all. "
        f"The slowest configuration, {_column({slowest.model: slowest.model}, slowest.model, slowest.precision)} "
        f"x{slowest.stages} {slowest.schedule} {_mo(slowest.memopt)} "
        f"{slowest.partitioner}, took {slowest.seconds:.0f} s. Of the configurations' {total / 60:.0f} "
        f"minutes, dawnpiper's with memory optimisation (its search over sizes, plan and fake run) took "
        f"{searched / 60:.0f}, all others {(total - searched) / 60:.0f}. A fake run, on meta tensors, costs "
        "the meter's Python dispatch per operator; PyTorch's meta kernels, most of them Python too, run once "
        "per signature (an operator's results are made again from their layouts after that): an 8-stage GPipe "
        "step of GPT-2 large takes about 7 s (18 s with every kernel run). The full grid "
        "(`--full`: 1F1B and the params, uniform and capslog partitioners too) needs at least one fake run for "
        f"each of its {grid} configurations, more than an hour on two cores; the default run keeps the two "
        "schedules the paper's tables use and the two partitioners its headline ratio compares." + _bf16_cost(rows)
    )


def _bf16_cost(rows: Sequence[Row]) -> str:
    """What the bf16-mixed rows cost against the same configurations in fp32, in CPU time (the
    wall time of a run on a shared machine says little): why the default run leaves them out."""
    bf16 = [r for r in rows if r.precision == "bf16-mixed"]
    same = {_key(asdict(replace(r, precision="32-true"))) for r in bf16}
    fp32 = sum(r.cpu_seconds for r in rows if _key(asdict(r)) in same)
    return (f" The {len(bf16)} bf16-mixed configurations took {sum(r.cpu_seconds for r in bf16) / 60:.0f} minutes "
            f"of CPU time, the same configurations in fp32 {fp32 / 60:.0f}: their fake runs are on fake CPU tensors, "
            "which autocast casts, each operator through the fake tensor mode and CUDA's policy's Python kernels; the "
            "default run is fp32 only (`--precision bf16-mixed` runs them)." if bf16 else "")


def _cpu_time(seconds: float | None) -> str:
    """A run's CPU time; ``None``: a run whose workers' time was not counted (saved by a version
    that counted it only once they had exited, and cut short before)."""
    return "its workers' CPU time not counted" if seconds is None else f"{seconds:.0f} s of CPU time"


def _groups(rows: Sequence[Row]) -> list[tuple[tuple[str, str, int], list[Row]]]:
    keys = list(dict.fromkeys((r.model, r.precision, r.stages) for r in rows))
    return [(k, [r for r in rows if (r.model, r.precision, r.stages) == k]) for k in keys]


def _accuracy_section(rows: Sequence[Row], memory: int) -> str:
    confirmed = sum(r.max_microbatch == r.predicted for r in rows)
    refused = [r for r in rows if r.refused]
    lines = [
        "## Prediction against fake execution",
        f"Of {len(rows)} configurations, {confirmed} trained at exactly the planner's prediction; in "
        f"{len(refused)} a stage went over {memory / 2**30:g} GiB at the predicted size: the plan's memory "
        f"model under-predicted, and only a smaller size trained. At the size that trained, the fullest stage's "
        f"metered peak against the plan's prediction for it:",
        _table(["model", "precision", "stages", "schedule", "memopt", "partitioner", "max", "metered GiB",
                "predicted GiB", "refused sizes", "fake runs", "s"],
               [[r.model, r.precision, r.stages, r.schedule, _mo(r.memopt), r.partitioner, r.max_microbatch,
                 r.fake_peak_gib, r.predicted_peak_gib, ", ".join(map(str, r.refused)) or None, r.fake_runs,
                 f"{r.seconds:.0f}"]
                for r in rows]),
    ]
    return "\n\n".join(lines)


DIFFERENCES = """## What differs from the paper

- **No vPipe, ZeRO or PipeDream runs.** The baselines are partitioners of this package under the same
  runtime and memory optimiser: `time` (torchgpipe's balance by time) stands in for GPipe's split and
  PipeDream's, `params` for DeepSpeed's. With memopt on, every partitioner gets the same per-stage
  swap and recompute search, where the paper's GPipe recomputes whole stages; so our `time` with S+R is
  a stronger baseline than the paper's GPipe with R, and ratios over it are smaller for that reason.
- **No GPU ran.** Memory comes from fake execution: every storage PyTorch allocates while the real
  runtime trains, as the meter charges it, at the device's size. What a GPU adds beyond that is not
  seen: the CUDA context, the caching allocator's fragmentation and rounding, cuBLAS and cuDNN
  workspaces, communication buffers. The planner's 10% headroom is there for it; the paper measured
  real out-of-memory errors. The other way, the meter (a dispatch mode, as fake execution needs)
  makes autograd add the gradients a value gets from several readers into a new tensor, where a
  run without one adds into a gradient it holds alone: fake runs and predictions hold such a sum
  beside the two it adds, which a GPU run would not. Where two of a stage's own nodes' gradients
  meet, the planner counts on the second node's backward freeing its saved tensors first; AmoebaNet
  x4 2BW S+R stage 0 peaks where a pool inside a recomputed region frees only its indices, half
  the sum, and the fake run is 4% over the prediction there, which an unmetered run would not be.
- **Times are a roofline**, each operator's FLOPs at the datasheet's peak or its bytes at the memory
  bandwidth. They steer the partitioners that balance time and price swap and recompute; no figure
  on this page is a time.
- **Models**: Hugging Face's implementations at the paper's sizes, with its default scaled-dot-product
  attention. Its kernel is the one an A100 picks (`lightning_pipe.measure.attention`, in the fake
  profile and the fake runs): memory-efficient attention in fp32, or with a mask; flash in bf16
  without one; both with the configs' attention dropout (0.1), keeping per layer only query, key,
  value, output and one fp32 log-sum-exp per row. Meta and CPU tensors would run the math kernel,
  which keeps three fp32 attention-sized tensors (probabilities, dropout mask, dropped probabilities)
  per layer. Against that kernel (the fp32 rows before, commits e1a2a68 and 674212e), 105 of BERT's
  and GPT-2's 120 fp32 configurations train a larger micro-batch (4 stages, GPipe, none, dawnpiper:
  BERT 15 -> 32, GPT-2 2 -> 5), 7 the same and 8 a smaller one, all with memory optimisation (BERT,
  8 stages, 1F1B, S+R, dawnpiper 188 -> 156; not investigated). BERT's and GPT-2's bf16-mixed rows
  here are from a run before this (2026-11-29T07:00) and still count those tensors, memory a GPU
  would not hold. AmoebaNet-D is our own build of its
  genotype as GPipe's implementation has it (`benchmarks/amoebanet.py`; at GPipe's sizes it has GPipe's
  parameter counts), at the paper's 28M parameters: the paper gives no cell count or filters, we take
  GPipe's 6 normal cells per stack and 120 filters. A U-Net (25M) adds a CNN with long skips, which
  the paper has not.
- **Optimizer**: Adam in fp32, stepping all of a stage's parameters at once (`foreach`, its
  default on GPUs): the step's temporaries, the square roots of every second moment, are part
  of each stage's memory, planned and metered.
- **Schedules**: GPipe for the synchronous table, PipeDream-2BW (two weight versions, 1F1B order) for
  the asynchronous one; one micro-batch per stage per batch in both. The paper does not say how many
  micro-batches its asynchronous runs use, so Table 2's batch sizes compare in ratio only."""


DATASHEETS = {
    "V100": "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
    "A100": "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    "H100": "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
}


def _devices_section() -> str:
    rows = [[spec.name, f"{spec.memory / 2**30:.0f} GiB", *(f"{spec.flops[k] / 1e12:g}" if k in spec.flops else "–"  # noqa: RUF001
                                                            for k in ("fp32", "tf32", "bf16", "fp16")),
             f"{spec.memory_bandwidth / 1e9:g}", f"{spec.host_bandwidth / 1e9:g}", f"{spec.link_bandwidth / 1e9:g}"]
            for spec in DEVICES.values()]
    return "\n\n".join([
        "## Devices",
        "`lightning_pipe.plan.devices`: what `lightning-pipe plan --devices 8xA100-40GB` and fake profiles use. "
        "Dense peaks in TFLOP/s, bandwidths in GB/s, links one direction. Sources: NVIDIA's datasheets ("
        + ", ".join(f"[{name}]({url})" for name, url in DATASHEETS.items()) + "), SXM modules.",
        _table(["device", "memory", "FP32", "TF32", "BF16", "FP16", "memory GB/s", "host GB/s", "link GB/s"], rows),
        "- Memory: the datasheet's GB read as GiB (HBM stacks are binary); CUDA reports a few hundred MiB less.\n"
        "- Host link: PCIe, one direction: V100 Gen3 (32 GB/s both ways), A100 Gen4 (64), H100 Gen5 (128).\n"
        "- Link between stages: NVLink, one direction: V100 300 GB/s both ways, A100 600, H100 900.\n"
        "- H100 tensor core rates are printed with sparsity; the table holds the dense ones, half of them. "
        "V100 has no TF32 or BF16 tensor cores: such math runs at its FP32 rate.\n"
        "- FP32 products run at the FP32 rate unless PyTorch allows TF32 "
        "(`torch.backends.cuda.matmul.allow_tf32`, off by default; convolutions: `torch.backends.cudnn.allow_tf32`, "
        "on by default).",
    ])


BOUND = """*B_agg* is the aggregate-memory bound: the largest micro-batch whose bytes, every stage's
together, fit the sum of the devices' memory (4 or 8 x 40 GiB), with the row's memory options.
Precisely (`benchmarks.paper.aggregate_bound`): the whole model is priced as one stage by the
planner's cost model (`lightning_pipe.plan.memory.CostModel`: parameters, gradients, Adam's
state and the step's temporaries; the activations of the micro-batches held; the forward's and
backward's working bytes; the training batch, the loss and the LM head's logits), at the row's
schedule, micro-batches and weight versions (2BW: two), holding as many micro-batches as the
stage of that schedule holding the *fewest* (GPipe: every micro-batch; 1F1B and 2BW: one, the
last stage's; the multi-stage schedules: read off their action orders). With S+R the memory
optimiser may recompute and swap (over the A100's host link) to bring that stage under the
summed memory, as a row's planner does per stage; with none, every activation is kept. Under
`auto` it is the largest over the schedules auto weighs. Every stage of a split holds at least
that many micro-batches and its own share of every other term, and a split adds what crosses
its cuts; per-device limits are dropped: so no plan should train a larger micro-batch than
B_agg (a row that does is listed under the targets), and *max ÷ B_agg* says how much of the
pooled memory the split leaves usable. B_agg ignores that the early stages of 1F1B-like
schedules hold more micro-batches than the last: there it is loose by construction (the
*held* column: the fewest and the most micro-batches a stage holds)."""

#: Why dawnpiper's S+R rows stay far under B_agg: measured once (commit 22a02db) on the
#: planner's plan at the row's max (``Bench.plan``), its stages' predicted peaks by kind,
#: against the one stage B_agg prices at the same size.
BOUND_GAP = """Why the S+R rows stay far under B_agg, measured on dawnpiper's plan at the row's max (the
planner's predicted peaks by kind, summed over the stages; `Bench.plan`, commit 22a02db), against
the one stage B_agg prices at the same micro-batch:

- BERT x8 1F1B S+R, max 208 (B_agg 748): the stages together hold 263 of 320 GiB (82%; seven at
  34-36 GiB). They add 110 GiB of working bytes (each stage its own forward's or backward's at its
  peak), where the one stage has 36; the first stages hold up to 8 micro-batches where B_agg counts
  one; and the last stage's 36 GiB are the LM head's logits, loss and batch, which no memory option
  moves (at 748, the logits alone would be 46 GB on that one device). The one stage needs 261 GiB at
  208 and can be optimised down to 107 GiB.
- GPT-2 x8 1F1B S+R, max 53 (B_agg 220): 271 of 320 GiB (85%); 102 GiB of working bytes over the
  stages, and the first stages hold up to 8 micro-batches.
- BERT x8 GPipe S+R, max 62 (B_agg 307): 145 of 320 GiB (45%). The last stage holds every
  micro-batch's output for GPipe's merge (36 GiB at 62), the one limit; dawnpiper puts 609 of the
  617 nodes on one stage and leaves the rest nearly empty, since no split moves that merge off the
  last device.

So the 90% target is not met because B_agg pools what cannot be pooled: bytes tied to one device
(the LM head's outputs and loss, GPipe's merge), one working set per stage, and the micro-batches
1F1B's early stages hold. Where the bound counts what the stages hold (GPipe, every activation kept)
dawnpiper reaches 0.83-0.89 of it on BERT, GPT-2 and AmoebaNet-D (T5 0.56, U-Net 0.58-0.74). The
bf16-mixed rows are from a run whose attention kept the math kernel's tensors (see
[what differs](#what-differs-from-the-paper)); their B_agg is from today's profile, so their
fractions are low for that reason too."""


def _held(row: Row) -> tuple[int, int]:
    """The fewest and the most micro-batches a stage of ``row``'s schedule holds (auto: its pick's)."""
    if row.schedule == "auto":
        if not row.picked:
            return 0, 0
        name, stages = row.picked.split(" x")
        schedule, virtual = name, int(stages)
    else:
        schedule, virtual = DISTRIBUTED.get(row.schedule, (row.schedule, 1))
    counts = in_flight(schedule, row.chunks, row.stages * virtual, virtual)
    return min(counts), max(counts)


def _fraction(row: Row) -> float | None:
    return row.max_microbatch / row.b_agg if row.b_agg else None


def _schedule_sections(rows: Sequence[Row], labels: dict[str, str]) -> list[str]:
    """Issue #48's sections: the distributed engine's schedules, B_agg for every row, the targets."""
    parts = []
    distributed = [r for r in rows if r.schedule in DISTRIBUTED]
    if distributed:
        parts += ["## Schedules on the distributed engine (not in the paper)",
                  "`python -m benchmarks.paper --schedules all`: each schedule of the distributed engine, one process "
                  f"per device, {DISTRIBUTED_CHUNKS} micro-batches per process, dawnpiper's split planned for it "
                  "(`PlanRequest(carry=True)`; interleaved and V-shape schedules with 2 stages per process). *max*: "
                  "the largest micro-batch that trains by fake execution of the schedule's own action order "
                  "(`torch.distributed.pipelining`'s, every rank's step on a silent mesh, `fake_rank_training`), the "
                  "planner's prediction in brackets; *step*: the plan's simulated step at that size; *samples/s*: "
                  "max x micro-batches per step. `dist-1f1b` is 1F1B there, the baseline of the `auto` target; "
                  "`auto` is `schedule=\"auto\"` planned at the micro-batch of the fastest of the others (in "
                  "samples/s; below, where its pick does not train), *picked* its choice: at least as fast as that "
                  "row, where it trains.",
                  _table(["model", "devices", "schedule", "stages/process", "memopt", "max (predicted)", "step ms",
                          "samples/s", "B_agg", "max ÷ B_agg", "picked", "metered GiB", "predicted GiB", "fake runs",
                          "s"],
                         [[_column(labels, r.model, r.precision), r.stages, r.schedule, r.virtual_stages, _mo(r.memopt),
                           f"{r.max_microbatch}{'' if r.exact else '+'} ({r.predicted})",
                           f"{r.step_ms:.0f}" if r.step_ms else None, r.samples_per_s or None, r.b_agg or None,
                           _fraction(r), r.picked or None, r.fake_peak_gib, r.predicted_peak_gib, r.fake_runs,
                           f"{r.seconds:.0f}"] for r in distributed])]
    bounded = [r for r in rows if r.b_agg]
    if bounded:
        groups = list(dict.fromkeys((r.model, r.precision, r.stages, r.schedule, r.memopt) for r in bounded))
        peers = sorted({r.partitioner for r in bounded}, key=list[str](PARTITIONERS).index)
        table = []
        for g in groups:
            part = {r.partitioner: r for r in bounded if (r.model, r.precision, r.stages, r.schedule, r.memopt) == g}
            first = next(iter(part.values()))
            low, high = _held(first)
            table.append([_column(labels, g[0], g[1]), g[2], g[3], _mo(g[4]), f"{low}–{high}", first.b_agg,  # noqa: RUF001
                          *(f"{r.max_microbatch} ({_fraction(r):.2f})" if (r := part.get(p)) else None
                            for p in peers)])
        parts += ["## B_agg: the aggregate-memory bound, for every row", BOUND, BOUND_GAP,
                  "Per partitioner: max (max ÷ B_agg).",
                  _table(["model", "devices", "schedule", "memopt", "held", "B_agg", *peers], table)]
    parts.append(_schedule_targets(rows))
    return parts


def _schedule_targets(rows: Sequence[Row]) -> str:
    """Issue #48's targets: auto's simulated throughput over the best 1F1B plan at 8 devices,
    and dawnpiper's max at least 90% of B_agg in every S+R row."""
    lines = ["## Targets of issue #48"]
    for model in ("bert", "gpt2"):
        for stages in (8, 4):
            same = [r for r in rows if (r.model, r.stages, r.precision) == (model, stages, "32-true")]
            auto = max((r for r in same if r.schedule == "auto"), key=lambda r: r.samples_per_s, default=None)
            base = max((r for r in same if r.schedule == "dist-1f1b"), key=lambda r: r.samples_per_s, default=None)
            if auto is None or base is None or not base.samples_per_s:
                if stages == 8:
                    lines.append(f"- `auto` ÷ best 1F1B, {model} x8 (target 1.15x): not measured (`python -m "
                                 f"benchmarks.paper --models bert gpt2 --schedules all` measures it)")
                continue
            best = max((r for r in same if r.schedule in DISTRIBUTED), key=lambda r: r.samples_per_s)
            lines.append(
                f"- `auto` ÷ best 1F1B, {model} x{stages} (target 1.15x at 8): "
                f"**{auto.samples_per_s / base.samples_per_s:.2f}x** "
                f"({auto.samples_per_s:.1f} samples/s, {auto.picked or 'none'} at micro-batch {auto.max_microbatch}, "
                f"{_mo(auto.memopt)}; 1F1B {base.samples_per_s:.1f} at {base.max_microbatch}, {_mo(base.memopt)}); the "
                f"fastest row: {best.schedule} {_mo(best.memopt)}, {best.samples_per_s:.1f} samples/s at micro-batch "
                f"{best.max_microbatch}")
    sr = [r for r in rows if r.memopt and r.partitioner == "dawnpiper" and r.b_agg]
    met = [r for r in sr if r.max_microbatch >= 0.9 * r.b_agg]
    if sr:
        lines.append(f"- dawnpiper's max at least 90% of B_agg with S+R: {len(met)} of {len(sr)} rows")
        for schedule in [s for s in SCHEDULE_ORDER if any(r.schedule == s for r in sr)]:
            fractions = [r.max_microbatch / r.b_agg for r in sr if r.schedule == schedule]
            lines.append(f"  - {schedule}: max ÷ B_agg {min(fractions):.2f} to {max(fractions):.2f} "
                         f"(mean {statistics.fmean(fractions):.2f}, {len(fractions)} rows)")
    over = [r for r in rows if r.b_agg and r.max_microbatch > r.b_agg]
    if any(r.b_agg for r in rows):
        lines.append(f"- rows training more than B_agg (the bound broken): {len(over)}" + (
            ": " + "; ".join(f"{r.model} {r.precision} x{r.stages} {r.schedule} {_mo(r.memopt)} {r.partitioner} "
                             f"{r.max_microbatch} > {r.b_agg}" for r in over) if over else ""))
    return "\n".join(lines)


def _bounds(out: Path, workloads: Sequence[Workload] | None, device: DeviceSpec) -> dict[str, Any]:
    """``--bounds``: :func:`fill_bounds` on the results file, the page written again."""
    path = out / "benchmarks" / "paper_results.json"
    models = {w.name: w for w in workloads} if workloads is not None else paper_models()
    results = fill_bounds(json.loads(path.read_text()), models, device)
    path.write_text(json.dumps(results, indent=1))
    page = markdown(results)
    (out / "docs" / "paper-scale.md").write_text(page)
    print(page[page.index("## Targets of issue #48"):].split("\n\n")[0])
    return results


def summary(results: dict[str, Any]) -> str:
    lines = [f"{results['runs'][-1]['configurations']} configurations in {results['runs'][-1]['seconds']:.0f} s; "
             f"{len(results['rows'])} in the results file"]
    for r in results["ratios"]:
        vs = ", ".join(f"/ {k[3:]} {_cell(v)}" for k, v in r.items() if k.startswith("vs_"))
        lines.append(f"  {r['model']:<5} {r['precision']:<10} x{r['stages']} {r['schedule']:<5} "
                     f"memopt {_mo(r['memopt']):<4} dawnpiper {vs}")
    return "\n".join(lines)


def _fsdp(out: Path) -> dict[str, Any]:
    """``--fsdp``: :mod:`benchmarks.fsdp_scale`'s results kept in the results file beside the rows
    (other runs keep them), the page written again with them and their plot."""
    path = out / "benchmarks" / "paper_results.json"
    results = json.loads(path.read_text())
    results["fsdp"] = fsdp_scale.run()
    path.write_text(json.dumps(results, indent=1))
    (out / "docs" / "paper-scale.md").write_text(markdown(results))
    fsdp_scale.plot(results["fsdp"], out / "docs" / "img" / "fsdp-scale.png")
    print(fsdp_scale.section(results["fsdp"]))
    return results


def main(
    argv: list[str] | None = None, workloads: Sequence[Workload] | None = None, device: DeviceSpec = DEVICE
) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paper", description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every schedule and partitioner (hours on 2 CPU cores)")
    parser.add_argument("--models", nargs="+", choices=MODELS, help="a subset of the models")
    parser.add_argument("--stages", nargs="+", type=int, help="stage counts (default 4 8)")
    parser.add_argument("--precision", choices=PAPER_PRECISIONS, default="32-true",
                        help="the Trainer's precision (bf16-mixed: autocast as on a GPU; default 32-true)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="(model, stage count) tasks run at once, each in its own process (default: one per CPU)")
    parser.add_argument("--out", type=Path, default=ROOT, help="root under which benchmarks/ and docs/ are written")
    parser.add_argument("--fsdp", action="store_true",
                        help="only the pipeline x FSDP section: the largest Llama-style decoder per data-parallel "
                             "mode on 8, 16 and 32 A100-80GB (benchmarks.fsdp_scale)")
    parser.add_argument("--schedules", nargs="+", choices=[*DISTRIBUTED, "all"],
                        help="only rows of the distributed engine's schedules, dawnpiper (auto brings the others)")
    parser.add_argument("--bounds", action="store_true",
                        help="only B_agg of every row of the results file, made again (no fake run)")
    args = parser.parse_args(argv)
    if args.fsdp:
        return _fsdp(args.out)
    if args.bounds:
        return _bounds(args.out, workloads, device)
    base = FULL if args.full else QUICK
    settings = Settings(args.models or base.models, args.stages or base.stages, base.schedules, base.partitioners,
                        precision=args.precision)
    if args.schedules:
        chosen_labels = set(DISTRIBUTED) if "all" in args.schedules or "auto" in args.schedules else set(args.schedules)
        settings = replace(settings, schedules=[s for s in DISTRIBUTED if s in chosen_labels],
                           partitioners=["dawnpiper"])
    chosen = list(workloads) if workloads is not None else [paper_models()[n] for n in settings.models]
    start, ran_on = time.perf_counter(), machine()  # the commit that runs, should HEAD move meanwhile
    command = "paper" + (" --full" if args.full else "") + (
        f" --schedules {' '.join(args.schedules)}" if args.schedules else "") + (
        f" --precision {args.precision}" if args.precision != "32-true" else "") + "".join(
        f" --{name} {' '.join(map(str, given))}" for name, given in (("models", args.models), ("stages", args.stages))
        if given)
    path = args.out / "benchmarks" / "paper_results.json"
    earlier = json.loads(path.read_text()) if path.exists() else None
    jobs = args.jobs if workloads is None else 1

    def save(rows: list[Row]) -> dict[str, Any]:
        """The results file and page with ``rows`` (so far) merged in."""
        this = {"command": command, "machine": ran_on, "settings": asdict(settings), "configurations": len(rows),
                "seconds": time.perf_counter() - start, "cpu_seconds": _cpu_seconds(rows, jobs > 1)}
        results = merged(earlier, this, device, {w.name: w.label for w in chosen}, rows)
        for target, text in ((path, json.dumps(results, indent=1)), (args.out / "docs" / "paper-scale.md",
                                                                      markdown(results))):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return results

    measured = run_schedules if args.schedules else run
    results = save(measured(chosen, settings, device, jobs, save))
    print(summary(results))
    return results


if __name__ == "__main__":
    main()
