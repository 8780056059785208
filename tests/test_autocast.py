"""CUDA's autocast on the CPU (:mod:`lightning_pipe.autocast`) against CUDA's own: its tables
against the installed PyTorch's registrations, and the dtypes every operator of a model sees
against CUDA's autocast on fake CUDA tensors (which it casts when nothing needs a gradient).
What runs on fake CUDA tensors without CUDA bounds the models compared: no batch norm,
``nn.MultiheadAttention`` or ``scaled_dot_product_attention`` (each asks CUDA for something), so
attention is written out; the operators a GPU's attention kernels run are the device's choice,
not autocast's."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.autocast import CUDA_POLICY, cuda_autocast
from lightning_pipe.internals import FakeTensorMode, TorchDispatchMode, registered_operators, tree_flatten
from tests.models import make


class Attention(nn.Module):
    """Attention written out (softmax of scores), a pre-norm MLP with GELU, an RMS norm and a
    log-softmax loss: where CUDA's policy and the CPU's part."""

    def __init__(self, dim: int = 32, vocab: int = 50) -> None:
        super().__init__()
        self.embed, self.norm, self.qkv = nn.Embedding(vocab, dim), nn.LayerNorm(dim), nn.Linear(dim, 3 * dim)
        self.mlp, self.rms, self.head = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)), \
            nn.RMSNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        probabilities = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        x = x + probabilities @ v
        x = x + self.mlp(self.rms(x))
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + logits.pow(2).mean() + x.exp().sum() * 0


class Conv(nn.Module):
    """Convolutions, group norm, upsampling, a long skip by concatenation, MSE. (No batch norm:
    its running statistics' update asks a fake CUDA tensor for CUDA.)"""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.norm = nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.GroupNorm(2, 8)
        self.up, self.out = nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(11, 3, 1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.up(F.silu(self.norm(self.down(image))))
        return F.mse_loss(self.out(torch.cat([x, image], dim=1)), image)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "attention": (Attention, lambda: torch.zeros(2, 8, dtype=torch.long)),
    "conv": (Conv, lambda: torch.zeros(2, 3, 16, 16)),
}


class _Dtypes(TorchDispatchMode):  # type: ignore[misc]
    """Each operator run that returns tensors, with their dtypes (a fake CUDA tensor's device
    queries return none)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        dtypes = tuple(t.dtype for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        if dtypes:
            self.seen.append((str(func.overloadpacket), dtypes))
        return out


@contextmanager
def _cuda_autocast_without_a_gpu(dtype: torch.dtype) -> Iterator[None]:
    """CUDA's own autocast, which ``torch.autocast("cuda")`` turns off without a GPU."""
    before = torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", before)


def _forward(case: str, device: str, scope: Any) -> list[tuple[str, tuple[torch.dtype, ...]]]:
    """The operators of ``case``'s forward and loss on fake tensors on ``device``, without
    gradients (fake CUDA tensors cannot record them without CUDA), under ``scope``."""
    build, batch = CASES[case]
    recorder = _Dtypes()
    with torch.device("meta"):
        model = build()
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device(device):
        model, x = model.to_empty(device=device), batch()  # (random initialisation needs a CUDA generator)
        model.requires_grad_(False)  # a fake CUDA tensor's autograd asks CUDA for a stream
        with torch.no_grad(), scope, recorder:
            model(x)
    return recorder.seen


def test_the_tables_are_the_installed_pytorchs_cuda_autocast() -> None:
    assert set(CUDA_POLICY) == set(registered_operators("AutocastCUDA"))


# (not attention in float16: CUDA's softmax kernel turns a half input to float itself, where the
# CPU's first copies it; a transient copy, the kernel's doing, not autocast's)
@pytest.mark.parametrize(("case", "dtype"), [("attention", torch.bfloat16), ("conv", torch.bfloat16),
                                             ("conv", torch.float16)])
def test_every_operator_sees_the_dtypes_cudas_autocast_gives_it(case: str, dtype: torch.dtype) -> None:
    cuda = _forward(case, "cuda", _cuda_autocast_without_a_gpu(dtype))
    ours = _forward(case, "cpu", cuda_autocast(dtype))
    assert ours == cuda
    # the CPU's own policy casts otherwise: the stand-in is what makes them equal
    assert _forward(case, "cpu", torch.autocast("cpu", dtype=dtype)) != cuda


# one operator of each policy, and the ones CUDA's autocast leaves to type promotion
OPERATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "lower": lambda x, w: x @ w,
    "float32": lambda x, w: (x @ w).exp(),
    "float32 dtype": lambda x, w: ((x @ w).cumsum(0), (x @ w).sum(), torch.softmax(x @ w, -1, dtype=torch.float64)),
    "float32 appended": lambda x, w: (torch.norm(x @ w), torch.norm(x @ w, 2, dim=1)),
    "promote": lambda x, w: (torch.addcmul(x, x @ w, x @ w), torch.addcmul(x @ w, x @ w, x @ w)),
    "neither": lambda x, w: (torch.cat([x, x @ w]), torch.stack([x, x @ w]), torch.relu(x @ w)),
}


def _outputs(operator: str, device: str, scope: Any) -> list[torch.dtype]:
    with FakeTensorMode(), torch.device(device):
        x, w = torch.empty(4, 4), torch.empty(4, 4)
        with scope:
            return [t.dtype for t in tree_flatten(OPERATORS[operator](x, w))[0]]


@pytest.mark.parametrize("operator", sorted(OPERATORS))
def test_each_policy_gives_the_dtypes_cudas_autocast_gives(operator: str) -> None:
    cuda = _outputs(operator, "cuda", _cuda_autocast_without_a_gpu(torch.bfloat16))
    assert _outputs(operator, "cpu", cuda_autocast(torch.bfloat16)) == cuda


def test_gradients_flow_through_the_casts_and_the_scope_ends_clean() -> None:
    model, data = make("gpt")
    batch = {key: value[None] for key, value in data[0].items()}
    with cuda_autocast(torch.bfloat16):
        with cuda_autocast(torch.bfloat16):  # nested: one set of kernels
            logits = model(batch)
        assert logits.dtype == torch.bfloat16
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        assert torch.softmax(logits, -1).dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's policy is back
        assert torch.softmax(torch.ones(2, 2) @ torch.ones(2, 2), -1).dtype == torch.bfloat16


def test_binary_cross_entropy_is_refused_as_cuda_refuses_it() -> None:
    with cuda_autocast(torch.bfloat16), pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
        F.binary_cross_entropy(torch.rand(4), torch.rand(4))
    F.binary_cross_entropy(torch.rand(4), torch.rand(4))  # and only within the scope
