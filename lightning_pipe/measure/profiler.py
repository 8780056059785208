"""Profiler: measure what each graph node costs in time and memory on a sample micro-batch.

Nodes run one by one on the device that holds their parameters, so the whole model never has
to sit on one device; bytes come from the memory meter, so they agree with metered stage peaks.
A fake profile runs nothing, so its times are estimates from each node's FLOPs and bytes: with
no times at all, every cut would balance and every recompute would be free to the planner.
The result is a :class:`~lightning_pipe.plan.profile.Profile`, plain data for the planner.
"""

import functools
import inspect
import statistics
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx

from lightning_pipe.graph.capture import Captured, get_attr
from lightning_pipe.graph.export import localize_args
from lightning_pipe.graph.microbatch import batch_size
from lightning_pipe.internals import TO_COPY, FakeTensorMode, TorchDispatchMode, tree_flatten, tree_map
from lightning_pipe.measure.attention import cuda_attention
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.measure.optimizers import rebuild
from lightning_pipe.measure.roofline import WorkCounter
from lightning_pipe.plan.devices import DEVICES, DeviceSpec
from lightning_pipe.plan.profile import NodeProfile, Profile, SharedParam
from lightning_pipe.stream import current_stream, elapsed_ms, record_event

__all__ = ["FAKE_DEVICE", "device_spec", "profile_graph"]

#: The GPU a fake profile's times are estimated for when none is given (the DawnPiper
#: paper's). Only their ratios matter to balancing and recompute; against
#: ``host_bandwidth`` and ``link_bandwidth`` the absolute times do.
FAKE_DEVICE = DEVICES["A100-40GB"]


def profile_graph(
    captured: Captured,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 3,
    warmup: int = 1,
    fake: bool = False,
    device: DeviceSpec = FAKE_DEVICE,
    progress: Callable[[int, int], None] | None = None,
    output: list[Any] | None = None,
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
            impossible, e.g. activations that do not fit; times are then estimated for
            ``device``: each operator's roofline (:mod:`~lightning_pipe.measure.roofline`),
            in forward and in backward.
        device: the GPU a fake profile's times are for; on a CUDA one (``device.cuda``)
            attention runs the fused kernel it picks (:mod:`~lightning_pipe.measure.attention`).
        progress: called with (nodes timed, all nodes) after each node, for a progress bar:
            timing takes ``warmup + repeats`` runs of every node.
        output: a list the graph's output on the sample is appended to, detached (a leaf
            requiring grad where the output does): what ``training_step`` makes its loss from.
    """
    gm = captured.graph_module
    kwargs = kwargs or {}
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    rng = _rng_state()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    # a fake profile for a GPU runs the attention kernel it will run, not meta's math one
    with fake_mode or nullcontext(), cuda_attention() if fake and device.cuda else nullcontext():
        if fake_mode is not None:
            args, kwargs = tree_map(lambda x: fake_mode.from_tensor(x) if isinstance(x, Tensor) else x, (args, kwargs))
        runner = _NodeRunner(gm, _bind(gm, args, kwargs))
        memory = _measure_memory(runner, captured.nodes)
        machine = (device, 0.0) if fake else _machine(_device_of(captured.nodes[0], runner))
        # The roofline run fills runner.env again (_measure_memory leaves it without the nodes'
        # values), from the measured forward's random state: the output and the timings read it.
        _set_rng_state(rng)
        estimated = _roofline_times(runner, captured.nodes, *machine)
        if output is not None:
            result = fx.node.map_arg(gm.graph.output_node().args[0], runner.env.__getitem__)
            output.append(tree_map(_leaf, result))
        times = []
        for k, n in enumerate(captured.nodes):
            times.append(estimated[k] if fake else _time_node(runner, n, repeats, warmup))
            if progress is not None:
                progress(len(times), len(captured.nodes))
        if not fake:
            times = _shared_out(times, estimated)
    with torch.no_grad():
        for name, b in gm.named_buffers():
            b.copy_(buffers[name])  # profiling must not advance e.g. BatchNorm statistics
    _set_rng_state(rng)

    params = captured.params_by_node()
    state_bytes, step_bytes, grouped = _optimizer_bytes(optimizer, [p for ps in params for p in ps],
                                                        torch.device("meta") if fake else None)
    step = sum if grouped else functools.partial(max, default=0)
    index = {node: k for k, node in enumerate(captured.nodes)}
    profiles = []
    for k, node in enumerate(captured.nodes):
        value = runner.env[node]
        profiles.append(
            NodeProfile(
                name=node.name,
                forward_ms=times[k][0],
                backward_ms=times[k][1],
                output_bytes=_tensor_bytes(value),
                saved_bytes=memory[k].saved,
                transient_bytes=memory[k].workspace,
                param_bytes=sum(_nbytes(p) for p in params[k]),
                grad_bytes=sum(_nbytes(p) for p in params[k] if p.requires_grad),
                optimizer_bytes=sum(state_bytes.get(id(p), 0) for p in params[k]),
                step_bytes=step(step_bytes.get(id(p), 0) for p in params[k]),
                users=sorted(index.get(u, -1) for u in node.users),
                backward_bytes=memory[k].backward,
                output_grad_bytes=_tensor_bytes([t for t in tree_flatten(value)[0] if _needs_grad(t)]),
                last_saver=memory[k].last_saver,
                made_bytes=memory[k].made,
                held_bytes=memory[k].held,
                held_until=memory[k].held_until,
                held_by=memory[k].held_by,
                saved_inputs_bytes=memory[k].saved_inputs,
                saved_inputs_from=memory[k].saved_inputs_from,
                input_grad_bytes=memory[k].input_grads,
                forwarded_grads=sorted(memory[k].forwarded),
                cast_bytes=memory[k].cast,
                fresh_grad_bytes=_largest_group(memory[k].fresh, params[k]),
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
        step_grouped=grouped,
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


@dataclass
class _NodeBytes:
    """What one node's forward and backward do to memory (see NodeProfile)."""

    made: int = 0
    workspace: int = 0
    saved: int = 0
    saved_inputs: int = 0
    saved_inputs_from: int = -1
    held: int = 0
    held_until: int = -1
    held_by: int = -1
    backward: int = 0
    last_saver: int = -1
    input_grads: int = 0
    forwarded: set[int] = field(default_factory=set)
    cast: int = 0
    fresh: list[list[Tensor]] = field(default_factory=list)  # parameters whose gradients appear at once


