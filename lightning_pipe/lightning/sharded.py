"""Sharded checkpoints of the distributed runtime on ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory: every rank writes the tensors its stage owns and their optimizer
state (``__<rank>_0.distcp``), global rank 0 the rest of Lightning's checkpoint (loops,
callbacks, hyperparameters) in ``meta.pt``, as Lightning's ``ModelParallelStrategy`` does.
Keys are flat: ``state_dict.<name>`` under the plain module's names, and
``optimizer_<i>.state.<index>.<key>`` and ``optimizer_<i>.param_groups`` as in
``Optimizer.state_dict()``, so nothing is gathered on one rank, and
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into one file. Keys
stay flat on both sides (no DCP flattening), so an optimizer's ``param_groups`` is one object.
"""

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.optim import Optimizer

from lightning_pipe.lightning.internals import METADATA_FILENAME
from lightning_pipe.runtime.fsdp import is_shard

__all__ = ["is_sharded", "load_meta", "load_optimizer", "load_tensors", "save_sharded"]

_MODEL = "state_dict."


def is_sharded(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / METADATA_FILENAME).is_file()


def save_sharded(checkpoint: dict[str, Any], path: Path, rank: int) -> None:
    """Every rank writes its part (``state_dict`` and ``optimizer_states`` hold only this rank's
    tensors); global rank 0 writes the rest."""
    checkpoint = dict(checkpoint)
    flat = {_MODEL + name: value for name, value in checkpoint.pop("state_dict").items()}
    for i, optimizer in enumerate(checkpoint.pop("optimizer_states", [])):
        flat[f"optimizer_{i}.param_groups"] = optimizer["param_groups"]
        for index, state in optimizer["state"].items():
            flat.update((f"optimizer_{i}.state.{index}.{key}", value) for key, value in state.items())
    if rank == 0:
        if path.is_file():  # a full checkpoint of the same name
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()  # the directory exists for every rank
    save(flat, checkpoint_id=path, planner=DefaultSavePlanner(flatten_state_dict=False))
    if rank == 0:
        torch.save(checkpoint, path / METADATA_FILENAME)


def load_meta(path: Path) -> dict[str, Any]:
    """Lightning's checkpoint without the tensors, which :func:`load_tensors` and
    :func:`load_optimizer` read in place."""
    checkpoint: dict[str, Any] = torch.load(path / METADATA_FILENAME, weights_only=False)
    return {**checkpoint, "state_dict": {}, "optimizer_states": []}


def load_tensors(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """Read ``tensors`` (by the plain module's names) in place."""
    _load({_MODEL + name: t.detach() for name, t in tensors.items()}, path)


def load_optimizer(path: Path, index: int, optimizer: Optimizer, held: Iterable[nn.Parameter]) -> None:
    """Load optimizer ``index``'s state of the ``held`` parameters (the others stay empty); the
    state of a parameter FSDP shards is read as its shard."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = {id(h) for h in held}
    mine = {str(i) for i, p in enumerate(params) if id(p) in ids}
    prefix = f"optimizer_{index}."
    target: dict[str, Any] = {prefix + "param_groups": None}
    for key, meta in FileSystemReader(path).read_metadata().state_dict_metadata.items():
        parts = key[len(prefix):].split(".", 2) if key.startswith(prefix) else []
        if parts[:1] == ["state"] and parts[1] in mine:
            param = params[int(parts[1])]
            if not isinstance(meta, TensorStorageMetadata):
                target[key] = None  # an object: replaced
            elif is_shard(param) and tuple(meta.size) == tuple(param.shape):
                target[key] = torch.empty_like(param.detach(), dtype=meta.properties.dtype)
            else:
                target[key] = _empty(meta)
    _load(target, path)
    state: dict[int, dict[str, Any]] = {}
    for key, value in target.items():
        parts = key[len(prefix):].split(".", 2)
        if parts[0] == "state":
            state.setdefault(int(parts[1]), {})[parts[2]] = value
    optimizer.load_state_dict({"state": state, "param_groups": target[prefix + "param_groups"]})


def _empty(meta: TensorStorageMetadata) -> Tensor:
    return torch.empty(meta.size, dtype=meta.properties.dtype)


def _load(target: dict[str, Any], path: Path) -> None:
    """Fill ``target`` in place, its keys as saved (an object replaces its placeholder)."""
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    load(target, checkpoint_id=path, planner=planner)
