"""CUDA's autocast on the CPU: a stand-in, as :data:`~lightning_pipe.stream.CPUStream` is for a
CUDA stream, so a plan for GPUs under ``bf16-mixed`` or ``16-mixed`` sees a GPU's bytes.

A dry run plans GPUs it does not have, and the plan's check runs on fake tensors. Neither can
use CUDA's autocast without CUDA: ``torch.autocast("cuda")`` disables itself, and a fake tensor
standing on a CUDA device takes no part in autograd (its graph asks CUDA for a stream). The
CPU's autocast runs, but casts by another policy: it leaves layer and group norm, softmax,
``exp``, ``pow``, sums and upsampling in the lower precision, where CUDA's runs them in
float32, so a transformer's norms and attention probabilities are planned at half a GPU's
bytes. Within :func:`cuda_policy`, each operator CUDA's autocast has a kernel for gets a CPU
autocast kernel doing what CUDA's does (the policies below, by name as PyTorch's
``autocast_mode.h`` lists them), and the operators only the CPU's policy casts fall through
uncast, as on CUDA. ``tests/test_autocast.py`` holds the tables equal to the installed
PyTorch's registrations, and the dtypes a model's operators see equal to CUDA's own autocast
(on fake CUDA tensors, which CUDA's autocast casts when nothing needs a gradient).
"""

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.internals import KernelScope, op_schema, registered_operators, tree_map

__all__ = ["CUDA_POLICY", "cuda_autocast", "cuda_policy"]

# Each operator's policy under CUDA's autocast: ``lower``: floating inputs cast to the
# autocast dtype (matrix products, convolutions, attention: the bytes they save halve);
# ``float32``: cast to float32; ``float32 dtype``: the result asked for in float32 when the
# first input is eligible (softmax, sums); ``float32 appended``: ``norm`` redispatched to its
# overload taking a dtype; ``promote``: all cast to the widest input; ``banned``: refused.
_LOWER = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
    "cudnn_convolution_transpose",
)
_FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
_FLOAT32_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
_FLOAT32_APPENDED = ("norm.Scalar", "norm.ScalarOpt_dim")
_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)
_BANNED = ("binary_cross_entropy",)

#: Operator (``name.overload``) -> its policy under CUDA's autocast.
CUDA_POLICY: dict[str, str] = {
    **dict.fromkeys(_LOWER, "lower"), **dict.fromkeys(_FLOAT32, "float32"),
    **dict.fromkeys(_FLOAT32_DTYPE, "float32 dtype"), **dict.fromkeys(_FLOAT32_APPENDED, "float32 appended"),
    **dict.fromkeys(_PROMOTE, "promote"), **dict.fromkeys(_BANNED, "banned"),
}

@contextmanager
def cuda_policy() -> Iterator[None]:
    """Within it, CPU autocast casts as CUDA's does (module docstring); it enables no
    autocast itself. Kept around a whole step, forward and backward: a checkpoint's recompute
    re-enters autocast during the backward and must cast as the forward did. Scopes within it
    share its kernels."""
    with _KERNELS.active():
        yield


@contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """CPU autocast to ``dtype`` under :func:`cuda_policy`, its weight cache off (as Lightning
    runs it)."""
    with cuda_policy(), torch.autocast("cpu", dtype=dtype, cache_enabled=False):
        yield


def _register(library: torch.library.Library) -> None:
    """CUDA's policy as CPU autocast kernels in ``library``, replacing the CPU's own."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Warning only once for all operators", UserWarning)  # (replacing)
        for name, policy in CUDA_POLICY.items():
            if _exists(name):
                library.impl(name, _kernel(name, policy), "AutocastCPU")  # type: ignore[no-untyped-call]
        for name in registered_operators("AutocastCPU"):
            if name not in CUDA_POLICY:  # only the CPU's policy casts it
                library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")  # type: ignore[no-untyped-call]


_KERNELS = KernelScope(_register)


def _exists(name: str) -> bool:
    return _overload(name) is not None


def _overload(name: str) -> Any:
    """aten's overload ``name`` (``pow.Scalar``; ``sum``: its default), ``None`` if there is none."""
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def _kernel(name: str, policy: str) -> Callable[..., Any]:
    """The CPU autocast kernel of operator ``name`` doing what CUDA's ``policy`` does; the
    operator then runs with autocast off, as CUDA's kernels run it."""
    op = _overload(name)
    if policy == "banned":
        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"aten::{name} cannot run under CUDA's autocast, which refuses it as unsafe in a lower precision "
                "(torch.nn.functional.binary_cross_entropy, nn.BCELoss): apply the sigmoid in the loss instead, "
                "with binary_cross_entropy_with_logits or nn.BCEWithLogitsLoss."
            )
        return banned
    # norm's overload taking a dtype (``norm.Scalar`` -> ``norm.ScalarOpt_dtype``, ...)
    appended: Any = None if policy != "float32 appended" else \
        _overload(("norm.ScalarOpt" if name == "norm.Scalar" else name) + "_dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        lower = torch.get_autocast_dtype("cpu")
        torch.set_autocast_enabled("cpu", False)
        try:
            if policy in ("lower", "float32", "promote"):
                dtype = {"lower": lower, "float32": torch.float32}.get(policy) or _widest((args, kwargs), lower)
                args, kwargs = tree_map(lambda x: x.to(dtype) if _eligible(x) and x.dtype != dtype else x,
                                        (args, kwargs))
                return op(*args, **kwargs)
            if not _eligible(args[0]):  # float32 dtype and float32 appended: as asked
                return op(*args, **kwargs)
            named = _named(op, args, kwargs)
            if policy == "float32 appended":
                return appended(**named, dtype=torch.float32)
            return op(**{**named, "dtype": named["dtype"] or torch.float32})
        finally:
            torch.set_autocast_enabled("cpu", True)

    return kernel


def _eligible(value: Any) -> bool:
    """Whether autocast casts ``value``: a floating tensor on the device, not float64."""
    return isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float64 \
        and value.device.type == "cpu"


def _widest(tree: Any, lower: torch.dtype) -> torch.dtype:
    """The type ``promote`` casts to: float32 where an eligible input is, else ``lower``."""
    found = [lower]
    tree_map(lambda x: found.append(x.dtype) if _eligible(x) else None, tree)
    return torch.float32 if torch.float32 in found else lower


def _named(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``op``'s arguments by name, defaults included."""
    arguments = op_schema(op).arguments
    named = {a.name: a.default_value for a in arguments if a.has_default_value()}
    named.update(zip((a.name for a in arguments), args))
    return {**named, **kwargs}
