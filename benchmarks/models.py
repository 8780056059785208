"""The benchmark's model suite: one model per family the planners must handle.

GPT-2-style decoder, T5-style encoder-decoder and the U-Net CNN come from
``examples.models``; the BERT-style encoder (bidirectional attention, masked-LM head) is
defined here because no example has one. Sizes are small so one CPU step takes well under a
second; ``full`` sizes are larger for the ``--full`` run.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from examples.models import (
    GPT,
    EncoderDecoder,
    ImageDataset,
    Seq2SeqDataset,
    TokenDataset,
    UNet,
    _Trainable,
)
from lightning_pipe.graph.capture import capture
from lightning_pipe.graph.microbatch import scatter
from lightning_pipe.lightning.check import fake_peaks
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.plan.plan import Plan


class BidirectionalAttention(nn.Module):
    """Self-attention without a causal mask: every token sees every other (BERT)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class EncoderBlock(nn.Module):
    """Post-norm transformer encoder block, as in the original BERT."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = BidirectionalAttention(dim, heads)
        self.ln1 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln2 = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class BERT(_Trainable):
    """Encoder-only masked language model."""

    def __init__(
        self, vocab: int = 96, dim: int = 64, heads: int = 4, layers: int = 4, context: int = 32,
        lr: float = 0.05, optimizer: str = "sgd",
    ) -> None:
        super().__init__(lr, optimizer)
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok_emb(ids) + self.pos_emb[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def inputs(self, batch: dict[str, Tensor]) -> tuple:
        return (batch["input_ids"],)

    def criterion(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


class MaskedTokenDataset(Dataset):
    """Random sequences with 15% of tokens replaced by a mask id; loss only on those."""

    def __init__(self, size: int = 64, vocab: int = 96, context: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(1, vocab, (size, context), generator=g)
        masked = torch.rand(size, context, generator=g) < 0.15
        self.input_ids = tokens.masked_fill(masked, 0)
        self.labels = tokens.masked_fill(~masked, -100)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


@dataclass
class Bench:
    """A model family: how to build the model and a data set of ``size`` samples."""

    name: str
    model: Callable[[], LightningModule]
    data: Callable[[int], Dataset]

    def check(self, plan: Plan) -> list[int]:
        """Each stage's peak when ``plan`` trains a new model, as the strategy checks a plan:
        a fake training step. One real step on a micro-batch of the plan's size goes first,
        under a meter: it is what shows each operator's workspace, which a fake call cannot."""
        model = self.model()
        data = self.data(plan.microbatch_size * plan.chunks)
        batch = default_collate([data[i] for i in range(len(data))])  # type: ignore[arg-type]
        with MemoryMeter(1):
            model.loss(scatter(batch, plan.chunks)[0]).backward()  # type: ignore[operator]
        model.zero_grad(set_to_none=True)
        return fake_peaks(model, capture(model), batch, 0, model.configure_optimizers(), Precision(), plan)


def suite(full: bool = False) -> dict[str, Bench]:
    """The four families at quick or full sizes, each seeded at build time."""
    dim, layers, seq, res = (128, 8, 64, 64) if full else (64, 4, 32, 32)
    benches = [
        Bench("bert", lambda: BERT(dim=dim, layers=layers, context=seq), lambda n: MaskedTokenDataset(n, context=seq)),
        Bench("gpt", lambda: GPT(dim=dim, layers=layers, context=seq), lambda n: TokenDataset(n, context=seq)),
        Bench("t5", lambda: EncoderDecoder(dim=dim, layers=layers), lambda n: Seq2SeqDataset(n, length=seq)),
        Bench("unet", lambda: UNet(channels=8, depth=3), lambda n: ImageDataset(n, resolution=res)),
    ]
    return {b.name: _seeded(b) for b in benches}


def _seeded(bench: Bench) -> Bench:
    """Seed before each build so every planner trains the same initial weights."""
    def build() -> LightningModule:
        torch.manual_seed(0)
        return bench.model()

    return Bench(bench.name, build, bench.data)
