"""Profile data: what each graph node costs in time and memory, for one micro-batch.

A :class:`Profile` is plain data (JSON round trip), so the planner can run on a saved profile
with no model and no device. Byte counts are of real storages observed while the node ran;
activation-like counts scale linearly with the micro-batch size (:meth:`Profile.scaled`).
"""

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

__all__ = ["NodeProfile", "Profile", "SharedParam", "block_of"]

_BLOCK = re.compile(r"^(.*?_\d+)_")  # a node name's prefix up to its first layer index


@dataclass
class NodeProfile:
    """Costs of one compute node of the captured graph, for one micro-batch.

    Attributes:
        name: the fx node name.
        forward_ms / backward_ms: median wall time of the node's forward / backward.
        output_bytes: bytes of the tensors the node returns.
        saved_bytes: bytes of storages autograd keeps for backward that this node is the
            first to save (whichever node made them): each stashed storage is counted once, at
            the node keeping it longest, as on a device of its own.
        transient_bytes: peak bytes the node's forward allocates beyond what outlives it
            (workspace, an operator's internal scratch included).
        param_bytes: bytes of parameters first used by this node (shared ones count once).
        grad_bytes: bytes of the gradients of those parameters (trainable ones only).
        optimizer_bytes: bytes of optimizer state for those parameters, measured with the
            user's optimizer.
        step_bytes: the most bytes the optimizer's step holds for a while beyond the state of
            those parameters (its temporaries; for-loop Adam: twice the parameter), measured:
            the largest of one parameter's, or their sum when the step works on all of a
            stage's parameters at once (:attr:`Profile.step_grouped`).
        users: indices of the nodes reading this node's output; ``-1`` is the graph output.
        backward_bytes: peak bytes the node's backward adds: fresh gradients of its
            parameters and inputs, and workspace.
        output_grad_bytes: bytes of the gradient that flows back into the node's output.
        last_saver: index of the last node that keeps for backward a storage this node
            saved first (-1: none, or not measured). Recomputing or swapping this node frees
            its saved bytes only together with that node.
        made_bytes: bytes of the storages the node's forward allocates that outlive it.
        held_bytes: of those, the bytes the node does not save itself: its outputs, alive
            until a later node saves them (from then on part of its ``saved_bytes``) or the
            last node reading them has run.
        held_until: index of the last node reading them, through views too (the node count:
            the graph output).
        held_by: index of the node saving some of them first (-1: none does). When that
            node's saved bytes are recomputed or swapped, they live until ``held_until``.
        saved_inputs_bytes: of ``saved_bytes``, those of storages earlier nodes made (inputs
            it saves): a swapped segment leaves them on the device when it starts after
            ``saved_inputs_from``, the earliest of those nodes (-1: none).
        input_grad_bytes: bytes of the buffer the gradients the node's backward hands its
            inputs are slices of (``cat``: its output's gradient; 0: each is its own). A
            gradient waiting for an earlier stage keeps the whole buffer.
        forwarded_grads: the nodes read whose gradient the node's backward hands over on its
            output gradient's storage (``add`` gives both inputs that very tensor, ``cat``
            slices of it): one storage, alive whole until the earliest of them takes it.
        cast_bytes: of ``saved_bytes``, autocast's copies of the node's parameters in the
            lower precision (``bf16-mixed``: a linear layer keeps its weight's bf16 copy for
            backward), made again by every micro-batch (Lightning turns autocast's cache off)
            but of the same size whatever its number of samples.
        fresh_grad_bytes: the most bytes of those parameters' gradients its backward holds
            at once before adding them to ``.grad`` (one autograd function's: a node holding
            several layers makes and adds one layer's at a time); ``None``: not measured,
            ``grad_bytes``.
    """

    name: str
    forward_ms: float
    backward_ms: float
    output_bytes: int
    saved_bytes: int
    transient_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    users: list[int] = field(default_factory=list)
    step_bytes: int = 0
    backward_bytes: int = 0
    output_grad_bytes: int = 0
    last_saver: int = -1
    made_bytes: int = 0
    held_bytes: int = 0
    held_until: int = -1
    held_by: int = -1
    saved_inputs_bytes: int = 0
    saved_inputs_from: int = -1
    input_grad_bytes: int = 0
    forwarded_grads: list[int] = field(default_factory=list)
    cast_bytes: int = 0
    fresh_grad_bytes: int | None = None


