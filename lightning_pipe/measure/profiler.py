"""Profiler: measure what each graph node costs in time and memory on a sample micro-batch.

Nodes run one by one on the device that holds their parameters, so the whole model never has
to sit on one device; bytes come from the memory meter, so they agree with metered stage peaks.
A fake profile runs nothing, so its times are estimates from each node's FLOPs and bytes: with
no times at all, every cut would balance and every recompute would be free to the planner.
The result is a :class:`~lightning_pipe.plan.profile.Profile`, plain data for the planner.
"""

import inspect
import math
import statistics
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from lightning_pipe.graph.capture import Captured, get_attr
from lightning_pipe.graph.export import localize_args
from lightning_pipe.graph.microbatch import batch_size
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.plan.profile import NodeProfile, Profile, SharedParam
from lightning_pipe.stream import current_stream, elapsed_ms, record_event

__all__ = ["FAKE_BYTES_PER_S", "FAKE_FLOPS_PER_S", "profile_graph"]

#: The nominal device a fake profile's times are estimated for (an accelerator in half
#: precision). Only their ratios matter to balancing and recompute; against
#: ``host_bandwidth`` and ``link_bandwidth`` the absolute times do.
FAKE_FLOPS_PER_S = 100e12
FAKE_BYTES_PER_S = 1e12


