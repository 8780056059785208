"""Capture: trace a module's ``forward`` into a graph of fine-grained nodes.

The nodes (ops and leaf modules) are the units the pipeline is cut between. torch.fx comes
first: it needs no inputs, keeps leaf modules whole and makes one graph for any input. Where
it fails and example inputs are at hand, torch.export takes over (:mod:`.export`; most
Hugging Face models). A model neither captures fails with one :class:`CaptureError` that
points, per front end, at the submodule and source line, and says what to change.
"""

import operator
import os
import re
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, fx, nn

from lightning_pipe.graph.export import ExportError, Specialization, export_graph
from lightning_pipe.graph.stacks import layer_by_layer
from lightning_pipe.internals import buffer_table, op_schema

__all__ = ["CaptureError", "Captured", "NeedsExampleInputs", "buffer_writes", "capture", "get_attr"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)

#: Node kinds the pipeline cuts between; placeholders, attribute reads and the output
#: are not compute and go where their users are.
COMPUTE_OPS = ("call_module", "call_function", "call_method")


class CaptureError(RuntimeError):
    """The model's ``forward`` cannot be turned into a graph."""


class NeedsExampleInputs(CaptureError):
    """torch.fx could not trace ``forward``; torch.export may, given example inputs."""


@dataclass
class Captured:
    """A traced ``forward``: the graph module and its compute nodes in execution order.

    An exported graph (``front_end="torch.export"``) holds only for the inputs its
    ``specialization`` admits; an fx graph holds for any.
    """

    graph_module: fx.GraphModule
    nodes: list[fx.Node]
    front_end: str = "torch.fx"
    specialization: Specialization | None = None

    def admits(self, arguments: dict[str, Any]) -> bool:
        """Whether the graph computes ``forward`` for these arguments (by parameter name)."""
        return self.specialization is None or self.specialization.admits(arguments)

    def params_by_node(self) -> list[list[nn.Parameter]]:
        """Parameters per compute node; a shared parameter belongs to its first user."""
        seen: set[int] = set()
        result = []
        for node in self.nodes:
            own = []
            for param in _params_of(self.graph_module, node):
                if id(param) not in seen:
                    seen.add(id(param))
                    own.append(param)
            result.append(own)
        return result

    def param_bytes(self) -> list[int]:
        """Parameter bytes per compute node; a shared parameter counts at its first user."""
        return [sum(p.numel() * p.element_size() for p in ps) for ps in self.params_by_node()]


def _params_of(root: nn.Module, node: fx.Node) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    if node.op == "call_module":
        params.extend(root.get_submodule(str(node.target)).parameters())
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = get_attr(root, str(arg.target))
            if isinstance(value, nn.Parameter):
                params.append(value)
    return params


def get_attr(root: nn.Module, qualname: str) -> Any:
    """The attribute at dotted path ``qualname`` below ``root``."""
    value: Any = root
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