def _measure_memory(runner: "_NodeRunner", nodes: list[fx.Node]) -> list[_NodeBytes]:
    """Bytes per node (one meter "stage" per node). Leaves no node's value in ``runner.env``."""
    meter = MemoryMeter(len(nodes))
    measured = [_NodeBytes() for _ in nodes]
    with meter, meter.saved_tensors_hooks():
        _measure_forward(runner, nodes, meter, measured)
        result = fx.node.map_arg(runner.gm.graph.output_node().args[0], runner.env.__getitem__)
        outputs = [t for t in tree_flatten(result)[0] if _needs_grad(t)]
        leaves = [p for p in runner.module.parameters() if p.requires_grad]
        # Only autograd holds the forward's values now, as in training: a node's backward
        # frees what it saved before autograd sums the gradients it hands on.
        del result
        for node in nodes:
            del runner.env[node]
        meter.reset_peaks()
        start = [m.total for m in meter.stages]
        if outputs and leaves:
            # grad(), not backward(): the model's .grad stay untouched.
            grads = torch.autograd.grad(outputs, leaves, [torch.ones_like(t) for t in outputs], allow_unused=True)
            del grads
        for k, (m, s) in enumerate(zip(meter.stages, start)):
            measured[k].backward = max(m.peak - s, 0)
            measured[k].last_saver = meter.last_saver.get(k, -1)
    return measured


