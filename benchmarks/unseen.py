"""Predicted, fake-checked and metered per-stage peaks on models the project was never tuned
for: twelve families written from public definitions (PyTorch's own transformer layers, Hugging
Face ``transformers`` configs, papers), none of them the project's examples or benchmark models.

    python -m benchmarks.unseen [family ...]      # all families: a few minutes on a 2-core CPU

Each family x schedule (gpipe, 1f1b, 2bw) x memory optimisation trains two steps on ``STAGES``
CPU stages with ``MemoryPipeStrategy(measure_memory=True)`` (the second step is the steady
one): *off*, with memory to spare; *on*, under a per-stage ``memory_limit`` of the first share
of ``LIMITS`` of the largest metered stage peak of that schedule's *off* run at which a plan
exists (the planner recomputes or swaps: at 2 stages weights, gradients and optimizer state
are most of a stage, and 65% had no plan for 25 of 36 runs).
Per stage it records three numbers:

- predicted: the plan's ``stages[s].peak.total``;
- fake: :func:`lightning_pipe.lightning.check.fake_peaks`, called as the local engine calls it
  (same ``on_cpu``: the CPU stages and whether an operator picks its kernel by device);
- metered: ``strategy.meter.peaks()`` after training;

and the errors (predicted - metered) / metered and (fake - metered) / metered. A run that fails
(no plan, out of memory, a capture error, ...) is a row with its error. All rows go to
``benchmarks/unseen_results.json``; the printed table has the worst over- and under-prediction
and the worst fake error (largest in size, with its sign) per family/schedule/memopt.
"""

import argparse
import json
import logging
import math
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from benchmarks.run import quiet
from lightning_pipe.lightning.check import fake_peaks, picks_kernel_by_device
from lightning_pipe.lightning.strategy import MemoryPipeStrategy
from lightning_pipe.plan.plan import Plan

STAGES, CHUNKS, BATCH, STEPS, LIMITS = 2, 4, 16, 2, (0.8, 0.9)
SCHEDULES = ("gpipe", "1f1b", "2bw")
RESULTS = Path(__file__).resolve().parent / "unseen_results.json"
VOCAB, LENGTH, IMAGE, CLASSES = 96, 16, 16, 10


# --- the families --------------------------------------------------------------------------


class Samples(Dataset):
    """Seeded samples, each a dict of tensors (as a Hugging Face collator makes them) or a tuple."""

    def __init__(self, make: Callable[[torch.Generator], Any], size: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.items = [make(g) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def tokens(g: torch.Generator, length: int = LENGTH) -> Tensor:
    return torch.randint(1, VOCAB, (length,), generator=g)


def image(g: torch.Generator, channels: int = 3) -> Tensor:
    return torch.randn(channels, IMAGE, IMAGE, generator=g)


def label(g: torch.Generator) -> Tensor:
    return torch.randint(0, CLASSES, (), generator=g)


class Plain(LightningModule):
    """A plain LightningModule: ``net`` makes the loss from a tuple batch ``(x, y)``."""

    def __init__(self, net: nn.Module, optimizer: str,
                 loss: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy) -> None:
        super().__init__()
        self.net, self.optimizer, self.loss = net, optimizer, loss

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.optimizer, self.parameters())


class HF(LightningModule):
    """A Hugging Face model: the batch dict in as keywords, the loss it computes from ``labels`` out."""

    def __init__(self, model: nn.Module, optimizer: str) -> None:
        super().__init__()
        self.model, self.optimizer = model, optimizer

    def forward(self, **batch: Tensor) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.optimizer, self.parameters())


def optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` of batch-first ``nn.TransformerEncoderLayer``, embedding and head."""

    def __init__(self, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(LENGTH, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(x) + self.position))


class Decoder(nn.Module):
    """``nn.TransformerDecoder`` of ``nn.TransformerDecoderLayer``: causal self-attention over the
    target, cross-attention to an embedded source (the sample's first half)."""

    def __init__(self, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerDecoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, layers)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LENGTH // 2), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        source, target = x[:, : LENGTH // 2], x[:, LENGTH // 2 :]
        out = self.decoder(self.embed(target), self.embed(source), tgt_mask=self.mask, tgt_is_causal=True)
        return self.head(out)


class BasicBlock(nn.Module):
    """He et al. 2015, the basic block: two 3x3 conv-BN, ReLU between, identity or 1x1 projection shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths: Sequence[int] = (16, 32, 64), blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, inputs = [], widths[0]
        for i, width in enumerate(widths):
            for b in range(blocks):
                layers.append(BasicBlock(inputs, width, 2 if i > 0 and b == 0 else 1))
                inputs = width
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(inputs, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def double_conv(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(outputs, outputs, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    """Ronneberger et al. 2015: a contracting path (double 3x3 conv, 2x2 max-pool), an expanding
    path (2x2 up-convolution, concatenation with the cropped contracting map: here padded convs,
    so no crop, double conv), a 1x1 conv to per-pixel classes."""

    def __init__(self, base: int = 16, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([double_conv(1 if i == 0 else widths[i - 1], widths[i]) for i in range(depth)])
        self.bottom = double_conv(widths[depth - 1], widths[depth])
        self.up = nn.ModuleList([nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
                                 for i in reversed(range(depth))])
        self.merge = nn.ModuleList([double_conv(2 * widths[i], widths[i]) for i in reversed(range(depth))])
        self.out = nn.Conv2d(base, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips)):
            x = merge(torch.cat([skip, up(x)], dim=1))
        return self.out(x)


class MixerLayer(nn.Module):
    """Tolstikhin et al. 2021: token-mixing MLP across patches, channel-mixing MLP, pre-LayerNorm, skips."""

    def __init__(self, patches: int, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.tokens = nn.Sequential(nn.Linear(patches, 2 * patches), nn.GELU(), nn.Linear(2 * patches, patches))
        self.channels = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, patch: int = 4, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, patch, stride=patch)
        self.layers = nn.Sequential(*[MixerLayer((IMAGE // patch) ** 2, width) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.layers(x)).mean(1))


class InPlace(nn.Module):
    """In-place ops on views: ``relu_``, ``add_``, ``mul_``, ``view``, ``transpose``, ``narrow`` and slicing."""

    def __init__(self, width: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.inner = nn.ModuleList([nn.Linear(width, 2 * width) for _ in range(layers)])
        self.outer = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.head = nn.Linear(width, CLASSES)
        self.width = width

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1).narrow(1, 0, self.width)
        for inner, outer in zip(self.inner, self.outer):
            h = inner(x).relu_()  # (batch, 2w)
            h = h.view(h.shape[0], 2, self.width).transpose(1, 2)  # (batch, w, 2): a view
            gate = h[:, :, 0].sigmoid()
            y = h[:, :, 1].mul(gate)
            y.mul_(0.5).add_(x)
            x = outer(y).add_(x).narrow(1, 0, self.width)
        return self.head(x)


class Metered(LightningModule):
    """A step that updates a torchmetrics ``MulticlassAccuracy`` and logs it."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * IMAGE * IMAGE, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, CLASSES))
        self.accuracy = MulticlassAccuracy(num_classes=CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.accuracy(logits, y)
        self.log("train_acc", self.accuracy, on_step=True)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer("sgd", self.parameters())


def hf_text(g: torch.Generator) -> dict[str, Tensor]:
    ids = tokens(g)
    return {"input_ids": ids, "labels": ids}


def bert_sample(g: torch.Generator) -> dict[str, Tensor]:
    ids = tokens(g)
    masked = torch.rand(LENGTH, generator=g) < 0.15
    masked[0] = True
    return {"input_ids": ids.masked_fill(masked, 1), "attention_mask": torch.ones_like(ids),
            "labels": ids.masked_fill(~masked, -100)}


def t5_sample(g: torch.Generator) -> dict[str, Tensor]:
    ids = tokens(g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[: LENGTH // 2]}


def hf(name: str, optimizer: str, **config: Any) -> Callable[[], LightningModule]:
    def make() -> LightningModule:
        import transformers

        model_class, config_class = {
            "bert": ("BertForMaskedLM", "BertConfig"), "gpt2": ("GPT2LMHeadModel", "GPT2Config"),
            "t5": ("T5ForConditionalGeneration", "T5Config"), "llama": ("LlamaForCausalLM", "LlamaConfig"),
            "vit": ("ViTForImageClassification", "ViTConfig"),
        }[name]
        return HF(getattr(transformers, model_class)(getattr(transformers, config_class)(**config)), optimizer)

    return make


TEXT = {"vocab_size": VOCAB}


@dataclass(frozen=True)
class Family:
    """A model family: how to make its module and one sample."""

    model: Callable[[], LightningModule]
    sample: Callable[[torch.Generator], Any]
    source: str


def _text_pair(g: torch.Generator) -> tuple[Tensor, Tensor]:
    x = tokens(g)
    return x, torch.roll(x, -1)


def _decoder_pair(g: torch.Generator) -> tuple[Tensor, Tensor]:
    x = tokens(g)
    return x, torch.roll(x, -1)[LENGTH // 2 :]


FAMILIES: dict[str, Family] = {
    "torch-encoder": Family(lambda: Plain(Encoder(), "adam", lm_loss), _text_pair,
                            "nn.TransformerEncoder, 4 batch-first layers, width 64"),
    "torch-decoder": Family(lambda: Plain(Decoder(), "adamw", lm_loss), _decoder_pair,
                            "nn.TransformerDecoder, 4 layers, causal mask, cross-attention"),
    "hf-bert-mlm": Family(hf("bert", "adam", **TEXT, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                             intermediate_size=128, max_position_embeddings=LENGTH, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0), bert_sample, "BertForMaskedLM"),
    "hf-gpt2": Family(hf("gpt2", "adamw", **TEXT, n_positions=LENGTH, n_embd=64, n_layer=4, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False), hf_text, "GPT2LMHeadModel"),
    "hf-t5": Family(hf("t5", "adam", **TEXT, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                       dropout_rate=0.0, decoder_start_token_id=0, use_cache=False), t5_sample,
                    "T5ForConditionalGeneration"),
    "hf-llama": Family(hf("llama", "adamw", **TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
                          use_cache=False), hf_text, "LlamaForCausalLM (grouped-query attention)"),
    "hf-vit": Family(hf("vit", "adam", image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=64,
                        num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, num_labels=CLASSES,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                     lambda g: {"pixel_values": image(g), "labels": label(g)}, "ViTForImageClassification"),
    "resnet-bn": Family(lambda: Plain(ResNet(), "sgd"), lambda g: (image(g), label(g)),
                        "ResNet of basic blocks with BatchNorm (He et al. 2015)"),
    "unet-skips": Family(lambda: Plain(UNet(), "adam"),
                         lambda g: (image(g, 1), torch.randint(0, 4, (IMAGE, IMAGE), generator=g)),
                         "U-Net, 3 levels, long skips by concatenation (Ronneberger et al. 2015)"),
    "mlp-mixer": Family(lambda: Plain(Mixer(), "sgd"), lambda g: (image(g), label(g)),
                        "MLP-Mixer (Tolstikhin et al. 2021)"),
    "inplace-views": Family(lambda: Plain(InPlace(), "adam"), lambda g: (image(g), label(g)),
                            "relu_, add_, mul_ on view/transpose/narrow/slices"),
    "torchmetrics-step": Family(Metered, lambda g: (image(g), label(g)),
                                "MLP; the step updates and logs MulticlassAccuracy"),
}


# --- one run ------------------------------------------------------------------------------


@dataclass
class Row:
    """One family x schedule x memopt run: per stage predicted, fake and metered bytes."""

    family: str
    schedule: str
    memopt: str
    stages: int
    limit: int | None = None
    share: float | None = None  # the limit, of the largest metered stage peak of the *off* run
    balance: list[int] = field(default_factory=list)
    recomputed: int = 0
    predicted: list[int] = field(default_factory=list)
    fake: list[int] = field(default_factory=list)
    metered: list[int] = field(default_factory=list)
    predicted_error: list[float] = field(default_factory=list)
    fake_error: list[float] = field(default_factory=list)
    metered_by_kind: list[dict[str, int]] = field(default_factory=list)  # each stage's bytes at its peak
    error: str | None = None
    seconds: float = 0.0
    # a run with no plan: the least fullest-stage metered peak over every cut, each with every
    # node kept and every node recomputed (``no_plan``), and that split
    least_peak: int | None = None
    least_balance: list[int] = field(default_factory=list)
    splits_tried: int = 0
    plan: Plan | None = None  # the plan that trained (not written out)


class FirstBatch(Callback):
    """Keeps the first training batch, as the engine plans and checks from it."""

    def __init__(self) -> None:
        self.batch: Any = None

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.batch is None:
            self.batch = batch


def fake_check(strategy: MemoryPipeStrategy, batch: Any) -> list[int]:
    """``fake_peaks`` for the plan that trained, called as ``LocalEngine._check`` calls it."""
    engine: Any = strategy.engine
    assert engine.captured is not None and strategy.plan is not None
    optimizer = engine.optimizers[0] if engine.optimizers else None
    devices = list(engine.parallel_devices or [])
    on_cpu = all(d.type == "cpu" for d in devices) and picks_kernel_by_device(engine.captured)
    return fake_peaks(engine.module, engine.captured, batch, 0, optimizer, engine.precision_plugin, strategy.plan,
                      on_cpu=on_cpu, devices=devices)


def relative(value: int, metered: int) -> float:
    """(value - metered) / metered; a stage holding nothing (a planner may leave one empty):
    0 where the value is also 0."""
    if metered == 0:
        return 0.0 if value == 0 else math.inf
    return (value - metered) / metered


def measure(name: str, schedule: str, memopt: str, limit: int | None, stages: int = STAGES,
            follow: Path | None = None) -> Row:
    """Train ``name`` two steps (``follow``: by that saved plan); the row has its three
    per-stage numbers, or its error."""
    family, row = FAMILIES[name], Row(name, schedule, memopt, stages, limit)
    start = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = family.model()
        strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, measure_memory=True, memory_limit=limit,
                                      plan=follow)
        first = FirstBatch()
        trainer = Trainer(accelerator="cpu", devices=stages, strategy=strategy, max_steps=STEPS, callbacks=[first],
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)
        data = DataLoader(Samples(family.sample, BATCH * STEPS), batch_size=BATCH, drop_last=True)
        with quiet():
            trainer.fit(model, data)
        assert strategy.plan is not None and strategy.meter is not None
        row.plan = strategy.plan
        row.balance = list(strategy.plan.balance)
        row.recomputed = sum(p != "keep" for p in strategy.plan.policies)
        row.predicted = [s.peak.total for s in strategy.plan.stages]
        row.metered = list(strategy.meter.peaks())
        row.metered_by_kind = [dict(s.peak_by_kind) for s in strategy.meter.stages]
        with quiet():
            row.fake = fake_check(strategy, first.batch)
        row.predicted_error = [relative(p, m) for p, m in zip(row.predicted, row.metered)]
        row.fake_error = [relative(f, m) for f, m in zip(row.fake, row.metered)]
    except Exception as error:  # a failed run is a result
        row.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    row.seconds = round(time.perf_counter() - start, 2)
    return row


def run(families: Sequence[str], schedules: Sequence[str] = SCHEDULES, memopts: Sequence[str] = ("off", "on"),
        out: Path | None = RESULTS, echo: bool = True) -> list[Row]:
    """Every family x schedule x memopt; rows written to ``out`` (as JSON) as they come."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_pipe").setLevel(logging.ERROR)
    rows: list[Row] = []
    start = time.perf_counter()
    if echo:
        print(header())
    for name in families:
        for schedule in schedules:
            off = measure(name, schedule, "off", None)
            if "off" in memopts:
                rows.append(off)
                if echo:
                    print(line(off), flush=True)
            if "on" in memopts:
                on = memory_optimised(name, schedule, off)
                rows.append(on)
                if echo:
                    print(line(on), flush=True)
            if out is not None:
                write(rows, out, time.perf_counter() - start)
    return rows


def memory_optimised(name: str, schedule: str, off: Row) -> Row:
    """The *on* run at the first share of ``LIMITS`` of ``off``'s largest metered peak with a plan."""
    if not off.metered:
        return Row(name, schedule, "on", STAGES, error="no unconstrained run to size from")
    for share in LIMITS:
        on = measure(name, schedule, "on", int(share * max(off.metered)))
        on.share = share
        if not (on.error or "").startswith("InfeasiblePlanError"):
            return on
    assert off.plan is not None and on.limit is not None
    on.least_peak, on.least_balance, on.splits_tried = no_plan(name, schedule, off.plan)
    return on


def no_plan(name: str, schedule: str, template: Plan) -> tuple[int, list[int], int]:
    """Whether a plan the planner refused exists after all, metered: every 2-stage cut of the
    graph, each once with every node kept and once with every node recomputed (the fewest
    activations), trained by a saved plan (``template``'s, with that split and those policies)
    with no limit. Returns the least fullest-stage peak over them, its split and the number of
    runs. (A peak under both choices that does not move with the cut's activations is the
    optimizer step's: weights, gradients and state, which no memory optimisation lowers.)"""
    nodes, best, runs = sum(template.balance), (math.inf, [0]), 0
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        for cut in range(1, nodes):
            for policy in ("keep", "recompute"):
                balance = [cut, nodes - cut]
                path.write_text(replace(template, balance=balance, policies=[policy] * nodes).to_json())
                row = measure(name, schedule, "bound", None, follow=path)
                if row.error is None:
                    runs += 1
                    best = min(best, (max(row.metered), balance))
    return int(best[0]), best[1], runs


def write(rows: Sequence[Row], out: Path, seconds: float) -> None:
    """``rows`` into ``out``, replacing the rows there of the same family and schedule (a run of
    some families keeps the others')."""
    runs = {(r.family, r.schedule) for r in rows}
    kept = json.loads(out.read_text())["rows"] if out.exists() else []
    kept = [r for r in kept if (r["family"], r["schedule"]) not in runs]
    order = list(FAMILIES)
    new = [{k: v for k, v in asdict(r).items() if k != "plan"} for r in rows]
    merged = sorted([*kept, *new], key=lambda r: (order.index(r["family"]) if r["family"] in order
                                                                 else len(order), SCHEDULES.index(r["schedule"])))
    meta = {"stages": STAGES, "chunks": CHUNKS, "batch": BATCH, "steps": STEPS, "limit_shares": list(LIMITS),
            "torch": torch.__version__, "last_run_seconds": round(seconds, 1)}
    out.write_text(json.dumps({"settings": meta, "rows": merged}, indent=1) + "\n")


def worst(errors: Sequence[float]) -> float:
    """The error largest in size, with its sign."""
    return max(errors, key=abs) if errors else math.nan


def header() -> str:
    return "| family | schedule | memopt | balance | recomputed | worst over | worst under | worst fake | note |\n" \
           "|---|---|---|---|---|---|---|---|---|"


NONE = "\N{EN DASH}"  # no number: the run failed


def short(error: str) -> str:
    """An error's first clause for the table (the JSON has it whole)."""
    least = re.search(r"smallest peak any plan reaches with memory optimisation is (\d+) bytes on stage (\d+) "
                      r"\(planning target (\d+)\)", error)
    if least:
        peak, stage, target = map(int, least.groups())
        return f"{error.split(':')[0]}: least peak {peak:,} B on stage {stage} > target {target:,} B"
    text = error.replace("|", "/").split(". ")[0]
    return text if len(text) <= 110 else text[:107] + "..."


def memopt(row: Row) -> str:
    """*off*, or *on* with its limit's share."""
    return row.memopt if row.share is None else f"{row.memopt} ({row.share:.0%})"


def line(row: Row) -> str:
    if row.error is not None:
        note = short(row.error)
        if row.least_peak is not None and row.limit is not None:
            exists = "no plan exists" if row.least_peak > row.limit else "A PLAN EXISTS"
            note += (f"; {exists}: least metered peak over every 2-stage cut, every node kept or recomputed "
                     f"({row.splits_tried} runs), {row.least_peak:,} B at {row.least_balance} vs limit {row.limit:,} B")
        return (f"| {row.family} | {row.schedule} | {memopt(row)} | {NONE} | {NONE} | {NONE} | {NONE} | {NONE} "
                f"| {note} |")
    over, under = max(0.0, max(row.predicted_error)), max(0.0, -min(row.predicted_error))
    return (f"| {row.family} | {row.schedule} | {memopt(row)} | {row.balance} | {row.recomputed} | {over:.1%} "
            f"| {under:.1%} | {worst(row.fake_error):+.1%} | |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", metavar="family", help=f"of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--schedules", nargs="*", default=list(SCHEDULES))
    parser.add_argument("--table", action="store_true", help=f"print the table of {RESULTS.name}; run nothing")
    args = parser.parse_args(argv)
    if args.table:
        print(header())
        for r in json.loads(RESULTS.read_text())["rows"]:
            print(line(Row(**r)))
        return
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    start = time.perf_counter()
    run(args.families or list(FAMILIES), args.schedules)
    print(f"\n{time.perf_counter() - start:.0f} s; rows in {RESULTS}")


if __name__ == "__main__":
    main()
