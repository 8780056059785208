"""Fine-tune a Hugging Face GPT-2 over 4 CPU pipeline stages: print the plan, the split and
the final loss. The model is built from a small config in code and trained on synthetic
counting sequences, so nothing is downloaded.

    python examples/hf_gpt2.py [--layers 4 --dim 128 --steps 40]

torch.fx cannot trace GPT-2, so the strategy captures it with torch.export at the first
``forward`` call. For a pretrained model, build it with ``GPT2LMHeadModel.from_pretrained``
instead, with ``use_cache=False``.
"""

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_pipe import MemoryPipeStrategy


class GPT2LM(LightningModule):
    """A plain LightningModule around a Hugging Face model, the pattern for any of them:
    ``forward`` takes the batch as keyword arguments and returns the model's output, whose
    ``loss`` the model computes from ``labels``."""

    def __init__(self, layers: int = 4, dim: int = 128, heads: int = 4, vocab: int = 128, context: int = 64,
                 dropout: float = 0.1, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=vocab, n_positions=context, n_embd=dim, n_layer=layers, n_head=heads,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
            use_cache=False,  # no key/value cache in training: export cannot return it
        )
        self.model = GPT2LMHeadModel(config)

    def forward(self, **batch: Tensor) -> object:
        return self.model(**batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self(**batch).loss  # self(...), not self.model(...): the pipeline runs forward
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


class Counting(Dataset):
    """Sequences counting up from a random start by a random step (mod ``vocab``): the next
    token follows from the last two, so a small model learns it in a few dozen steps."""

    def __init__(self, size: int, vocab: int, context: int) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(vocab, (size, 1), generator=g)
        step = torch.randint(1, 8, (size, 1), generator=g)
        self.ids = (start + step * torch.arange(context)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # the model shifts the labels itself


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--memory-limit", help="per stage, e.g. 20MiB: low enough and the plan recomputes")
    args = parser.parse_args(argv)

    seed_everything(0)
    model = GPT2LM(layers=args.layers, dim=args.dim, context=args.context)
    data = DataLoader(Counting(args.batch_size * args.steps, vocab=128, context=args.context),
                      batch_size=args.batch_size, shuffle=True)
    strategy = MemoryPipeStrategy(chunks=4, schedule="1f1b", memory_limit=args.memory_limit)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    loss = float(trainer.callback_metrics["train_loss"])
    print("\nPer-stage split (graph nodes and parameters each stage owns):")
    print(strategy.describe())
    print(f"\nfinal train_loss: {loss:.4f} after {trainer.global_step} steps")
    return loss


if __name__ == "__main__":
    main()
