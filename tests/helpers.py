"""Shared test helpers: Lightning runs on the CPU and parameter comparison."""

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import Strategy


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
