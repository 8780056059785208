"""Attention as a CUDA device runs it, on tensors without data.

``scaled_dot_product_attention`` picks its kernel by its inputs' device. On ``meta`` tensors,
and on the CPU with dropout, it runs the math kernel, which keeps the attention probabilities,
the dropout mask and the dropped probabilities (batch x heads x sequence x sequence each) for
its backward. On an A100 or newer, PyTorch runs a fused kernel that keeps none of them: flash
attention for fp16 and bf16 without a mask, memory-efficient attention otherwise (fp32, or an
additive mask), both with dropout, drawn inside the kernel. A fake run for a CUDA target calls
that kernel's own operator instead: its meta kernel gives the outputs, and its autograd saves
what the device's does (query, key, value, output, log-sum-exp, the random seed and offset).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_pipe.internals import CUDA_EFFICIENT_ATTENTION, CUDA_FLASH_ATTENTION, MATH_ATTENTION, KernelScope

__all__ = ["cuda_attention", "cuda_attention_kernel"]

_HALF = (torch.float16, torch.bfloat16)
#: The fused kernels' limits (PyTorch's ``sdp_utils``): head size at most 256, a multiple of 8
#: (PyTorch pads others, with copies not modelled here: such a call keeps the math kernel).
_MAX_HEAD, _ALIGN = 256, 8


def cuda_attention_kernel(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                          enable_gqa: bool = False) -> str:
    """The kernel a CUDA device of compute capability 8.0 or newer runs for these inputs:
    ``"flash"``, ``"efficient"`` or ``"math"`` (PyTorch's order of preference, cuDNN's kernel
    left out: it comes after these)."""
    heads = {query.shape[-1], key.shape[-1], value.shape[-1]}
    if (query.dim() != 4 or enable_gqa or query.is_nested or max(heads) > _MAX_HEAD
            or any(h % _ALIGN for h in heads) or len({query.dtype, key.dtype, value.dtype}) > 1):
        return "math"
    if query.dtype in _HALF and attn_mask is None and len(heads) == 1:
        return "flash"
    return "efficient" if query.dtype in (torch.float32, *_HALF) else "math"


def _register(library: torch.library.Library) -> None:
    for key in ("AutogradMeta", "AutogradCPU"):
        library.impl("scaled_dot_product_attention", _attention, key)  # type: ignore[no-untyped-call]


_KERNELS = KernelScope(_register)


@contextmanager
def cuda_attention() -> Iterator[None]:
    """Within: ``scaled_dot_product_attention`` on ``meta`` tensors and on the CPU's (fake
    ones, in a fake run) runs the kernel a CUDA device picks (:func:`cuda_attention_kernel`).
    A kernel of the dispatcher's, not a Python mode: the backward and a checkpoint's recompute
    run on autograd's threads, which see no mode, and must run the kernel the forward ran.
    After autocast, as on the GPU: it gets the inputs cast. Scopes within it share its kernels."""
    with _KERNELS.active():
        yield


def _attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, *, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """``scaled_dot_product_attention`` as CUDA runs it (PyTorch's ``attention.cpp``): the
    fused kernel's own operator, whose autograd saves what the device's does."""
    kernel = cuda_attention_kernel(query, key, value, attn_mask, enable_gqa)
    out: Tensor
    if kernel == "flash":
        out = CUDA_FLASH_ATTENTION(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        return out
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # 0 where kept, -inf where masked
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(),
                                                                                float("-inf"))
    if kernel == "math":
        out = MATH_ATTENTION(query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
                             enable_gqa=enable_gqa)[0]
        return out
    if attn_mask is not None:  # a view, as the device's kernel reads it
        attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out = CUDA_EFFICIENT_ATTENTION(query, key, value, attn_mask, log_sumexp, dropout_p, is_causal,
                                       scale=scale)[0]
    return out
