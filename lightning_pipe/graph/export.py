"""Export front end: capture ``forward`` with torch.export where torch.fx cannot.

torch.fx traces with proxies, so code that unpacks a shape (``(*shape, -1, d)``) or calls
a library helper that inspects its inputs defeats it; most Hugging Face models do.
torch.export (non-strict) runs the Python code on fake tensors and records ATen operations,
so it needs example inputs and specializes to them: the graph holds for one training mode,
one input structure (which arguments are tensors, which are None), the non-tensor values
and the sizes export could not keep symbolic. :class:`Specialization` records that, so a
call that differs gets a graph of its own.

The exported program is rewritten into the graph torch.fx would give: one placeholder per
``forward`` argument, parameters and buffers read by their qualified names (``get_attr``),
buffer updates written back in place, and the output rebuilt as ``forward`` returns it (a
Hugging Face ``ModelOutput`` stays one). ``build`` then places and lends the parameters as
for an fx graph, tied ones included, and the ``state_dict`` stays the plain module's.

Export runs on meta stand-ins for the parameters, buffers and inputs: nothing is computed or
copied, wherever the real tensors live. A device the code takes from a tensor
(``arange(n, device=x.device)``) is therefore ``meta`` in the graph: :func:`localize` makes it
the device of the stage or node that runs it. Code that mixes tensors it makes on the CPU
with the model's cannot run on meta; it is exported on the model's device instead.

torch.export fixes any size it sees as 0 or 1, so a batch of one sample (a micro-batch of
1) would give a graph for that size only. Such a batch is exported as a batch of two
stand-ins: the graph then holds for every batch size, while whoever runs it (the
profiler) still runs it on the real one.
"""

import inspect
import io
import logging
import operator
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, redirect_stderr
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from lightning_pipe.internals import (
    ASSERT_TENSOR_METADATA,
    GetAttrKey,
    KeyEntry,
    MappingKey,
    SequenceKey,
    TreeSpec,
    buffer_table,
    parameter_table,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_unflatten,
)

__all__ = ["ExportError", "Specialization", "bind_arguments", "export_graph", "localize", "localize_args"]

META = torch.device("meta")
_TORCH_DIR = os.path.dirname(torch.__file__)
_PREFIX = "module"  # the traced module's name inside _Call


class ExportError(RuntimeError):
    """torch.export could not capture the module's ``forward``."""


@dataclass(frozen=True)
class _TensorLeaf:
    dtype: torch.dtype
    sizes: tuple[int | None, ...]  # None where export kept the size symbolic


@dataclass(frozen=True)
class Specialization:
    """What an exported graph assumes about ``forward``'s arguments: their pytree structure,
    every non-tensor value, and each tensor's dtype, rank and the sizes export fixed."""

    spec: TreeSpec
    leaves: tuple[Any, ...]  # per leaf: a _TensorLeaf, or the non-tensor value itself

    def admits(self, arguments: dict[str, Any]) -> bool:
        """Whether the graph computes ``forward`` for these bound arguments."""
        leaves, spec = tree_flatten(arguments)
        return spec == self.spec and all(_admits(want, got) for want, got in zip(self.leaves, leaves))


def _admits(want: Any, got: Any) -> bool:
    if isinstance(want, _TensorLeaf):
        return (
            isinstance(got, Tensor)
            and got.dtype == want.dtype
            and got.dim() == len(want.sizes)
            and all(w is None or w == g for w, g in zip(want.sizes, got.shape))
        )
    return not isinstance(got, Tensor) and type(got) is type(want) and bool(got == want)