def _measure_forward(runner: "_NodeRunner", nodes: list[fx.Node], meter: MemoryMeter,
                     measured: list[_NodeBytes]) -> None:
    """Run the forward node by node under ``meter``, noting in ``measured`` what each node
    makes, saves and holds."""
    index = {node: k for k, node in enumerate(nodes)}
    autocast = any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))  # (else nothing is cast)
    made: dict[int, tuple[int, Tensor]] = {}  # storage -> the node making it, and a tensor on it
    last_read: dict[int, int] = {}  # storage -> the last node reading a value on it
    for node in runner.gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            runner.env[node] = runner.run_node(node)
        elif node.op != "output":
            k = index[node]
            before = _grad_fns([runner.env.get(a) for a in node.all_input_nodes])
            casts = _ParameterCasts()
            with meter.running(k), casts if autocast else nullcontext():
                runner.env[node] = runner.run_on(node, _device_of(node, runner))
            copies = {id(t.untyped_storage()): t for t in casts.made if meter.charged(t) == (k, "activations")}
            measured[k].cast = sum(t.untyped_storage().nbytes() for t in copies.values())
            meter.tag_backward([runner.env[node]], k)
            measured[k].fresh = _fresh_gradients(runner.env[node], before)
            _watch_input_grads(runner.env[node], measured[k], _read_by(node, index, runner))
            stage = meter.stages[k]
            kept = _kept_from_others(meter, node, k, runner)
            measured[k].saved_inputs = sum(t.untyped_storage().nbytes() for t in kept)
            makers = [made[id(t.untyped_storage())][0] for t in kept if id(t.untyped_storage()) in made]
            measured[k].saved_inputs_from = min(makers, default=-1)
            measured[k].made = stage.total - measured[k].saved_inputs
            measured[k].workspace = stage.peak - stage.total
            for t in tree_flatten(runner.env[node])[0]:
                if isinstance(t, Tensor):
                    key = id(t.untyped_storage())
                    if meter.charged(t) == (k, "transient"):
                        made[key] = (k, t)
                    last_read[key] = max(last_read.get(key, -1), _last_reader(node, index))
    for k, m in enumerate(meter.stages):
        measured[k].saved = m.current["activations"]
    for key, (k, t) in made.items():  # what a node made and does not keep, until kept or last read
        holder = meter.charged(t)
        if holder != (k, "activations"):
            measured[k].held += t.untyped_storage().nbytes()
            if holder is not None and holder[1] == "activations":
                measured[k].held_by = max(measured[k].held_by, holder[0])
            measured[k].held_until = max(measured[k].held_until, last_read[key])


class _ParameterCasts(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes the copies of parameters autocast makes (in its lower precision): a matrix
    product or convolution saves its weight's for backward, one per micro-batch, whatever
    the micro-batch's size (:attr:`NodeProfile.cast_bytes`)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.made: list[Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is TO_COPY and isinstance(args[0], torch.nn.Parameter):
            self.made.append(out)
        return out


def _grad_fns(values: Any) -> set[int]:
    """The autograd nodes the tensors of ``values`` come from (by id)."""
    return {id(t.grad_fn) for t in tree_flatten(values)[0] if isinstance(t, Tensor) and t.grad_fn is not None}


def _fresh_gradients(value: Any, before: set[int]) -> list[list[Tensor]]:
    """The parameters whose gradients one autograd function of a node's backward makes at
    once, per function of the node (its graph from ``value`` back to the nodes its inputs came
    from, ``before``): a parameter's through a chain of one-input functions (a linear's
    transpose, autocast's cast) counts with the function making it. With ``.grad`` set, each
    is added to it and freed before the next function runs: a node holding a whole
    ``nn.TransformerDecoder`` holds one layer's at a time, not every layer's."""
    stack = [t.grad_fn for t in tree_flatten(value)[0] if isinstance(t, Tensor) and t.grad_fn is not None]
    seen, groups = set(before), []
    while stack:
        function = stack.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        group = []
        for successor, _ in function.next_functions:
            while successor is not None and type(successor).__name__ != "AccumulateGrad":
                onward = [f for f, _ in successor.next_functions if f is not None]
                if len(onward) != 1 or id(successor) in before:
                    break
                successor = onward[0]
            if successor is not None and type(successor).__name__ == "AccumulateGrad":
                group.append(successor.variable)  # type: ignore[attr-defined]
        if group:
            groups.append(group)
        stack.extend(f for f, _ in function.next_functions if f is not None and type(f).__name__ != "AccumulateGrad")
    return groups


def _watch_input_grads(value: Any, measured: _NodeBytes, read: dict[tuple[int, int], int]) -> None:
    """Note in ``measured`` the largest buffer the gradients a node's backward hands its
    inputs are slices of (``cat``'s backward slices its output's gradient): a gradient that
    waits for an earlier stage keeps that whole buffer; and the nodes (``read``: by their
    value's autograd edge) whose gradient is its output gradient's storage."""

    def hook(function: Any, grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]) -> None:
        for g in grad_inputs:
            if g is not None and g.untyped_storage().nbytes() > _nbytes(g):
                measured.input_grads = max(measured.input_grads, g.untyped_storage().nbytes())
        outputs = {id(g.untyped_storage()) for g in grad_outputs if g is not None}
        for (fn, nr), g in zip(function.next_functions, grad_inputs):
            if g is not None and id(g.untyped_storage()) in outputs and (id(fn), nr) in read:
                measured.forwarded.add(read[id(fn), nr])

    functions = {id(t.grad_fn): t.grad_fn for t in tree_flatten(value)[0] if isinstance(t, Tensor) and t.grad_fn}
    for function in functions.values():
        function.register_hook(functools.partial(hook, function))