@dataclass
class SharedParam:
    """A parameter several nodes read (tied weights): its bytes and the nodes reading it, in
    order; the first owns it (its ``param_bytes`` count it), a stage holding later readers
    only keeps a copy of it."""

    nbytes: int
    users: list[int]


@dataclass
class Profile:
    """Per-node costs of a captured graph and the conditions they were measured under.

    Attributes:
        input_bytes: bytes of the graph inputs for one micro-batch.
        input_users: indices of the nodes reading a graph input.
        fake: bytes were measured on fake tensors and the times estimated (nothing ran).
        shared: the parameters several nodes read.
        batch_bytes: bytes of one micro-batch's share of the training batch (the graph
            inputs and what else ``training_step`` reads, such as labels); 0: the graph inputs.
        loss_bytes: the most bytes ``training_step`` holds outside ``forward`` for one
            micro-batch: a copy of the graph's output for as long as the loss keeps it (GPipe's
            merged output is one), the loss and what it saves. Measured by the strategy; 0
            when unknown.
        loss_backward_bytes: the most bytes the loss's backward holds, what the loss kept and
            the gradient of the output included.
        step_grouped: the optimizer steps all of a device's parameters at once (``foreach``,
            PyTorch's default on GPUs): its temporaries for a stage add up, where a step
            parameter by parameter holds one parameter's at a time.
        loss_kept_bytes: of those, the bytes the returned loss holds (a loss may be a view of
            its unreduced values): kept until the step ends, for every micro-batch when
            ``training_step`` runs per micro-batch.
        loss_grad_bytes: bytes of the gradients the loss's backward makes for the graph's
            outputs (none for an output the loss does not read, as a Hugging Face model's
            logits when it computes the loss itself); ``None``: not measured, every output's.
    """

    nodes: list[NodeProfile]
    device: str
    dtype: str
    microbatch_size: int
    input_bytes: int = 0
    input_users: list[int] = field(default_factory=list)
    fake: bool = False
    shared: list[SharedParam] = field(default_factory=list)
    batch_bytes: int = 0
    loss_bytes: int = 0
    loss_backward_bytes: int = 0
    loss_kept_bytes: int = 0
    step_grouped: bool = False
    loss_grad_bytes: int | None = None

    def scaled(self, microbatch_size: int) -> "Profile":
        """Predict the profile at another micro-batch size: activation, output and
        workspace bytes and node times scale linearly (a first-order model); parameters,
        gradients, optimizer state and autocast's copies of parameters are kept."""
        if microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}.")
        f = microbatch_size / self.microbatch_size

        def scale(n: int) -> int:
            return round(n * f)

        def scale_but(n: int, kept: int) -> int:
            return scale(max(n - kept, 0)) + min(kept, n)

        nodes = [
            replace(
                n,
                output_bytes=scale(n.output_bytes),
                saved_bytes=scale_but(n.saved_bytes, n.cast_bytes),
                transient_bytes=scale(n.transient_bytes),
                made_bytes=scale_but(n.made_bytes, n.cast_bytes),
                held_bytes=scale(n.held_bytes),
                saved_inputs_bytes=scale(n.saved_inputs_bytes),
                backward_bytes=scale_but(n.backward_bytes, n.grad_bytes),
                output_grad_bytes=scale(n.output_grad_bytes),
                input_grad_bytes=scale(n.input_grad_bytes),
                forward_ms=n.forward_ms * f,
                backward_ms=n.backward_ms * f,
            )
            for n in self.nodes
        ]
        return replace(
            self, nodes=nodes, microbatch_size=microbatch_size, input_bytes=scale(self.input_bytes),
            batch_bytes=scale(self.batch_bytes), loss_bytes=scale(self.loss_bytes),
            loss_backward_bytes=scale(self.loss_backward_bytes), loss_kept_bytes=scale(self.loss_kept_bytes),
            loss_grad_bytes=None if self.loss_grad_bytes is None else scale(self.loss_grad_bytes),
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        data = json.loads(text)
        data["nodes"] = [NodeProfile(**n) for n in data["nodes"]]
        data["shared"] = [SharedParam(**s) for s in data.get("shared", [])]
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_json(Path(path).read_text())


def block_of(name: str) -> str | None:
    """The layer block a node belongs to by its name (``model_layers_3_mlp_up_proj`` ->
    ``model_layers_3``), as FSDP's units are planned and built; ``None``: none (``add_1``'s
    index only tells apart nodes alike)."""
    match = _BLOCK.match(name)
    return match.group(1) if match else None
