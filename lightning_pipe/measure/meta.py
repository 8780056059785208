"""Meta results: an operator on meta tensors only works out its results' layouts, from its
arguments' layouts and values, the same every time they repeat (every micro-batch, every
layer). So a fresh result's layouts are worked out once per signature and made again from
them: most meta kernels are Python (``torch._refs``), which then took most of a fake run."""

from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.internals import FakeTensor, op_schema, storage_key

__all__ = ["meta_call", "on_meta"]

_Layouts = tuple[bool, tuple[tuple[torch.Size, tuple[int, ...], torch.dtype], ...]]
# signature -> (whether a tuple is returned, each result's shape, strides and dtype); None: made
# some other way (a view, an input changed in place, a result an empty tensor of its layout is not)
_RESULTS: dict[Hashable, _Layouts | None] = {}
_FRESH: dict[Any, bool] = {}  # operator -> whether its schema returns only new tensors
_META = torch.device("meta")


def on_meta(flat: list[Any]) -> bool:
    """Whether an operator's (flattened) arguments hold tensors, all on the meta device."""
    tensors = [x for x in flat if isinstance(x, Tensor)]
    return bool(tensors) and all(t.is_meta and not isinstance(t, FakeTensor) for t in tensors)


def meta_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any]) -> Any:
    """``func(*args, **kwargs)`` on meta tensors (``flat``: its arguments flattened), its
    results made from their layouts where the same signature was seen before."""
    key = _signature(func, args, kwargs) if _fresh(func) else None
    layouts = _RESULTS.get(key) if key is not None else None
    if layouts is not None:
        made = [torch.empty_strided(shape, strides, dtype=dtype, device=_META) for shape, strides, dtype in layouts[1]]
        return tuple(made) if layouts[0] else made[0]
    out = func(*args, **kwargs)
    if key is not None and key not in _RESULTS:
        _RESULTS[key] = _layouts(out, flat)
    return out


def _fresh(func: Any) -> bool:
    """Whether ``func`` changes no argument and returns only tensors of its own (no views)."""
    if func not in _FRESH:
        schema = op_schema(func)
        _FRESH[func] = bool(schema.returns) and all(a.alias_info is None for a in schema.arguments) and all(
            r.alias_info is None and isinstance(r.type, torch.TensorType) for r in schema.returns)
    return _FRESH[func]


def _signature(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable | None:
    """What a meta kernel's results depend on; ``None`` where an argument is not hashable."""
    key = (func, _key(args), tuple((name, _key(v)) for name, v in kwargs.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _key(x: Any) -> Hashable:
    if isinstance(x, Tensor):
        return Tensor, x.shape, x.stride() if x.layout == torch.strided else None, x.dtype, x.device, x.layout
    if isinstance(x, (list, tuple)):
        return type(x), tuple(_key(v) for v in x)
    return type(x), x  # the type too: 1 == 1.0 == True, and a result's dtype depends on it


def _layouts(out: Any, flat: list[Any]) -> _Layouts | None:
    """How to make ``out`` again; ``None`` where an empty tensor of its layout is not it (a
    storage larger than its layout needs, an argument's, or shared by two results)."""
    results = out if isinstance(out, tuple) else (out,)
    if not all(isinstance(t, Tensor) and t.is_meta and t.layout == torch.strided for t in results):
        return None
    storages = {storage_key(t) for t in results}
    if len(storages) != len(results) or storages & {storage_key(t) for t in flat if isinstance(t, Tensor)}:
        return None
    for t in results:
        again = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
        if t.storage_offset() or t.untyped_storage().nbytes() != again.untyped_storage().nbytes():
            return None
    return isinstance(out, tuple), tuple((t.shape, t.stride(), t.dtype) for t in results)
