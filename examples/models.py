"""Small LightningModules of the model families the pipeline must handle.

Plain Lightning code: nothing here knows about pipelining. Used by the examples, the tests
and the benchmarks.
"""

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class _Trainable(LightningModule):
    """Shared optimizer setup: SGD with momentum, or Adam."""

    def __init__(self, lr: float, optimizer: str) -> None:
        super().__init__()
        self.lr = lr
        self.optimizer = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            # eps above float noise: key biases have an exactly-zero true gradient, and the
            # default 1e-8 turns rounding noise in them into full-size steps.
            return torch.optim.Adam(self.parameters(), lr=self.lr, eps=1e-6)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self(*self.inputs(batch))

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        return self.criterion(self(*self.inputs(batch)), batch)

    def inputs(self, batch: dict[str, Tensor]) -> tuple:
        """The arguments of ``forward`` taken from a batch."""
        raise NotImplementedError

    def criterion(self, output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError


# --- GPT-style decoder-only LM: tied input/output embedding, dict batch -----------------


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, context)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(_Trainable):
    """Decoder-only LM whose output head shares the token embedding's weight."""

    def __init__(
        self,
        vocab: int = 96,
        dim: int = 32,
        heads: int = 4,
        layers: int = 4,
        context: int = 16,
        lr: float = 0.05,
        optimizer: str = "sgd",
    ) -> None:
        super().__init__(lr, optimizer)
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads, context) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok_emb.weight
        nn.init.normal_(self.tok_emb.weight, std=0.02)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        ids = batch["input_ids"]
        x = self.tok_emb(ids) + self.pos_emb[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def inputs(self, batch: dict[str, Tensor]) -> tuple:
        return (batch,)

    def criterion(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


class TokenDataset(Dataset):
    """Random token sequences with next-token labels, fixed by ``seed``."""

    def __init__(self, size: int = 64, vocab: int = 96, context: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(vocab, (size, context + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


# --- U-Net-style CNN: long skip connections, GroupNorm ----------------------------------


def _conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())


class UNet(_Trainable):
    """Encoder-decoder CNN whose decoder levels concatenate the matching encoder level."""

    def __init__(self, channels: int = 8, depth: int = 3, lr: float = 0.05, optimizer: str = "sgd") -> None:
        super().__init__(lr, optimizer)
        self.save_hyperparameters()
        widths = [channels * 2**i for i in range(depth + 1)]
        self.stem = _conv(3, widths[0])
        self.down = nn.ModuleList(_conv(widths[i], widths[i + 1]) for i in range(depth))
        self.up = nn.ModuleList(_conv(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(widths[0], 3, 1)

    def forward(self, image: Tensor) -> Tensor:
        x = self.stem(image)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(F.avg_pool2d(x, 2))
        for up in self.up:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = up(torch.cat([x, skips.pop()], dim=1))
        return self.out(x)

    def inputs(self, batch: dict[str, Tensor]) -> tuple:
        return (batch["image"],)

    def criterion(self, output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return F.mse_loss(output, batch["target"])


class ImageDataset(Dataset):
    """Random images with a denoising target, fixed by ``seed``."""

    def __init__(self, size: int = 32, resolution: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.target = torch.randn(size, 3, resolution, resolution, generator=g)
        self.image = self.target + 0.5 * torch.randn(size, 3, resolution, resolution, generator=g)

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"image": self.image[i], "target": self.target[i]}


# --- Encoder-decoder: the encoder output feeds every decoder layer ----------------------


class CrossAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        k, v = self.kv(memory).chunk(2, dim=-1)
        scores = self.q(x) @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])
        return scores.softmax(dim=-1) @ v


class DecoderLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.cross = CrossAttention(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        x = x + self.cross(self.norm(x), memory)
        return x + self.ff(x)


class EncoderDecoder(_Trainable):
    """Sequence-to-sequence model: an MLP encoder, cross-attending decoder layers."""

    def __init__(
        self, vocab: int = 64, dim: int = 32, layers: int = 3, lr: float = 0.05, optimizer: str = "sgd"
    ) -> None:
        super().__init__(lr, optimizer)
        self.save_hyperparameters()
        self.src_emb = nn.Embedding(vocab, dim)
        self.tgt_emb = nn.Embedding(vocab, dim)
        self.encoder = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)
        )
        self.decoder = nn.ModuleList(DecoderLayer(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        memory = self.src_emb(src)
        for layer in self.encoder:
            memory = memory + layer(memory)
        x = self.tgt_emb(tgt)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.head(x)

    def inputs(self, batch: dict[str, Tensor]) -> tuple:
        return batch["src"], batch["tgt"]

    def criterion(self, logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


class Seq2SeqDataset(Dataset):
    """Random source sequences; the target is the reversed source, fixed by ``seed``."""

    def __init__(self, size: int = 32, vocab: int = 64, length: int = 10, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.src = torch.randint(vocab, (size, length), generator=g)

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        labels = self.src[i].flip(0)
        return {"src": self.src[i], "tgt": torch.cat([labels[:1] * 0, labels[:-1]]), "labels": labels}


class SyntheticData(LightningDataModule):
    """The synthetic data set matching a model family, for the CLI."""

    def __init__(self, family: str = "gpt", size: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        datasets = {"gpt": TokenDataset, "unet": ImageDataset, "encdec": Seq2SeqDataset}
        if family not in datasets:
            raise ValueError(f"family must be one of {sorted(datasets)}, got {family!r}.")
        self.dataset = datasets[family](size=size)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return loader(self.dataset, self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return loader(self.dataset, self.batch_size)


def loader(dataset: Dataset, batch_size: int) -> DataLoader:
    """A deterministic loader (no shuffling, no workers) that drops a short last batch."""
    return DataLoader(dataset, batch_size=batch_size, drop_last=True)