def bind_arguments(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``forward``'s arguments by parameter name, defaults filled in."""
    bound = _signature(module).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _signature(module: nn.Module) -> inspect.Signature:
    # The class's forward: the strategy shadows the instance's with the pipeline.
    return inspect.signature(types.MethodType(type(module).forward, module))


class _Call(nn.Module):
    """Calls the class's ``forward`` of ``module`` (bypassing the pipeline the strategy
    routes the instance's ``forward`` through)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.training = module.training

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


def export_graph(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], every_size: bool = False
) -> tuple[fx.GraphModule, Specialization]:
    """Export ``module.forward`` as called with ``args`` and ``kwargs``, in the modules' current
    training modes, into an fx graph module and what it is specialized to.

    Dim 0 of every input tensor stays symbolic (micro-batches vary in size, down to 1); with
    ``every_size`` every size does, where the model allows (say a sequence length that
    varies between batches), at a cost: symbolic sizes make export several times slower.

    Raises:
        ExportError: torch.export failed, or fixed the batch size; the message names the
            submodule and source line.
    """
    bound = _signature(module).bind(*args, **kwargs)
    bound.apply_defaults()
    call = (tuple(bound.args), dict(bound.kwargs))
    widen = _single(call)
    try:
        program = _export_anywhere(module, call, every_size, widen)
    except ExportError as err:
        if not widen:
            raise
        try:  # does the code run at batch size 1 only?
            _export_anywhere(module, call, every_size, widen=False)
        except ExportError:
            raise err from None
        raise ExportError(
            f"{err}\n{type(module).__name__}.forward captures at batch size 1 but not at 2: the code makes a shape "
            f"from a constant batch size of 1 (or drops the batch dimension), so it cannot run on micro-batches "
            f"of other sizes. Take the batch size from the input's shape instead."
        ) from None
    graph_module, specialization = _Rewrite(program, module).run(dict(bound.arguments))
    for (path, value), leaf in zip(tree_flatten_with_path(dict(bound.arguments))[0], specialization.leaves):
        fixed = isinstance(leaf, _TensorLeaf) and leaf.sizes and leaf.sizes[0] is not None
        if fixed and (widen or value.shape[0] > 1):  # exported at 1 beside larger batches: it broadcasts
            raise ExportError(
                f"torch.export fixed the batch size of {type(module).__name__}.forward's input "
                f"{_path(path)} to {leaf.sizes[0]}: the code makes a shape from a constant batch size, so "
                f"it cannot run on micro-batches. Take the batch size from the input's shape instead."
            )
    return graph_module, specialization


def _single(call: Any) -> bool:
    """Whether no input tensor has a batch (dim 0) over 1, so that export would fix it."""
    sizes = [x.shape[0] for x in tree_flatten(call)[0] if isinstance(x, Tensor) and x.dim()]
    return bool(sizes) and max(sizes) < 2


def _export_anywhere(module: nn.Module, call: Any, every_size: bool, widen: bool) -> ExportedProgram:
    """:func:`_export` on meta stand-ins, else on the model's device.

    Raises:
        ExportError: naming where export failed.
    """
    try:
        return _export(module, call, every_size, META, widen)
    except Exception as err:
        device = _device(module)
        if device is None:
            raise ExportError(_explain(module, err)) from None
        try:  # code that makes tensors on the CPU and mixes them with the model's (CPU) tensors
            return _export(module, call, every_size, device, widen)
        except Exception as err:
            raise ExportError(_explain(module, err)) from None


def _export(module: nn.Module, call: Any, every_size: bool, device: torch.device, widen: bool) -> ExportedProgram:
    """torch.export (non-strict) of ``_Call(module)(*call)`` on stand-ins on ``device``: meta
    stand-ins for everything, or copies of the inputs on the device of all the module's
    tensors; with ``widen``, two samples stand in for a batch of one."""
    with torch.inference_mode(False), torch.enable_grad(), _on_meta(module) if device == META else nullcontext():
        inputs = tree_map(lambda x: _stand_in(x, device, widen), call)
        dims = tree_map(lambda x: _dynamic(x, every_size), inputs)
        with _quiet():
            return torch.export.export(_Call(module), inputs, dynamic_shapes=dims, strict=False)


@contextmanager
def _quiet() -> Iterator[None]:
    """Hold back what a failing torch.export prints (its partial graph on stderr, a warning on
    the failing guard): the ExportError names the submodule and line instead. What a
    successful export prints goes through."""
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes.level
    shapes.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with redirect_stderr(held):
            yield
        sys.stderr.write(held.getvalue())
    finally:
        shapes.setLevel(level)


def _stand_in(x: Any, device: torch.device, widen: bool) -> Any:
    if not isinstance(x, Tensor):
        return x
    if widen and x.dim() and x.shape[0] < 2:  # export runs on fake tensors: the values never matter
        return x.new_empty((2, *x.shape[1:]), device=device)
    return torch.empty_like(x, device=META) if device == META else x.to(device).clone()  # no inference tensor


def _device(module: nn.Module) -> torch.device | None:
    """The one device all of the module's tensors are on, if there is one."""
    devices = {t.device for t in [*module.parameters(), *module.buffers()]}
    return devices.pop() if len(devices) == 1 else None


def _dynamic(x: Any, every_size: bool) -> dict[int, Any] | None:
    """The sizes of ``x`` export keeps symbolic (``Dim.AUTO``: unless the code fixes them)."""
    if not isinstance(x, Tensor):
        return None
    return dict.fromkeys(range(x.dim() if every_size else min(x.dim(), 1)), Dim.AUTO)


def _path(path: tuple[KeyEntry, ...]) -> str:
    """``batch['input_ids']`` for the path of a leaf of the arguments by name."""
    first = path[0]
    return (str(first.key) if isinstance(first, MappingKey) else str(first)) + "".join(map(str, path[1:]))


@contextmanager
def _on_meta(module: nn.Module) -> Iterator[None]:
    """Swap every parameter and buffer for a meta tensor of its shape while export traces;
    a tensor registered twice (tied weights) gets one stand-in."""
    stand_ins: dict[int, Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, Tensor]] = []
    for sub in module.modules():
        tables = (parameter_table(sub), buffer_table(sub))
        for table in tables:
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in stand_ins:
                    meta = torch.empty_like(tensor, device=META)
                    is_param = isinstance(tensor, nn.Parameter)
                    stand_ins[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if is_param else meta
                swapped.append((table, name, tensor))
                table[name] = stand_ins[id(tensor)]
    try:
        yield
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor


class _Rewrite:
    """An exported program as an fx graph over the module's own parameters and buffers."""

    def __init__(self, program: ExportedProgram, module: nn.Module) -> None:
        self.program = program
        self.module = module
        self.graph = fx.Graph()
        self.root = nn.Module()  # holds what get_attr reads: the module's tensors, by name
        self.attrs: dict[str, fx.Node] = {}

    def run(self, arguments: dict[str, Any]) -> tuple[fx.GraphModule, Specialization]:
        """The graph module over ``forward``'s ``arguments`` (by name), and its specialization."""
        signature = self.program.graph_signature
        inputs = self._inputs(arguments)
        env: dict[fx.Node, Any] = {}
        exported: list[fx.Node] = []  # export's placeholders of the user inputs
        for spec, node in zip(signature.input_specs, self.program.graph.find_nodes(op="placeholder")):
            if spec.kind == InputKind.USER_INPUT:
                env[node] = inputs[len(exported)]
                exported.append(node)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                assert spec.target is not None
                env[node] = self._attr(spec.target)
            else:
                raise ExportError(f"torch.export made a graph input of kind {spec.kind.name}, which no stage can run.")
        for node in self.program.graph.nodes:
            if node.op == "get_attr":  # a higher-order op's subgraph
                env[node] = self._attr(str(node.target))
            elif node.op == "call_function" and node.target not in _DROPPED:
                env[node] = self.graph.create_node(
                    node.op, node.target, fx.node.map_arg(node.args, env.__getitem__),
                    fx.node.map_arg(_kwargs(node), env.__getitem__), name=_name(node),
                )
                env[node].meta = dict(node.meta)
        self._outputs(env)
        for node in self.attrs.values():
            if not node.users:  # a tied weight's second name
                self.graph.erase_node(node)
        self.graph.lint()
        gm = fx.GraphModule(self.root, self.graph, class_name=type(self.module).__name__)
        return gm, _specialization(arguments, exported)

    def _inputs(self, arguments: dict[str, Any]) -> list[fx.Node]:
        """One placeholder per ``forward`` parameter, then one node per tensor or value in
        them (``batch["input_ids"]``), in the order export numbered its user inputs."""
        placeholders = {}
        for name, p in _signature(self.module).parameters.items():
            prefix = "*" if p.kind == p.VAR_POSITIONAL else "**" if p.kind == p.VAR_KEYWORD else ""
            placeholders[name] = self.graph.placeholder(prefix + name, default_value=p.default)
        made: dict[tuple[KeyEntry, ...], fx.Node] = {}
        leaves = []
        for path, _ in tree_flatten_with_path(arguments)[0]:
            assert isinstance(path[0], MappingKey)
            node = placeholders[path[0].key]
            for k in range(1, len(path)):
                if path[: k + 1] not in made:
                    made[path[: k + 1]] = self.graph.call_function(*_select(node, path[k]))
                node = made[path[: k + 1]]
            leaves.append(node)
        expected = sum(s.kind == InputKind.USER_INPUT for s in self.program.graph_signature.input_specs)
        assert len(leaves) == expected, f"{len(leaves)} input leaves for {expected} exported inputs"
        return leaves

    def _attr(self, target: str) -> fx.Node:
        """A get_attr of the module's tensor ``target`` (a constant export made keeps its name)."""
        own = target.removeprefix(_PREFIX + ".")
        if own not in self.attrs:
            if own != target:
                value = _get(self.module, own)
            elif target in self.program.constants:
                value = self.program.constants[target]
            else:
                value = _get(self.program.graph_module, target)
            _put(self.root, own, value)
            self.attrs[own] = self.graph.get_attr(own)
        return self.attrs[own]

    def _outputs(self, env: dict[fx.Node, Any]) -> None:
        """The user outputs rebuilt as ``forward`` returned them; a buffer or input export
        found mutated is written back where the new value is made."""
        values = fx.node.map_arg(self.program.graph.output_node().args[0], env.__getitem__)
        user = []
        for spec, value in zip(self.program.graph_signature.output_specs, values):
            if spec.kind == OutputKind.USER_OUTPUT:
                user.append(value)
            elif spec.kind in _MUTATIONS:
                assert spec.target is not None
                target = self._mutated(spec.kind, spec.target, env)  # an input, so made before value
                with self.graph.inserting_after(value):
                    self.graph.call_function(torch.ops.aten.copy_.default, (target, value))
            else:
                raise ExportError(f"torch.export made a graph output of kind {spec.kind.name}, which no stage can run.")
        structure = tree_unflatten(user, self.program.call_spec.out_spec)
        if not _plain(self.program.call_spec.out_spec):
            structure = self.graph.call_function(_rebuild(self.program.call_spec.out_spec), tuple(user))
        self.graph.output(structure)

    def _mutated(self, kind: OutputKind, target: str, env: dict[fx.Node, Any]) -> fx.Node:
        if kind == OutputKind.USER_INPUT_MUTATION:
            node: fx.Node = next(v for k, v in env.items() if k.op == "placeholder" and k.name == target)
            return node
        return self._attr(target)



def _kwargs(node: fx.Node) -> dict[str, Any]:
    """``node``'s keyword arguments, less the dtype export wrote into a move to a device
    (``x.to(device)`` is recorded as ``aten.to(dtype=<x's dtype when captured>, device=...)``):
    run on other dtypes (bfloat16 parameters under FSDP's mixed precision) the move keeps its
    input's, as the code does. (A move that also names the dtype it already had loses the
    cast: both are recorded alike.)"""
    kwargs = dict(node.kwargs)
    source = node.args[0] if node.target == torch.ops.aten.to.dtype_layout and node.args else None
    captured = source.meta.get("val") if isinstance(source, fx.Node) else None
    if kwargs.get("device") is not None and isinstance(captured, Tensor) and kwargs.get("dtype") == captured.dtype:
        del kwargs["dtype"]
    return kwargs


def _specialization(arguments: dict[str, Any], exported: list[fx.Node]) -> Specialization:
    values, spec = tree_flatten(arguments)
    leaves = []
    for value, node in zip(values, exported):
        if isinstance(value, Tensor):
            sizes = tuple(int(s) if is_concrete_int(s) else None for s in node.meta["val"].shape)
            leaves.append(_TensorLeaf(value.dtype, sizes))
        else:
            leaves.append(value)
    return Specialization(spec, tuple(leaves))

_DROPPED = {ASSERT_TENSOR_METADATA}  # checks of the meta stand-ins' devices
_MUTATIONS = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION, OutputKind.USER_INPUT_MUTATION)


