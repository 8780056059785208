"""Models the tests share: the example families, and small models with one property each."""

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from torch import nn
from torchmetrics import MeanSquaredError
from torchmetrics.classification import MulticlassAccuracy

from examples.models import GPT, EncoderDecoder, ImageDataset, Seq2SeqDataset, TokenDataset, UNet

FAMILIES = {
    "gpt": (GPT, TokenDataset),
    "unet": (UNet, ImageDataset),
    "encdec": (EncoderDecoder, Seq2SeqDataset),
}


def make(family: str, seed: int = 0, **kwargs: Any) -> tuple[LightningModule, Any]:
    """A freshly seeded model of ``family`` and its dataset."""
    model_cls, data_cls = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(**kwargs), data_cls()



class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace this
            return x * 2
        return x


class CountsData(LightningModule):
    """Linears counting the forwards that got tensors with data (``with_data``): not fake,
    not ``meta``; ``built_on``: the device its parameters were made on (and initialised)."""

    with_data = 0
    built_on = ""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
        CountsData.built_on = self.a[0].weight.device.type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        CountsData.with_data += not (isinstance(x, FakeTensor) or x.is_meta)
        return self.a(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["x"]).sum()


class Lazy(nn.Module):
    """Linears whose first takes its input width from its first forward (``nn.LazyLinear``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.LazyLinear(4), *(nn.Linear(4, 4) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


class Untraceable(nn.Module):
    """A linear, an untraceable gate, a linear: capture must name ``gate``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.gate = Gate()
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.gate(self.a(x)))


WIDE = 4096


class Wide(nn.Module):
    """Stage 1 keeps one (batch, WIDE) float activation per micro-batch: ReLU's output."""

    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(16, 16)
        self.l1 = nn.Linear(16, WIDE)
        self.act = nn.ReLU()
        self.l2 = nn.Linear(WIDE, 1)

    def forward(self, x):
        return self.l2(self.act(self.l1(self.l0(x))))


class Skipped(LightningModule):
    """Linear layers each followed by ``+ 1``, and the first one's output joined again at the
    end (added, or concatenated: then its gradient is a slice of the output's): a long skip
    whose gradient the last stage computes long before the first stage's backward takes it."""

    def __init__(self, width: int = 256, join: str = "add") -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        self.join = join

    def forward(self, x):
        skip = self.layers[0](x)
        x = skip + 1.0
        for layer in self.layers[1:]:
            x = layer(x) + 1.0
        return x + skip if self.join == "add" else torch.cat([x, skip], dim=1)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LossInside(LightningModule):
    """A language model that computes its loss in ``forward`` and returns it with the logits,
    as Hugging Face models given labels do: the logits are part of the graph's output, so
    GPipe's stage making them keeps every micro-batch's until the merge."""

    def __init__(self, vocab: int = 512, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU())
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        logits = self.head(self.body(self.embed(ids)))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}

    def training_step(self, batch, batch_idx):
        return self(*batch)["loss"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class MetricUNet(UNet):
    """The U-Net, logging torchmetrics metrics (objects and their values, with and without
    ``sync_dist``) in its training and validation steps: which colour channel is brightest,
    as a 3-class accuracy of the output against the target."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.val_mse = MeanSquaredError()

    @staticmethod
    def brightest(images: torch.Tensor) -> torch.Tensor:
        return images.mean((2, 3)).argmax(-1)

    def training_step(self, batch, batch_idx):
        output = self(batch["image"])
        loss = F.mse_loss(output, batch["target"])
        self.train_acc(self.brightest(output), self.brightest(batch["target"]))
        self.log("train_acc", self.train_acc)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        output = self(batch["image"])
        self.val_acc.update(self.brightest(output), self.brightest(batch["target"]))
        self.log("val_acc", self.val_acc)
        self.log("val_mse", self.val_mse(output, batch["target"]))
        self.log("val_loss", F.mse_loss(output, batch["target"]), sync_dist=True)


class Denoiser(LightningModule):
    """A residual denoiser whose residual starts at zero: ``forward(x, level)`` returns
    ``body(x) + level * x``, and the step, which draws noise and a mask before ``self(...)``
    and a level that changes every step, asks for ``level * noisy``. Where the step means the
    same on every stage (the noise the loss sees is the noise the pipeline got, and so is the
    level) the loss is 0 and nothing moves."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                  nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        nn.init.zeros_(self.body[-1].weight)
        nn.init.zeros_(self.body[-1].bias)

    def forward(self, x, level: float):
        return self.body(x) + level * x

    def training_step(self, batch, batch_idx):
        (x,) = batch
        noisy = x + torch.randn_like(x) * (torch.rand_like(x) > 0.5)
        level = 1.0 + self.global_step
        loss = F.mse_loss(self(noisy, level), level * noisy)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HookRecorder(Callback):
    """Records the training hooks in the order they run: name, global step, batch index where
    the hook has one, and the loss ``on_before_backward`` sees."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.calls.append(("on_train_batch_start", trainer.global_step, batch_idx))

    def on_before_zero_grad(self, trainer, module, optimizer):
        self.calls.append(("on_before_zero_grad", trainer.global_step))

    def on_before_backward(self, trainer, module, loss):
        self.calls.append(("on_before_backward", trainer.global_step, round(float(loss), 5)))

    def on_after_backward(self, trainer, module):
        self.calls.append(("on_after_backward", trainer.global_step))

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.calls.append(("on_before_optimizer_step", trainer.global_step, optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.calls.append(("on_train_batch_end", trainer.global_step, batch_idx, round(float(outputs["loss"]), 5)))


class WritesInForward(GPT):
    """GPT whose forward keeps state: an EMA of the embedding's mean in a buffer, or a count
    of calls in a Python attribute."""

    def __init__(self, state: str) -> None:
        super().__init__()
        self.state = state
        self.register_buffer("ema", torch.zeros(()))
        self.calls = 0

    def forward(self, batch):
        logits = super().forward(batch)
        if self.state == "ema":
            self.ema.mul_(0.9).add_(0.1 * logits.detach().mean())
        else:
            self.calls += 1
        return logits


class FlashAttention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``: on the CPU it runs
    the flash kernel, on ``meta`` tensors the math one (other memory)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class FlashGPT(GPT):
    """The GPT family with its attention through ``scaled_dot_product_attention``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for block in self.blocks:
            block.attn = FlashAttention(block.attn.qkv.in_features, block.attn.heads)



class LlamaLM(LightningModule):
    """Hugging Face Llama from a small config (grouped-query attention, rotary positions, an
    untied head), trained as a user would: AdamW, and a torchmetrics ``Metric`` object logged
    (next-token accuracy)."""

    def __init__(self, vocab: int = 256) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          use_cache=False, tie_word_embeddings=False)
        self.model = transformers.LlamaForCausalLM(config)
        self.accuracy = MulticlassAccuracy(num_classes=vocab, average="micro")

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.model(**batch)

    @staticmethod
    def predicted(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's predicted next token and the true one (the model shifts the labels)."""
        return logits[:, :-1].argmax(-1).flatten(), labels[:, 1:].flatten()

    def training_step(self, batch, batch_idx):
        output = self(**batch)
        self.accuracy(*self.predicted(output.logits, batch["labels"]))
        self.log("train_acc", self.accuracy)
        self.log("train_loss", output.loss)
        return output.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
