"""Micro-batches: split any input pytree along dim 0 and merge outputs back.

Every tensor leaf with a batch dimension is split into ``chunks`` pieces (the last may be
smaller); 0-dim tensors and non-tensor leaves go to every micro-batch unchanged.
"""

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

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
    """Split ``inputs`` into ``chunks`` micro-batches of the same structure."""
    size = batch_size(inputs)
    if size < chunks:
        raise ValueError(
            f"A batch of {size} samples cannot be split into chunks={chunks} micro-batches. "
            f"Use a batch size of at least {chunks} (for the last batch of an epoch, "
            f"`drop_last=True` in the DataLoader) or lower `chunks`."
        )
    leaves, spec = tree_flatten(inputs)
    pieces = [
        torch.tensor_split(leaf, chunks) if _is_batched(leaf) else [leaf] * chunks
        for leaf in leaves
    ]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(chunks)]


def gather(outputs: list[Any], device: torch.device) -> Any:
    """Concatenate per-micro-batch outputs along dim 0 on ``device``."""
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    merged = []
    for k, leaf in enumerate(flat[0][0]):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    "The pipelined forward returned a 0-dim tensor, which cannot be merged "
                    "across micro-batches. Return per-sample values from `forward` and reduce "
                    "them (e.g. compute the loss) in `training_step`."
                )
            merged.append(torch.cat([f[0][k].to(device) for f in flat]))
        else:
            merged.append(leaf)
    return tree_unflatten(merged, spec)


def _is_batched(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0