def _select(node: fx.Node, key: KeyEntry) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if isinstance(key, SequenceKey):
        return operator.getitem, (node, key.idx)
    if isinstance(key, MappingKey):
        return operator.getitem, (node, key.key)
    if isinstance(key, GetAttrKey):
        return getattr, (node, key.name)
    raise ExportError(f"forward's inputs hold a {type(key).__name__}; pass tensors, or tuples, lists, dicts of them.")


def _name(node: fx.Node) -> str:
    """``model_transformer_h_0_attn_addmm``: the innermost module, then the operation."""
    base = node.name.rstrip("0123456789").rstrip("_") or node.name
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return base
    path = str(list(stack.values())[-1][0])
    path = path.split(_PREFIX + ".", 1)[1] if _PREFIX + "." in path else ""
    return f"{path.replace('.', '_')}_{base}" if path else base


def _plain(spec: TreeSpec) -> bool:
    """Whether fx's output node can hold the structure itself (tuples, lists, dicts)."""
    return spec.is_leaf() or (spec.type in (tuple, list, dict, type(None)) and all(map(_plain, spec.children_specs)))


def _rebuild(spec: TreeSpec) -> Callable[..., Any]:
    """A graph function making ``forward``'s output (a ``ModelOutput``, a dataclass) from its
    leaves, so the pipeline returns the type ``forward`` does."""

    def rebuild(*leaves: Any) -> Any:
        return tree_unflatten(list(leaves), spec)

    rebuild.__name__ = rebuild.__qualname__ = f"make_{spec.type.__name__}"
    return rebuild


