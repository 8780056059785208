"""Build: cut a captured graph into stage modules and place them on their devices.

:func:`torch.fx.passes.split_module.split_module` does the cut; its top-level graph says
which value each stage reads and writes, which is all the runtime needs (:class:`Program`).
Stages share the model's ``Parameter`` objects, so the LightningModule's ``state_dict`` and
optimizer see one parameter set. A parameter or buffer used by several stages (tied weights,
a module called in two places) lives on the device of its first user; later users borrow it
(:mod:`~lightning_pipe.runtime.lend`): a parameter as one differentiable copy per batch on
their device, so its gradient accumulates in the one real parameter, a buffer as a copy per
call whose updates are written back.
"""

import inspect
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from lightning_pipe.graph.capture import Captured, get_attr
from lightning_pipe.graph.export import localize
from lightning_pipe.plan.balance import check_balance
from lightning_pipe.plan.policy import Policy
from lightning_pipe.runtime import swap
from lightning_pipe.runtime.lend import Lender, lent_buffers
from lightning_pipe.runtime.transport import move

__all__ = ["Policy", "Program", "Segment", "Stage", "build"]




@dataclass
class Segment:
    """Consecutive nodes of one stage that share a memory policy.

    ``keep`` stashes what autograd saves; ``recompute`` stashes only the segment's inputs and
    runs it again before its backward (``torch.utils.checkpoint``, non-reentrant); ``swap``
    sends what autograd saves to host memory until backward needs it.
    """

    module: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    policy: Policy = "keep"
    borrowed: dict[str, nn.Parameter] = field(default_factory=dict)
    borrowed_buffers: dict[str, Tensor] = field(default_factory=dict)
    lender: Lender = field(default_factory=Lender)  # the program's (see _place)

    def __call__(self, device: torch.device, *args: Any) -> tuple[tuple[Any, ...], list[swap.Swapped]]:
        """The segment's outputs, and what it sent to host memory (only under ``swap``)."""
        lent = {name: self.lender.lend(p, device) for name, p in self.borrowed.items()}
        if self.policy == "recompute":
            return checkpoint(self._forward, lent, device, *args, use_reentrant=False), []
        if self.policy == "swap":
            hooks = swap.to_host((args, lent))  # the batch keeps the lent copies anyway
            with hooks:
                outputs = self._forward(lent, device, *args)
            return outputs, hooks.swapped
        return self._forward(lent, device, *args), []

    def _forward(self, lent: dict[str, Tensor], device: torch.device, *args: Any) -> tuple[Any, ...]:
        if not (lent or self.borrowed_buffers):
            return cast(tuple[Any, ...], self.module(*args))
        with lent_buffers(self.borrowed_buffers, device) as buffers:
            return cast(tuple[Any, ...], torch.func.functional_call(self.module, {**lent, **buffers}, args))


@dataclass
class Stage:
    """One pipeline stage: what it computes, where, and which values it reads and writes."""

    index: int
    device: torch.device
    segments: list[Segment]
    inputs: list[str]
    outputs: list[str]
    node_names: list[str]
    owned: list[Tensor] = field(default_factory=list)  # parameters and buffers placed here

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        env = dict(zip(self.inputs, args))
        last = {name: k for k, seg in enumerate(self.segments) for name in seg.inputs}
        sent: list[swap.Swapped] = []  # what the previous segment swapped out
        for k, seg in enumerate(self.segments):
            outputs, swapped = seg(self.device, *[env[n] for n in seg.inputs])
            swap.prefetch(outputs, sent)  # bring it back while this segment's backward runs
            sent = swapped
            env.update(zip(seg.outputs, outputs))
            for name in [n for n in seg.inputs if last[n] == k and n not in self.outputs]:
                del env[name]  # free values no later segment of this stage reads
        swap.prefetch(outputs, sent)  # the stage's last segment: when its own backward begins
        return tuple(env[name] for name in self.outputs)

    @property
    def borrowed(self) -> list[nn.Parameter]:
        """Parameters this stage's modules use but another stage owns (tied weights)."""
        return list({id(p): p for seg in self.segments for p in seg.borrowed.values()}.values())

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter the stage's nodes use, owned or borrowed."""
        return list({id(p): p for seg in self.segments for p in seg.module.parameters()}.values())

    def param_bytes(self) -> int:
        """Bytes of the parameters this stage owns (borrowed ones count at their owner)."""
        return sum(p.numel() * p.element_size() for p in self.owned if isinstance(p, nn.Parameter))


