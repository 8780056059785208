"""Build: cut a captured graph into stage modules and place them on their devices.

:func:`torch.fx.passes.split_module.split_module` does the cut; its top-level graph says
which value each stage reads and writes, which is all the runtime needs (:class:`Program`).
Stages share the model's ``Parameter`` objects, so the LightningModule's ``state_dict`` and
optimizer see one parameter set. A parameter used by several stages (tied weights) lives on
the device of its first user; later users get a differentiable copy on their own device,
so its gradient accumulates in the one real parameter.
"""

import inspect
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.fx.passes.split_module import split_module

from lightning_pipe.capture import Captured, get_attr
from lightning_pipe.partition import check_balance
from lightning_pipe.transport import move

__all__ = ["Program", "Stage", "build"]


@dataclass
class Stage:
    """One pipeline stage: what it computes, where, and which values it reads and writes."""

    index: int
    device: torch.device
    module: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    node_names: list[str]
    borrowed: dict[str, nn.Parameter] = field(default_factory=dict)
    owned: list[Tensor] = field(default_factory=list)  # parameters and buffers placed here

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if not self.borrowed:
            return self.module(*args)
        params = {name: move(p, self.device) for name, p in self.borrowed.items()}
        return torch.func.functional_call(self.module, params, args)

    def param_bytes(self) -> int:
        """Bytes of the parameters this stage owns (borrowed ones count at their owner)."""
        return sum(p.numel() * p.element_size() for p in self.owned if isinstance(p, nn.Parameter))


@dataclass
class Program:
    """The stages and the dataflow between them, as names of values."""

    stages: list[Stage]
    signature: inspect.Signature
    placeholders: list[str]
    attributes: dict[str, str]  # top-level value name -> qualified attribute of the model
    output: Any  # pytree of value names
    last_use: dict[str, int]  # value name -> last stage reading it (len(stages) for outputs)

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Name the forward call's arguments as the graph's input values."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return {name: bound.arguments[name.lstrip("*")] for name in self.placeholders}

    def attribute_values(self, root: nn.Module) -> dict[str, Tensor]:
        """The current parameters and buffers the graph reads by attribute."""
        return {name: get_attr(root, q) for name, q in self.attributes.items()}


def build(
    captured: Captured, root: nn.Module, balance: Sequence[int], devices: Sequence[torch.device]
) -> Program:
    """Split ``captured`` by ``balance`` (nodes per stage) and place stage ``i`` on ``devices[i]``."""
    balance = check_balance(balance, len(captured.nodes), len(devices))
    stage_of: dict[str, int] = {}
    names_per_stage: list[list[str]] = []
    start = 0
    for index, count in enumerate(balance):
        names = [n.name for n in captured.nodes[start : start + count]]
        stage_of.update(dict.fromkeys(names, index))
        names_per_stage.append(names)
        start += count

    top = split_module(
        captured.graph_module,
        root,
        lambda node: stage_of[node.name],
        keep_original_order=True,
        tuple_return=True,
    )
    stages: list[Stage] = []
    placeholders: list[str] = []
    attributes: dict[str, str] = {}
    output: Any = None
    for node in top.graph.nodes:
        if node.op == "placeholder":
            placeholders.append(str(node.target))
        elif node.op == "get_attr":
            attributes[node.name] = str(node.target)
        elif node.op == "call_module":
            index = len(stages)
            outputs = [""] * len(_returned(getattr(top, str(node.target))))
            for user in node.users:
                outputs[user.args[1]] = user.name  # users are getitem(node, k)
            stages.append(
                Stage(
                    index=index,
                    device=torch.device(devices[index]),
                    module=getattr(top, str(node.target)),
                    inputs=[a.name for a in node.args],
                    outputs=outputs,
                    node_names=names_per_stage[index],
                )
            )
        elif node.op == "output":
            output = fx.node.map_arg(node.args[0], lambda n: n.name)

    last_use: dict[str, int] = {}
    for stage in stages:
        last_use.update(dict.fromkeys(stage.inputs, stage.index))
    fx.node.map_arg(top.graph.output_node().args[0], lambda n: last_use.__setitem__(n.name, len(stages)))
    program = Program(
        stages=stages,
        signature=inspect.signature(types.MethodType(type(root).forward, root)),
        placeholders=placeholders,
        attributes=attributes,
        output=output,
        last_use=last_use,
    )
    _place(program, root)
    return program


def _returned(stage_module: fx.GraphModule) -> tuple:
    return stage_module.graph.output_node().args[0]


def _place(program: Program, root: nn.Module) -> None:
    """Put every parameter and buffer on the device of the first stage that uses it."""
    owner: dict[int, Stage] = {}
    for stage in program.stages:
        for name, param in stage.module.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(param), stage)
            if first is not stage:
                stage.borrowed[name] = param
        for buffer in stage.module.buffers():
            owner.setdefault(id(buffer), stage)
    for value, qualname in program.attributes.items():
        readers = [s for s in program.stages if value in s.inputs]
        tensor = program.attribute_values(root)[value]
        if readers:
            owner.setdefault(id(tensor), readers[0])
    for tensor in list(root.parameters()) + list(root.buffers()):
        stage = owner.get(id(tensor), program.stages[0])
        _move_in_place(tensor, stage.device)
        stage.owned.append(tensor)


def _move_in_place(tensor: Tensor, device: torch.device) -> None:
    # Keep the object: the LightningModule, its state_dict and the optimizer refer to it.
    tensor.data = tensor.data.to(device)
    if tensor.grad is not None:
        tensor.grad = tensor.grad.to(device)