def _get(root: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        root = getattr(root, part)
    return root


def _put(root: nn.Module, qualname: str, value: Any) -> None:
    *path, name = qualname.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    if isinstance(value, nn.Parameter):
        root.register_parameter(name, value)
    elif isinstance(value, Tensor):
        root.register_buffer(name, value)
    else:
        setattr(root, name, value)


def localize(gm: fx.GraphModule, device: torch.device) -> None:
    """Make the devices export left open (``meta``) in ``gm`` ``device``, where it runs."""
    changed = False
    for node in gm.graph.nodes:
        args, kwargs = localize_args((node.args, node.kwargs), device)
        if (args, kwargs) != (node.args, node.kwargs):
            node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        gm.recompile()


def localize_args(value: Any, device: torch.device) -> Any:
    """``value`` with every open device (``meta``) made ``device``."""
    return fx.node.map_aggregate(value, lambda x: device if isinstance(x, torch.device) and x.type == "meta" else x)


def _explain(module: nn.Module, err: Exception) -> str:
    """Where export failed: the innermost submodule running and the last line of model code."""
    cls = type(module).__name__
    names = {id(m): name for name, m in module.named_modules()}
    failed = err
    while failed.__cause__ is not None and not _user_frames(failed):
        failed = failed.__cause__  # type: ignore[assignment]
    where, inner = "", None
    tb = failed.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and names.get(id(owner)):
            inner = names[id(owner)], type(owner).__name__
        tb = tb.tb_next
    frames = _user_frames(failed)
    if frames:
        where = f" at {frames[-1].filename}:{frames[-1].lineno}: `{frames[-1].line}`"
    head = f"in submodule '{inner[0]}' ({inner[1]})" if inner else f"in {cls}.forward itself"
    first = (str(failed).strip().splitlines() or [""])[0]
    return f"torch.export could not capture {cls}.forward {head}{where}.\n  {type(failed).__name__}: {first}"


def _user_frames(err: BaseException) -> list[traceback.FrameSummary]:
    skipped = (_TORCH_DIR, os.path.dirname(__file__), "<")  # torch, this package, generated code
    return [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(skipped)]