@dataclass
class Program:
    """The stages and the dataflow between them, as names of values."""

    stages: list[Stage]
    signature: inspect.Signature
    placeholders: dict[str, str]  # value name -> forward argument name
    attributes: dict[str, str]  # top-level value name -> qualified attribute of the model
    output: Any  # pytree of value names
    last_use: dict[str, int]  # value name -> last stage reading it (len(stages) for outputs)
    constants: dict[str, Tensor] = field(default_factory=dict)  # tensors the graph made, not the model's
    lender: Lender = field(default_factory=Lender)  # copies of borrowed parameters

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Name the forward call's arguments as the graph's input values."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return {name: bound.arguments[arg.lstrip("*")] for name, arg in self.placeholders.items()}

    def attribute_values(self, root: nn.Module) -> dict[str, Tensor]:
        """The current parameters and buffers the graph reads by attribute, and its constants."""
        return {**self.constants, **{name: get_attr(root, q) for name, q in self.attributes.items()}}

    def fetch(self, name: str, value: Any, device: torch.device) -> Any:
        """The value ``name`` as an input on ``device``: a parameter read by attribute is
        lent (one copy per batch), anything else moved."""
        if name in self.attributes and isinstance(value, nn.Parameter):
            return self.lender.lend(value, device)
        return move(value, device)


def build(
    captured: Captured,
    root: nn.Module,
    balance: Sequence[int],
    devices: Sequence[torch.device],
    policies: Mapping[str, Policy] | None = None,
    place: bool = True,
) -> Program:
    """Split ``captured`` by ``balance`` (nodes per stage) and place stage ``i`` on ``devices[i]``.

    ``policies`` maps node names to ``"recompute"`` or ``"swap"``; other nodes keep their
    activations. Consecutive nodes of a stage with one policy form a :class:`Segment`.
    ``place=False`` leaves parameters and buffers where they are (another graph of a model
    already placed, such as its eval graph): a stage borrows what lives on another device.
    """
    balance = check_balance(balance, len(captured.nodes), len(devices))
    policies = dict(policies or {})
    unknown = sorted(set(policies) - {n.name for n in captured.nodes})
    if unknown:
        raise ValueError(f"policies name nodes the graph does not have: {unknown[:5]}.")
    bad = sorted({p for p in policies.values() if p not in ("keep", "recompute", "swap")})
    if bad:
        raise ValueError(f"Unknown memory policies {bad}; use 'keep', 'recompute' or 'swap'.")
    stage_of_node: dict[str, int] = {}
    segment_of: dict[str, int] = {}
    segment_stage: list[int] = []
    segment_policy: list[Policy] = []
    names_per_stage: list[list[str]] = [[] for _ in balance]
    ranges = [(sum(balance[:i]), sum(balance[: i + 1])) for i in range(len(balance))]
    for stage, (start, stop) in enumerate(ranges):
        for node in captured.nodes[start:stop]:
            policy = policies.get(node.name, "keep")
            if not segment_stage or segment_stage[-1] != stage or segment_policy[-1] != policy:
                segment_stage.append(stage)
                segment_policy.append(policy)
            segment_of[node.name] = len(segment_stage) - 1
            stage_of_node[node.name] = stage
            names_per_stage[stage].append(node.name)

    top = split_module(
        captured.graph_module,
        root,
        lambda node: segment_of[node.name],
        keep_original_order=True,
        tuple_return=True,
    )
    segments: list[tuple[int, Segment]] = []
    placeholders: dict[str, str] = {}
    attributes: dict[str, str] = {}
    constants: dict[str, Tensor] = {}
    output: Any = None
    for node in top.graph.nodes:
        if node.op == "placeholder":
            placeholders[node.name] = str(node.target)
        elif node.op == "get_attr" and _has_attr(root, str(node.target)):
            attributes[node.name] = str(node.target)
        elif node.op == "get_attr":
            constants[node.name] = get_attr(top, str(node.target))
        elif node.op == "call_module":
            k = len(segments)
            module = getattr(top, str(node.target))
            localize(module, torch.device(devices[segment_stage[k]]))  # devices export left open
            outputs = [""] * len(_returned(module))
            for user in node.users:
                outputs[user.args[1]] = user.name  # users are getitem(node, k)
            segment = Segment(module, [a.name for a in node.args], outputs, segment_policy[k])
            segments.append((segment_stage[k], segment))
        elif node.op == "output":
            output = fx.node.map_arg(node.args[0], lambda n: n.name)

    num_stages = len(balance)
    readers: dict[str, set[int]] = {}
    for stage, segment in segments:
        for name in segment.inputs:
            readers.setdefault(name, set()).add(stage)
    fx.node.map_arg(top.graph.output_node().args[0], lambda n: readers.setdefault(n.name, set()).add(num_stages))
    stages = []
    for index in range(num_stages):
        own = [seg for stage, seg in segments if stage == index]
        made = {name for seg in own for name in seg.outputs}
        inputs = list(dict.fromkeys(n for seg in own for n in seg.inputs if n not in made))
        outputs = [n for n in dict.fromkeys(n for seg in own for n in seg.outputs) if readers.get(n, set()) - {index}]
        stages.append(Stage(index, torch.device(devices[index]), own, inputs, outputs, names_per_stage[index]))
    last_use = {name: max(r) for name, r in readers.items()}
    program = Program(
        stages=stages,
        signature=inspect.signature(types.MethodType(type(root).forward, root)),
        placeholders=placeholders,
        attributes=attributes,
        output=output,
        last_use=last_use,
        constants=constants,
    )
    _place(program, root, place)
    return program


