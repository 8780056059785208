"""``torch.nn``'s layer stacks, captured layer by layer.

torch.fx keeps every ``torch.nn`` module whole, so an ``nn.TransformerEncoder`` or
``nn.TransformerDecoder`` is one node the pipeline cannot cut inside: all its layers' weights,
gradients and optimizer state land on one stage (a 4-layer decoder under AdamW had no plan on 2
stages at 90% of its peak, though two layers a stage fit). Their ``forward`` cannot be traced as
written: it branches on tensor properties (nested inputs, the sparsity fast path, whether a mask
is causal). Where the call's arguments decide those branches before any tensor is seen, the stack
is its layers called in turn, each a node of its own, and the norm after them.
"""

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["layer_by_layer"]


def layer_by_layer(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """``module(*args, **kwargs)`` as its layers called in turn, for a stack whose forward then
    does exactly that; ``None`` for any other module or call (kept whole).

    An encoder call qualifies without ``src_key_padding_mask`` (which selects nested tensors in
    eval and is converted to the mask's type) and with a ``mask`` only when ``is_causal`` says
    whether it is causal; a decoder call with a ``tgt_mask`` only when ``tgt_is_causal`` says so:
    otherwise ``forward`` compares the mask's values with a causal one.
    """
    if type(module) is nn.TransformerEncoder:
        bound = _bound(module, args, kwargs)
        mask, is_causal = bound.get("mask"), bound.get("is_causal")
        if bound.get("src_key_padding_mask") is not None or (mask is not None and is_causal is None):
            return None
        layer_kwargs = {"src_mask": mask, "is_causal": is_causal is True, "src_key_padding_mask": None}
        first = bound["src"]
        rest: tuple[Any, ...] = ()
    elif type(module) is nn.TransformerDecoder:
        bound = _bound(module, args, kwargs)
        if bound.get("tgt_mask") is not None and bound.get("tgt_is_causal") is None:
            return None
        layer_kwargs = {name: bound.get(name) for name in
                        ("tgt_mask", "memory_mask", "tgt_key_padding_mask", "memory_key_padding_mask")}
        layer_kwargs["tgt_is_causal"] = bound.get("tgt_is_causal") is True
        layer_kwargs["memory_is_causal"] = bound.get("memory_is_causal", False)
        first, rest = bound["tgt"], (bound["memory"],)
    else:
        return None
    layers: nn.ModuleList = module.layers
    norm: nn.Module | None = module.norm

    def forward() -> Any:
        output = first
        for layer in layers:
            output = layer(output, *rest, **layer_kwargs)
        return output if norm is None else norm(output)

    return forward


def _bound(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (defaults left out)."""
    return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
