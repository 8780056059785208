"""Micro-batches: split any input pytree along dim 0 and merge outputs back.

Every tensor leaf with a batch dimension is split into ``chunks`` pieces (the last may be
smaller), or into one-sample pieces when the batch has fewer samples (as torchgpipe does, say
for the short last batch of an epoch); 0-dim tensors and non-tensor leaves go to every
micro-batch unchanged. Merging concatenates along dim 0, except that 0-dim tensors (a loss
the model computes) become their mean weighted by micro-batch size.
"""

from collections.abc import Sequence
from typing import Any

import torch

from lightning_pipe.internals import tree_flatten, tree_unflatten

__all__ = ["batch_size", "gather", "scatter"]


def batch_size(inputs: Any) -> int:
    """The shared dim-0 size of the tensor leaves of ``inputs``."""
    leaves, _ = tree_flatten(inputs)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if not sizes:
        raise ValueError(
            "The pipelined forward received no tensor with a batch dimension to split into "
            "micro-batches. Pass at least one tensor whose dim 0 is the batch."
        )
    if len(sizes) > 1:
        raise ValueError(
            f"The tensors passed to the pipelined forward disagree on the batch size (dim 0): "
            f"{sorted(sizes)}. Every tensor with a batch dimension must have the same dim 0."
        )
    return sizes.pop()


def scatter(inputs: Any, chunks: int) -> list[Any]:
    """Split ``inputs`` into ``min(chunks, batch size)`` micro-batches of the same structure
    (one for an empty batch)."""
    chunks = max(1, min(chunks, batch_size(inputs)))
    leaves, spec = tree_flatten(inputs)
    pieces = [
        torch.tensor_split(leaf, chunks) if _is_batched(leaf) else [leaf] * chunks
        for leaf in leaves
    ]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(chunks)]


def gather(outputs: list[Any], device: torch.device, sizes: Sequence[int] | None = None) -> Any:
    """Concatenate per-micro-batch outputs along dim 0 on ``device``.

    A 0-dim tensor (a loss the model computes itself, as Hugging Face models do given
    labels) becomes the mean of the micro-batches' values weighted by their ``sizes`` (by
    default each output's dim 0): the whole batch's value for a per-sample mean.
    """
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    merged = []
    for k, leaf in enumerate(flat[0][0]):
        if isinstance(leaf, torch.Tensor):
            parts = [f[0][k].to(device) for f in flat]
            if leaf.dim() == 0:
                merged.append(sum(p * w for p, w in zip(parts, _shares(outputs, sizes))))
            else:
                merged.append(torch.cat(parts))
        else:
            merged.append(leaf)
    return tree_unflatten(merged, spec)


def _shares(outputs: list[Any], sizes: Sequence[int] | None) -> list[float]:
    if sizes is None:
        try:
            sizes = [batch_size(out) for out in outputs]
        except ValueError:
            raise ValueError(
                "The pipelined forward returned a 0-dim tensor and nothing with a batch dimension, "
                "so the micro-batches' values cannot be weighted by their sizes. Return a per-sample "
                "output beside it, or return per-sample values and reduce them in `training_step`."
            ) from None
    total = max(sum(sizes), 1)
    return [n / total for n in sizes]


def _is_batched(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0