def profile_graph(
    captured: Captured,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 3,
    warmup: int = 1,
    fake: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Profile:
    """Measure every node of ``captured`` on one sample micro-batch ``(args, kwargs)``.

    Each node runs on the device holding its parameters (else its first input), so a model
    already split over stage devices is profiled in place, never gathered on one device.
    Bytes come from a :class:`~lightning_pipe.measure.meter.MemoryMeter` that treats every node as
    its own stage; times are medians of ``repeats`` runs after ``warmup`` runs. The model's
    parameters, gradients, buffers and the random number generators are left as they were.

    Args:
        captured: the traced graph.
        args, kwargs: a sample micro-batch, as passed to ``forward``.
        optimizer: the user's optimizer; its class and settings measure optimizer-state bytes.
        fake: measure bytes on fake tensors (no data, no compute) where running is
            impossible, e.g. activations that do not fit; times are then estimated (a
            node's FLOPs at :data:`FAKE_FLOPS_PER_S` plus writing and reading the bytes it
            allocates at :data:`FAKE_BYTES_PER_S`; backward twice forward).
        progress: called with (nodes timed, all nodes) after each node, for a progress bar:
            timing takes ``warmup + repeats`` runs of every node.
    """
    gm = captured.graph_module
    kwargs = kwargs or {}
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    rng = _rng_state()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    with fake_mode or nullcontext():
        if fake_mode is not None:
            args, kwargs = tree_map(lambda x: fake_mode.from_tensor(x) if isinstance(x, Tensor) else x, (args, kwargs))
        runner = _NodeRunner(gm, _bind(gm, args, kwargs))
        memory, work = _measure_memory(runner, captured.nodes, count_flops=fake)
        times = []
        for k, n in enumerate(captured.nodes):
            times.append(_estimated_ms(*work[k]) if fake else _time_node(runner, n, repeats, warmup))
            if progress is not None:
                progress(len(times), len(captured.nodes))
    with torch.no_grad():
        for name, b in gm.named_buffers():
            b.copy_(buffers[name])  # profiling must not advance e.g. BatchNorm statistics
    _set_rng_state(rng)

    params = captured.params_by_node()
    state_bytes = _optimizer_bytes(optimizer, [p for ps in params for p in ps])
    index = {node: k for k, node in enumerate(captured.nodes)}
    profiles = []
    for k, node in enumerate(captured.nodes):
        grad_bytes = sum(_nbytes(p) for p in params[k] if p.requires_grad)
        forward_transient, saved, backward_growth, last_saver = memory[k]
        value = runner.env[node]
        profiles.append(
            NodeProfile(
                name=node.name,
                forward_ms=times[k][0],
                backward_ms=times[k][1],
                output_bytes=_tensor_bytes(value),
                saved_bytes=saved,
                transient_bytes=max(forward_transient, backward_growth - grad_bytes, 0),
                param_bytes=sum(_nbytes(p) for p in params[k]),
                grad_bytes=grad_bytes,
                optimizer_bytes=sum(state_bytes.get(id(p), 0) for p in params[k]),
                users=sorted(index.get(u, -1) for u in node.users),
                backward_bytes=max(backward_growth, 0),
                output_grad_bytes=_tensor_bytes([t for t in tree_flatten(value)[0] if _needs_grad(t)]),
                last_saver=last_saver,
            )
        )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first = next(iter(gm.parameters()), None)
    return Profile(
        nodes=profiles,
        device=str(_device_of(captured.nodes[0], runner)),
        dtype=str(first.dtype if first is not None else torch.get_default_dtype()),
        microbatch_size=batch_size((args, kwargs)),
        input_bytes=_tensor_bytes((args, kwargs)),
        input_users=sorted({index[u] for p in placeholders for u in p.users if u in index}),
        fake=fake,
        shared=_shared(captured),
    )


def _shared(captured: Captured) -> list[SharedParam]:
    """The parameters several nodes read (a module's, or one read by attribute: tied
    weights), with the nodes reading them."""
    gm = captured.graph_module
    readers: dict[int, tuple[int, list[int]]] = {}
    for k, node in enumerate(captured.nodes):
        reads = list(gm.get_submodule(str(node.target)).parameters()) if node.op == "call_module" else []
        reads += [get_attr(gm, str(a.target)) for a in node.all_input_nodes if a.op == "get_attr"]
        for p in {id(p): p for p in reads if isinstance(p, torch.nn.Parameter)}.values():
            readers.setdefault(id(p), (_nbytes(p), []))[1].append(k)
    return [SharedParam(nbytes, users) for nbytes, users in readers.values() if len(users) > 1]


def _measure_memory(
    runner: "_NodeRunner", nodes: list[fx.Node], count_flops: bool = False
) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """Per node: forward workspace, bytes it allocated that backward keeps, the growth while
    backward runs, and the last node keeping its bytes; one meter "stage" per node. And per
    node its forward's work: FLOPs (where counted) and the bytes it allocated."""
    index = {node: k for k, node in enumerate(nodes)}
    meter = MemoryMeter(len(nodes))
    forward_transient = [0] * len(nodes)
    work = [(0, 0)] * len(nodes)
    counter = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS) if count_flops else None
    with meter, meter.saved_tensors_hooks():
        with counter or nullcontext():
            for node in runner.gm.graph.nodes:
                if node.op in ("placeholder", "get_attr"):
                    runner.env[node] = runner.run_node(node)
                elif node.op != "output":
                    k = index[node]
                    before = counter.get_total_flops() if counter else 0
                    with meter.running(k):
                        runner.env[node] = runner.run_on(node, _device_of(node, runner))
                    meter.tag_backward([runner.env[node]], k)
                    forward_transient[k] = meter.stages[k].peak - meter.stages[k].total
                    work[k] = ((counter.get_total_flops() if counter else 0) - before, meter.stages[k].peak)
        saved = [m.current["activations"] for m in meter.stages]
        result = fx.node.map_arg(runner.gm.graph.output_node().args[0], runner.env.__getitem__)
        outputs = [t for t in tree_flatten(result)[0] if _needs_grad(t)]
        leaves = [p for p in runner.module.parameters() if p.requires_grad]
        meter.reset_peaks()
        start = [m.total for m in meter.stages]
        if outputs and leaves:
            # grad(), not backward(): the model's .grad stay untouched.
            grads = torch.autograd.grad(outputs, leaves, [torch.ones_like(t) for t in outputs], allow_unused=True)
            del grads
        growth = [m.peak - s for m, s in zip(meter.stages, start)]
    last_saver = [meter.last_saver.get(k, -1) for k in range(len(nodes))]
    return list(zip(forward_transient, saved, growth, last_saver)), work


def _estimated_ms(flops: int, nbytes: int) -> tuple[float, float]:
    """Forward and backward milliseconds of a node on the nominal device of a fake profile:
    its FLOPs, and the bytes it allocates written once and read once. Backward does about
    twice the work (a product's gradient needs one product per input)."""
    forward = 1e3 * (flops / FAKE_FLOPS_PER_S + 2 * nbytes / FAKE_BYTES_PER_S)
    return forward, 2 * forward


def _attention_flops(
    query: Sequence[int], key: Sequence[int], value: Sequence[int], *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    """``softmax(q kᵀ) v``: two batched products (shapes ``(batch, heads, length, features)``)."""
    *heads, length, features = query
    return 2 * math.prod(heads) * length * key[-2] * (features + value[-1])


# Ops torch's FlopCounterMode has no formula for: attention as the CPU runs it.
_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}