def _has_attr(root: nn.Module, qualname: str) -> bool:
    try:
        get_attr(root, qualname)
    except AttributeError:
        return False
    return True


def _returned(stage_module: fx.GraphModule) -> tuple[Any, ...]:
    return cast(tuple[Any, ...], stage_module.graph.output_node().args[0])  # split_module's tuple_return


def _place(program: Program, root: nn.Module, place: bool = True) -> None:
    """Put every parameter and buffer on the device of the first stage that uses it; later
    stages borrow it. Without ``place``, nothing moves and a stage also borrows what lives
    on another device."""
    owner: dict[int, Stage] = {}

    def on(tensor: Tensor, stage: Stage) -> bool:  # a meta tensor gets storage where its stage runs
        return place or tensor.device == stage.device or tensor.is_meta

    def borrows(tensor: Tensor, stage: Stage) -> bool:
        return owner.setdefault(id(tensor), stage) is not stage or not on(tensor, stage)

    for stage in program.stages:
        for segment in stage.segments:
            segment.lender = program.lender
            for name, param in segment.module.named_parameters(remove_duplicate=False):
                if borrows(param, stage):
                    segment.borrowed[name] = param
            for name, buffer in segment.module.named_buffers(remove_duplicate=False):
                if borrows(buffer, stage):
                    segment.borrowed_buffers[name] = buffer
    for value, qualname in program.attributes.items():
        readers = [s for s in program.stages if value in s.inputs]
        tensor = get_attr(root, qualname)
        if readers:
            owner.setdefault(id(tensor), readers[0])
    for tensor in list(root.parameters()) + list(root.buffers()):
        stage = owner.get(id(tensor), program.stages[0])
        if place:
            _move_in_place(tensor, stage.device)
        if on(tensor, stage):
            stage.owned.append(tensor)


def _move_in_place(tensor: Tensor, device: torch.device) -> None:
    # Keep the object: the LightningModule, its state_dict and the optimizer refer to it.
    tensor.data = tensor.data.to(device)
    if tensor.grad is not None:
        tensor.grad = tensor.grad.to(device)
