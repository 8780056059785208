"""Train a small GPT-style LM over 4 CPU pipeline stages: print the plan, the per-stage split
and the metered memory of every stage.

    python examples/train_gpt.py
"""

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from models import GPT, TokenDataset, loader

from lightning_pipe import MemoryPipeStrategy


def main() -> None:
    seed_everything(0)
    model = GPT(layers=4)
    strategy = MemoryPipeStrategy(chunks=4, measure_memory=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=10,
        logger=CSVLogger("lightning_logs", name="train_gpt"),
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(TokenDataset(size=128), batch_size=16))
    print("\nPer-stage split (graph nodes and parameters each stage owns):")
    print(strategy.describe())
    print("\nPer-stage memory, metered from the live tensors of each stage:")
    print(strategy.memory_summary())
    print(f"\nfinal train_loss: {trainer.callback_metrics['train_loss']:.4f} after {trainer.global_step} steps")
    print(f"plan (JSON and plot) and per-stage metrics: {trainer.logger.log_dir}/plan.json, plan.png, metrics.csv")


if __name__ == "__main__":
    main()
