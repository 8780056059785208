"""Shapes: what size of batch a plan was made for, and a batch of that size to plan from.

A plan holds for the shapes it was profiled at. Batches vary (an epoch's short last batch,
variable-length text), and one larger than planned can run out of memory deep in the
backward. So the shapes a plan was made for are recorded by path in the batch
(``"input_ids"``, ``"0"``, ``"0.mask"``; ``"batch"`` for a lone tensor), each new batch is
compared with them, and a batch that grew gets a new plan. To plan for the largest batch from
the first, a batch is tiled to the named shapes: its own values repeated, so token ids and
labels stay valid.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_pipe.internals import (
    GetAttrKey,
    KeyPath,
    MappingKey,
    SequenceKey,
    tree_flatten_with_path,
    tree_unflatten,
)

__all__ = ["Shapes", "batch_shapes", "grown", "largest", "show", "tile"]

#: Shape of every tensor in a batch, by path.
Shapes = dict[str, tuple[int, ...]]


def batch_shapes(batch: Any) -> Shapes:
    """The shape of every tensor leaf of ``batch``, by path."""
    leaves, _ = tree_flatten_with_path(batch)
    return {_path(path): tuple(leaf.shape) for path, leaf in leaves if isinstance(leaf, torch.Tensor)}


def grown(planned: Shapes, now: Shapes) -> Shapes:
    """The tensors of ``now`` larger than ``planned`` in some dimension (or new, or of another
    rank), with their new shapes."""
    return {
        path: shape for path, shape in now.items()
        if path not in planned or len(planned[path]) != len(shape) or any(map(int.__gt__, shape, planned[path]))
    }


def largest(*shapes: Mapping[str, Sequence[int]]) -> Shapes:
    """Per path, the largest size in every dimension over ``shapes`` (later ones win where
    ranks differ)."""
    out: Shapes = {}
    for each in shapes:
        for path, shape in each.items():
            known = out.get(path)
            out[path] = tuple(map(max, known, shape)) if known and len(known) == len(shape) else tuple(shape)
    return out


def tile(batch: Any, shapes: Mapping[str, Sequence[int]]) -> Any:
    """``batch`` with each tensor named in ``shapes`` repeated along its dimensions and cut
    to that shape; the others unchanged.

    Raises:
        ValueError: a path is not a tensor of ``batch``, or a shape has another rank.
    """
    leaves, spec = tree_flatten_with_path(batch)
    paths = [_path(path) for path, leaf in leaves if isinstance(leaf, torch.Tensor)]
    unknown = sorted(set(shapes) - set(paths))
    if unknown:
        raise ValueError(
            f"plan_shapes names {unknown}, which the training batch does not have; its tensors are {paths}."
        )
    out = []
    for path, leaf in leaves:
        key = _path(path)
        out.append(_tiled(leaf, tuple(shapes[key]), key) if key in shapes else leaf)
    return tree_unflatten(out, spec)


def show(shapes: Mapping[str, Sequence[int]]) -> str:
    """``shapes`` as a ``plan_shapes`` argument a user can paste."""
    return "{" + ", ".join(f"{path!r}: {list(shape)}" for path, shape in shapes.items()) + "}"


def _tiled(t: torch.Tensor, shape: tuple[int, ...], path: str) -> torch.Tensor:
    if len(shape) != t.dim():
        raise ValueError(f"plan_shapes gives {path!r} the shape {list(shape)}, but the batch's has {t.dim()} dims.")
    if 0 in t.shape:
        raise ValueError(f"batch tensor {path!r} is empty ({list(t.shape)}); it cannot be repeated to {list(shape)}.")
    repeats = [math.ceil(want / have) for want, have in zip(shape, t.shape)]
    return t.repeat(*repeats)[tuple(slice(0, n) for n in shape)]


def _path(path: KeyPath) -> str:
    """``"input_ids"``, ``"0.mask"``; ``"batch"`` for a batch that is one tensor."""
    parts = []
    for key in path:
        if isinstance(key, MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, GetAttrKey):
            parts.append(key.name)
        else:
            parts.append(str(key))
    return ".".join(parts) or "batch"
