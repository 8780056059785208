"""Variants: the graphs of one module's ``forward``, each captured when first needed.

A graph is captured in the modules' training modes of the moment: a ``self.training``
branch is traced one way, and torch.export records dropout and batch norm for that mode. An
exported graph also holds only for the inputs it was specialized to. So every call runs the
graph captured for the module's current modes and, for an exported graph, its inputs; a
call with new ones captures another. Graphs that come out the same are one variant. An
exported graph keeps only the batch size symbolic at first (export is several times faster);
when a call brings other sizes, the next capture keeps every size symbolic.
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import pairwise
from typing import Any

from torch import nn

from lightning_pipe.graph.capture import Captured, capture
from lightning_pipe.graph.export import bind_arguments
from lightning_pipe.internals import tree_structure

__all__ = ["Variants", "follow_balance", "in_mode", "modes"]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def modes(module: nn.Module) -> tuple[bool, ...]:
    """The training flag of every submodule: what a captured graph depends on."""
    return tuple(m.training for m in module.modules())


class Variants:
    """The captured graphs of ``module.forward``, by training modes and inputs."""

    def __init__(self, module: nn.Module, leaf_modules: Sequence[str] = ()) -> None:
        self.module = module
        self.leaf_modules = list(leaf_modules)
        self.graphs: list[tuple[tuple[bool, ...], Captured]] = []

    def training_graph(self, inputs: Inputs | None = None) -> Captured:
        """The graph with every module in training mode, the one a pipeline is planned and
        placed for, whatever mode the module is in now (Lightning validates before it
        trains). Without ``inputs`` only torch.fx can capture it."""
        with in_mode(self.module, training=True):
            return self.get(inputs)

    def known(self, inputs: Inputs | None = None) -> Captured | None:
        """The graph already captured for the module's current modes and these inputs, if any."""
        key = modes(self.module)
        arguments = bind_arguments(self.module, *inputs) if inputs is not None else None
        for k, captured in self.graphs:
            if k == key and (captured.specialization is None or (arguments is not None and captured.admits(arguments))):
                return captured
        return None

    def get(self, inputs: Inputs | None = None) -> Captured:
        """The graph for the module's current modes and these ``(args, kwargs)``, captured at
        the first call that needs it.

        Raises:
            CaptureError: see :func:`~lightning_pipe.graph.capture.capture`.
        """
        known = self.known(inputs)
        if known is not None:
            return known
        key = modes(self.module)
        arguments = bind_arguments(self.module, *inputs) if inputs is not None else None
        # A second graph for the same modes and input structure: a size changed, so keep them all symbolic.
        again = arguments is not None and any(
            k == key and c.specialization is not None and c.specialization.spec == tree_structure(arguments)
            for k, c in self.graphs
        )
        captured = capture(self.module, self.leaf_modules, inputs, every_size=again)
        code = captured.graph_module.code
        for _, known in self.graphs:
            if known.graph_module.code == code and (arguments is None or known.admits(arguments)):
                captured = known  # one variant, one pipeline
        self.graphs.append((key, captured))
        return captured


@contextmanager
def in_mode(module: nn.Module, training: bool) -> Iterator[None]:
    """Every submodule in training (or evaluation) mode inside, each one's mode restored after."""
    before = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, training in before:
            m.training = training


def follow_balance(captured: Captured, stage_of: Mapping[int, int], stages: int) -> list[int]:
    """A balance for ``captured`` under which every parameter's first user is on the stage that
    owns it (``stage_of``: ``id(parameter)`` to stage), so that a second graph of a model (its
    eval graph) runs on the parameters where the first graph placed them, and each stage
    stops right before the first node using a later stage's parameters. Where the graphs use
    parameters in another order, the cuts are the closest that leave no stage empty."""
    n = len(captured.nodes)
    first: list[tuple[int, int]] = []  # (node, owning stage) of each parameter's first user
    for k, params in enumerate(captured.params_by_node()):
        first += [(k, stage_of[id(p)]) for p in params if id(p) in stage_of]
    cuts = [0]
    for s in range(1, stages):
        later = [k for k, owner in first if owner >= s]
        cut = min(later) if later else n - (stages - s)
        cuts.append(min(max(cut, cuts[-1] + 1), n - (stages - s)))
    cuts.append(n)
    return [b - a for a, b in pairwise(cuts)]