class _Tracer(fx.Tracer):
    """An fx tracer that honours user leaf modules and remembers where tracing failed."""

    def __init__(self, leaf_modules: Sequence[str]) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True  # so buffers can be sliced by traced sizes
        self.leaf_modules = set(leaf_modules)
        self.stack: list[tuple[str, str]] = []
        self.failed_in: tuple[str, str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self._user_leaf(m, module_qualified_name) or super().is_leaf_module(m, module_qualified_name)

    def _user_leaf(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaf_modules or type(m).__name__ in self.leaf_modules

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = self.path_of_module(m)
        self.stack.append((path, type(m).__name__))
        try:
            layers = None if self._user_leaf(m, path) else layer_by_layer(m, args, kwargs)
            if layers is not None:  # a layer stack: each layer a node (torch.fx would keep it whole)
                return layers()
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.stack[-1]
            raise
        finally:
            self.stack.pop()


def capture(
    module: nn.Module,
    leaf_modules: Sequence[str] = (),
    example_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    every_size: bool = False,
) -> Captured:
    """Trace ``module.forward`` into a :class:`Captured` graph, in the modules' current
    training modes: with torch.fx, else (given ``example_inputs``) with torch.export.

    Args:
        module: the model; its class's ``forward`` is traced, with ``torch.nn`` modules and
            the ``leaf_modules`` kept as single nodes, except ``nn.TransformerEncoder`` and
            ``nn.TransformerDecoder``, whose layers are (:mod:`.stacks`).
        leaf_modules: qualified submodule names (``"blocks.3"``) or class names
            (``"Block"``) to keep as single opaque nodes (torch.fx only).
        example_inputs: ``(args, kwargs)`` of a ``forward`` call, which torch.export runs on
            meta stand-ins; the graph is specialized to their structure (see
            :class:`Captured`).
        every_size: torch.export keeps every size symbolic, not only the batch size
            (:func:`~lightning_pipe.graph.export.export_graph`).

    Raises:
        NeedsExampleInputs: torch.fx failed and there are no ``example_inputs`` for export.
        CaptureError: no front end could capture ``forward``, or a ``leaf_modules`` entry
            matches no submodule.
    """
    unmatched = sorted(set(leaf_modules) - _names(module))
    if unmatched:
        raise CaptureError(
            f"leaf_modules entries {unmatched} match no submodule name or class name of "
            f"{type(module).__name__}. Use a qualified name from `named_modules()` such as "
            f"{_example_names(module)} or a class name."
        )
    tracer = _Tracer(leaf_modules)
    tracer.record_stack_traces = True  # a buffer written in forward is named with its line
    before = _plain_attributes(module)
    try:
        graph = tracer.trace(module)
    except Exception as err:
        traced = _explain(module, tracer, err)
    else:
        _refuse_changed_attributes(module, before)
        return _captured(module, fx.GraphModule(module, graph, class_name=type(module).__name__))
    if example_inputs is None:
        raise NeedsExampleInputs(traced) from None
    try:
        graph_module, specialization = export_graph(module, *example_inputs, every_size)
    except ExportError as err:
        raise CaptureError(
            f"Neither torch.fx nor torch.export could capture {type(module).__name__}.forward; "
            f"either fix works.\n{traced}\n{err}\n{_EXPORT_FIX}"
        ) from None
    return _captured(module, graph_module, "torch.export", specialization)


_EXPORT_FIX = (
    "For torch.export, make that code run on fake tensors: no Python `if`, `.item()` or "
    "`.tolist()` on tensor values (torch.where and torch.cond instead); for Hugging Face "
    "models, `use_cache=False` in the config."
)


def _captured(
    module: nn.Module,
    graph_module: fx.GraphModule,
    front_end: str = "torch.fx",
    specialization: Specialization | None = None,
) -> Captured:
    nodes = [n for n in graph_module.graph.nodes if n.op in COMPUTE_OPS]
    if not nodes:
        raise CaptureError(f"{type(module).__name__}.forward traced to a graph with no operations.")
    return Captured(graph_module, nodes, front_end, specialization)


def buffer_writes(captured: Captured) -> dict[str, str]:
    """Buffers the graph writes in place (``self.ema.mul_(0.9)``, ``self.count += 1``, an
    exported graph's write-back of a mutated buffer), each with where ``forward`` does it.
    BatchNorm's running statistics inside a leaf module do not show here."""
    buffers = dict(captured.graph_module.named_buffers())
    found: dict[str, str] = {}
    for node in captured.graph_module.graph.nodes:
        target = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if target is None or target.op != "get_attr" or target.target not in buffers or not _in_place(node):
            continue
        found.setdefault(str(target.target), _user_line(node.meta.get("stack_trace") or "") or str(node.target))
    return found


def _user_line(stack_trace: str) -> str | None:
    """The last frame of a node's recorded stack that is the user's code, as ``file:line: code``."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', stack_trace)
    own = [(path, line, code) for path, line, code in frames if not path.startswith((_TORCH_DIR, _OWN_DIR))]
    if not own:
        return None
    path, line, code = own[-1]
    return f"{os.path.basename(path)}:{line}: {code.strip()}"


def _in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).startswith("_")
    if node.op != "call_function":
        return False
    if node.target in _IN_PLACE_OPERATORS:
        return True
    schema = op_schema(node.target)
    return bool(schema is not None and schema.arguments and schema.arguments[0].alias_info is not None
                and schema.arguments[0].alias_info.is_write)


_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor}


def _plain_attributes(module: nn.Module) -> dict[tuple[str, str], object]:
    """Every submodule's plain number and string attributes and its buffers, by (submodule, name)."""
    found: dict[tuple[str, str], object] = {}
    for path, sub in module.named_modules():
        found.update(((path, name), value) for name, value in vars(sub).items()
                     if isinstance(value, int | float | str) and not name.startswith("_"))
        found.update(((path, name), buffer) for name, buffer in buffer_table(sub).items())
    return found


def _refuse_changed_attributes(module: nn.Module, before: dict[tuple[str, str], object]) -> None:
    """Tracing ran ``forward``'s Python code once; an attribute it changed (``self.calls += 1``)
    would never change again, since the graph holds only tensor operations.

    Raises:
        CaptureError: naming the attribute (set back to its value before tracing) and the fix.
    """
    after = _plain_attributes(module)
    changed = [key for key, value in before.items() if not _unchanged(value, after.get(key))]
    for path, name in changed:
        sub = module.get_submodule(path)
        buffers = buffer_table(sub)
        if name in buffers:  # tracing assigned a Proxy to it (self.count += 1)
            buffers[name] = cast(Tensor, before[(path, name)])
        else:
            setattr(sub, name, before[(path, name)])
    if changed:
        path, name = changed[0]
        owner = f"{path}.{name}" if path else name
        old = before[changed[0]]
        what = "buffer" if isinstance(old, Tensor) else f"Python attribute (it was {old!r})"
        raise CaptureError(
            f"{type(module).__name__}.forward assigns to the {what} {owner!r}: the captured graph holds only "
            f"forward's tensor operations, so the pipeline would never make that assignment. Update it in "
            f"training_step or a callback (on_train_batch_end), not in forward."
        )


def _unchanged(before: object, after: object) -> bool:
    if isinstance(before, Tensor) or isinstance(after, Tensor | fx.Proxy):
        return before is after
    return before == after


def _names(module: nn.Module) -> set[str]:
    names: set[str] = set()
    for name, sub in module.named_modules():
        names.update((name, type(sub).__name__))
    return names


def _example_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_modules() if name][:3]


def _explain(module: nn.Module, tracer: _Tracer, err: Exception) -> str:
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not f.filename.startswith((_TORCH_DIR, _OWN_DIR))
    ]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}: `{frames[-1].line}`" if frames else ""
    cls = type(module).__name__
    if tracer.failed_in is not None:
        path, kind = tracer.failed_in
        head = f"in submodule '{path}' ({kind}){where}"
        fix = (
            f"Mark it as a leaf so it runs as one opaque node: "
            f'MemoryPipeStrategy(leaf_modules=["{path}"]), or leaf_modules=["{kind}"] '
            f"for every {kind}."
        )
    else:
        head = f"in {cls}.forward itself{where}"
        fix = (
            "Move the untraceable code into a submodule and list it in "
            "MemoryPipeStrategy(leaf_modules=[...]), or make it traceable "
            "(no Python control flow on tensor values)."
        )
    return (
        f"torch.fx could not trace {cls}.forward {head}.\n"
        f"  {type(err).__name__}: {err}\n"
        f"{fix}"
    )
