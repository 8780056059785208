"""Modules built on the meta device: shapes without storage, given storage where they are used.

A model too big for one process is built under ``torch.device("meta")`` (Lightning's
``trainer.init_module(empty_init=True)``). Its tensors get storage module by module, in
``modules()`` order, each module initialised by its own ``reset_parameters()``, as Lightning's
ModelParallel strategy does: the values depend on the random state at the start, not on which
process holds which module. Storage is swapped into the existing tensor objects, so
optimizers, tied names and the captured graph keep seeing the same parameters.
"""

import torch
from torch import Tensor, nn

__all__ = ["allocate", "check_resettable", "has_meta", "materialize", "materialize_module", "own_tensors", "to_meta"]


def own_tensors(module: nn.Module) -> list[Tensor]:
    """The parameters and buffers ``module`` registers itself (not its children's)."""
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def check_resettable(root: nn.Module) -> None:
    """Raise unless every module owning a meta tensor can initialise it.

    Raises:
        TypeError: a module with meta tensors of its own has no ``reset_parameters()``.
    """
    for name, module in root.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        meta = [n for n, t in own if t.is_meta]
        if meta and not callable(getattr(module, "reset_parameters", None)):
            raise TypeError(
                f"{name or 'The model'} ({type(module).__name__}) was built on the meta device "
                f"(trainer.init_module(empty_init=True)) but has no reset_parameters() to initialise {meta}. "
                f"Give it a reset_parameters() that sets every parameter and buffer it registers itself, "
                f"or build the model without empty_init=True."
            )


def allocate(t: Tensor, device: torch.device) -> None:
    """Give the meta tensor ``t`` uninitialised storage on ``device``, keeping its Python object."""
    _swap(t, torch.empty_like(t, device=device))


def to_meta(t: Tensor) -> None:
    """Drop ``t``'s storage, keeping its shape (and its Python object) on the meta device."""
    _swap(t, torch.empty_like(t, device="meta"))


def materialize_module(module: nn.Module, device: torch.device) -> None:
    """Storage on ``device`` for the meta tensors ``module`` registers itself, initialised by
    its ``reset_parameters()``."""
    meta = [t for t in own_tensors(module) if t.is_meta]
    if not meta:
        return
    for t in meta:
        allocate(t, device)
    with torch.no_grad():
        module.reset_parameters()  # type: ignore[operator]


def materialize(root: nn.Module, device: torch.device) -> None:
    """Every meta tensor of ``root`` on ``device``: what a pipeline whose stages each
    materialise a part gives, in one process."""
    check_resettable(root)
    for module in root.modules():
        materialize_module(module, device)


def _swap(t: Tensor, new: Tensor) -> None:
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, new)  # type: ignore[no-untyped-call]