def _read_by(node: fx.Node, index: dict[fx.Node, int], runner: "_NodeRunner") -> dict[tuple[int, int], int]:
    """The graph nodes ``node`` reads, by the autograd edge of each tensor of their values."""
    return {
        (id(t.grad_fn), t.output_nr): index[a]
        for a in node.all_input_nodes if a in index
        for t in tree_flatten(runner.env.get(a))[0]
        if isinstance(t, Tensor) and t.grad_fn is not None
    }


def _kept_from_others(meter: MemoryMeter, node: fx.Node, k: int, runner: "_NodeRunner") -> list[Tensor]:
    """A tensor on each storage an earlier node made that node ``k`` saved first: now charged
    to it, but not allocated by it."""
    storages = {
        id(t.untyped_storage()): t
        for a in node.all_input_nodes
        for t in tree_flatten(runner.env.get(a))[0]
        if isinstance(t, Tensor) and meter.charged(t) == (k, "activations")
    }
    return list(storages.values())


def _last_reader(node: fx.Node, index: dict[fx.Node, int]) -> int:
    """The last node reading ``node``'s value: ``len(index)`` for the graph output, the node
    itself when nothing reads it."""
    return max((index.get(u, len(index)) for u in node.users), default=index[node])


def _roofline_times(
    runner: "_NodeRunner", nodes: list[fx.Node], device: DeviceSpec, overhead_ms: float
) -> list[tuple[float, float]]:
    """Per node, its forward's and its backward's milliseconds on ``device`` by roofline (each
    operator call ``overhead_ms`` more), from a forward and backward of the whole graph."""
    index = {node: k for k, node in enumerate(nodes)}
    counter = WorkCounter(len(nodes), device, overhead_ms)
    with counter:
        for node in runner.gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                runner.env[node] = runner.run_node(node)
            elif node.op != "output":
                with counter.running(index[node]):
                    runner.env[node] = runner.run_on(node, _device_of(node, runner))
                counter.tag_backward([runner.env[node]], index[node])
        result = fx.node.map_arg(runner.gm.graph.output_node().args[0], runner.env.__getitem__)
        outputs = [t for t in tree_flatten(result)[0] if _needs_grad(t)]
        leaves = [p for p in runner.module.parameters() if p.requires_grad]
        if outputs and leaves:
            torch.autograd.grad(outputs, leaves, [torch.ones_like(t) for t in outputs], allow_unused=True)
    return list(zip(counter.forward_ms, counter.backward_ms))


# What the work of a node on the machine profiling it is estimated from (see _shared_out): only
# the ratios between rates and the launch overhead matter. A CPU core or two: ~100 GFLOP/s,
# ~20 GB/s, ~10 us to dispatch an operator; a GPU: its datasheet (an A100 where the name
# matches none), ~5 us to launch a kernel.
_HOST = DeviceSpec("host CPU", 0, {"fp32": 100e9}, 20e9, 20e9, 20e9, cuda=False)
_HOST_OVERHEAD_MS, _GPU_OVERHEAD_MS = 0.010, 0.005


def device_spec(device: torch.device) -> DeviceSpec:
    """The spec a fake profile estimates times for, to plan for ``device``: its GPU model's,
    or the host's."""
    return _machine(device)[0]


def _machine(device: torch.device) -> tuple[DeviceSpec, float]:
    """The device spec and per-operator overhead the work of nodes profiled on ``device`` is
    estimated for."""
    if device.type != "cuda":
        return _HOST, _HOST_OVERHEAD_MS
    name = torch.cuda.get_device_name(device).replace(" ", "-").upper()
    spec = next((s for n, s in DEVICES.items() if n.split("-")[0] in name), FAKE_DEVICE)
    return spec, _GPU_OVERHEAD_MS


