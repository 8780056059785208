"""Shared test helpers: seeded Lightning runs and parameter comparison."""

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import Strategy

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


def trainer(strategy: "str | Strategy" = "auto", devices: int = 1, **kwargs: Any) -> Trainer:
    kwargs.setdefault("max_steps", 5)
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def max_rel_diff(a: LightningModule, b: LightningModule, keys: list[str] | None = None) -> float:
    """Largest relative difference ||a - b|| / ||b|| over the floating tensors of two state dicts."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(
        ((sa[k].cpu() - sb[k].cpu()).norm() / sb[k].norm().clamp_min(1e-12)).item()
        for k in (keys or sa)
        if sa[k].is_floating_point()
    )