class _NodeRunner(fx.Interpreter):
    """Runs single nodes, with their inputs moved to a chosen device."""

    def __init__(self, gm: fx.GraphModule, inputs: dict[str, Any]) -> None:
        super().__init__(gm)
        self.gm = gm
        self.inputs = inputs

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.inputs[target.lstrip("*")]  # "**kwargs" binds as "kwargs"

    def run_on(self, node: fx.Node, device: torch.device) -> Any:
        args, kwargs = _to(self.fetch_args_kwargs_from_env(node), device)
        return self.call(node, args, kwargs)

    def call(self, node: fx.Node, args: Any, kwargs: Any) -> Any:
        return getattr(self, node.op)(node.target, args, kwargs)


def _bind(gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _device_of(node: fx.Node, runner: "_NodeRunner") -> torch.device:
    """Where a node runs: with its parameters, else with its first tensor input."""
    if node.op == "call_module":
        for p in runner.module.get_submodule(str(node.target)).parameters():
            return p.device
    for arg in node.all_input_nodes:
        for t in tree_flatten(runner.env.get(arg))[0]:
            if isinstance(t, Tensor):
                return t.device
    return torch.device("cpu")


def _time_node(runner: _NodeRunner, node: fx.Node, repeats: int, warmup: int) -> tuple[float, float]:
    """Median forward and backward milliseconds of one node on fresh copies of its inputs."""
    device = _device_of(node, runner)
    args, kwargs = _to(runner.fetch_args_kwargs_from_env(node), device)
    args, kwargs = tree_map(_fresh, (args, kwargs))
    forward_ms = _median_ms(lambda: runner.call(node, args, kwargs), device, repeats, warmup)
    out = runner.call(node, args, kwargs)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad]
    if not outs:
        return forward_ms, 0.0
    wrt = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.requires_grad]
    if node.op == "call_module":
        wrt += [p for p in runner.module.get_submodule(str(node.target)).parameters() if p.requires_grad]
    if not wrt:
        return forward_ms, 0.0
    grads = [torch.ones_like(t) for t in outs]

    def backward() -> None:
        torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True)

    return forward_ms, _median_ms(backward, device, repeats, warmup)


def _fresh(x: Any) -> Any:
    # A copy, so in-place nodes cannot change the values the profile run holds.
    if isinstance(x, Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


def _median_ms(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` running on ``device``: between events on that device's
    stream (where its kernels run, whichever device is current), the wall clock on a CPU."""
    stream = current_stream(device)
    times = []
    for i in range(warmup + repeats):
        start = record_event(stream, timing=True)
        fn()
        elapsed = elapsed_ms(start, record_event(stream, timing=True))
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def _optimizer_bytes(optimizer: torch.optim.Optimizer | None, params: list[torch.nn.Parameter]) -> dict[int, int]:
    """State bytes per parameter for the optimizer's class and settings, measured by one step
    on a zero copy of each parameter in turn (never a copy of the whole model)."""
    if optimizer is None:
        return {}
    cache: dict[tuple[Any, ...], int] = {}
    result = {}
    for p in params:
        if not p.requires_grad:
            continue
        key = (p.shape, p.dtype, p.device)
        if key not in cache:
            probe = torch.zeros_like(p, requires_grad=True)
            probe.grad = torch.zeros_like(p)
            step = type(optimizer)([probe], **_settings(optimizer))
            step.step()
            cache[key] = sum(_nbytes(v) for v in step.state[probe].values() if isinstance(v, Tensor))
        result[id(p)] = cache[key]
    return result


def _settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's settings its class takes back: ``defaults`` may hold more (AdamW's
    ``decoupled_weight_decay``, which its ``__init__`` fixes)."""
    accepted = inspect.signature(type(optimizer)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _needs_grad(x: Any) -> bool:
    return isinstance(x, Tensor) and x.requires_grad


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _tensor_bytes(value: Any) -> int:
    return sum(_nbytes(t) for t in tree_flatten(value)[0] if isinstance(t, Tensor))


def _rng_state() -> tuple[Tensor, list[Tensor] | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def _set_rng_state(state: tuple[Tensor, list[Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _to(value: Any, device: torch.device) -> Any:
    """Tensors of ``value`` on ``device`` (a differentiable copy where needed), and devices an
    exported graph left open too (``graph.export.localize``)."""
    return localize_args(tree_map(lambda x: x.to(device) if isinstance(x, Tensor) else x, value), device)