def _shared_out(measured: list[tuple[float, float]], estimated: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Measured time shared out by estimated work: every node's forward and backward get the
    measured total (both directions together) in proportion to their roofline estimates.
    Timing noise moves only the total, which scales every time alike, so the split (which
    compares times of nodes, directions and stages with each other) does not move from one
    profile to the next."""
    total, work = sum(map(sum, measured)), sum(map(sum, estimated))
    if work <= 0:
        return measured
    return [(f * total / work, b * total / work) for f, b in estimated]


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

    def run() -> Any:
        return runner.call(node, args, kwargs)

    try:
        forward_ms = _median_ms(run, device, repeats, warmup)
    except RuntimeError as error:
        if "leaf Variable that requires grad" not in str(error):
            raise

        def run() -> Any:  # an in-place node (relu_, ReLU(inplace=True)): it writes to a copy per call
            return runner.call(node, *tree_map(_through, (args, kwargs)))

        forward_ms = _median_ms(run, device, repeats, warmup)
    out = run()
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


def _through(x: Any) -> Any:
    # A copy that is not a leaf, so that an in-place operator may write to it, with the
    # gradient flowing back to the leaf the backward is timed for.
    return x.clone() if isinstance(x, Tensor) and x.requires_grad else x


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


def _optimizer_bytes(
    optimizer: torch.optim.Optimizer | None, params: list[torch.nn.Parameter], device: torch.device | None = None
) -> tuple[dict[int, int], dict[int, int], bool]:
    """State bytes and step temporaries (:attr:`NodeProfile.step_bytes`) per parameter for the
    optimizer's class and settings, measured by steps on a zero copy of each parameter in
    turn (never a copy of the whole model); and whether the step groups parameters (two
    copies stepped together hold twice one's temporaries). ``device``: where the copies are
    made, if not on the parameter's (``meta`` for a fake profile: the meter charges the same
    bytes, and GPT-2 large's embedding, its state and a step's temporaries held 1.3 GB)."""
    if optimizer is None:
        return {}, {}, False
    cache: dict[tuple[Any, ...], tuple[int, int]] = {}
    state: dict[int, int] = {}
    step: dict[int, int] = {}
    grouped = False
    for p in params:
        if not p.requires_grad:
            continue
        key = (p.shape, p.dtype, p.device)
        if key not in cache:
            probe = torch.zeros_like(p, device=device, requires_grad=True)
            cache[key] = _stepped(optimizer, [probe])
            if len(cache) == 1:  # once, on the first parameter: how a step holds its temporaries
                one = cache[key][1]
                grouped = one > 0 and _stepped(optimizer, [probe, torch.zeros_like(probe)])[1] > 1.5 * one
        state[id(p)], step[id(p)] = cache[key]
    return state, step, grouped


def _stepped(optimizer: torch.optim.Optimizer, probes: list[Tensor]) -> tuple[int, int]:
    """State bytes of ``probes[0]`` and the most bytes a steady step of ``optimizer``'s class
    on ``probes`` holds beyond parameters, gradients and state, as a meter sees them."""
    for probe in probes:
        probe.grad = torch.zeros_like(probe)
    step = rebuild(optimizer, probes)
    step.step()  # makes the state
    state = [v for v in step.state[probes[0]].values() if isinstance(v, Tensor)]
    meter = MemoryMeter(1)
    meter.own(0, probes)
    meter.own(0, [p.grad for p in probes if p.grad is not None], "gradients")
    meter.own(0, [v for p in probes for v in step.state[p].values() if isinstance(v, Tensor)], "optimizer")
    meter.reset_peaks()
    with meter, meter.stepping():
        step.step()
    meter.close()
    return sum(_nbytes(v) for v in state), meter.stages[0].peak - meter.stages[0].total


def _leaf(x: Any) -> Any:
    return x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x


def _largest_group(groups: list[list[Tensor]], owned: list[torch.nn.Parameter]) -> int:
    """The most bytes of one group's gradients of the parameters a node owns (a tied weight's
    later readers own none of it, as their ``grad_bytes`` count none)."""
    ids = {id(p) for p in owned if p.requires_grad}
    return max((sum(_nbytes(p) for p in {id(p): p for p in g if id(p) in ids}.values()) for g in groups), default=0)


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
