"""LightningCLI entry point: every MemoryPipeStrategy argument is settable from YAML or flags.
The configs name the model and the data module by class path (``lightning-pipe plan --config``
reads both: the data module's first batch is what its checks run ``training_step`` on).

    python examples/cli.py fit --config examples/configs/gpt.yaml
    python examples/cli.py fit --config examples/configs/gpt.yaml --trainer.strategy.chunks=8

The run's files (LightningCLI's ``config.yaml``, and the plan with a logger) go under
``lightning_logs/cli`` of the current directory unless ``--trainer.default_root_dir`` says otherwise.
"""

import os
import sys

from lightning.pytorch.cli import LightningCLI

# The configs name classes from the repository root (examples.models.GPT), as `lightning-pipe plan` does.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_pipe.lightning.strategy  # noqa: F401  (registers the "memory_pipe" strategy name)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(
        trainer_defaults={"default_root_dir": os.path.join("lightning_logs", "cli")},
        save_config_kwargs={"overwrite": True},  # the same folder on every run without a logger
        args=args,
    )


def outcome(cli: LightningCLI) -> str:
    """What a run ends with: its last logged loss, and where its files went."""
    trainer = cli.trainer
    losses = {k: float(v) for k, v in trainer.callback_metrics.items() if "loss" in k}
    logged = ", ".join(f"{k} {v:.4f}" for k, v in losses.items()) or "no loss logged"
    lines = [f"{trainer.global_step} steps; {logged}"]
    if trainer.logger is not None and trainer.logger.log_dir is not None:
        lines.append(f"plan (plan.json, plan.png) and metrics: {trainer.logger.log_dir}")
    else:
        lines.append("no logger: the plan was printed above, no files written (set trainer.logger to keep them)")
    lines.append(f"config: {os.path.join(trainer.default_root_dir, 'config.yaml')}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(outcome(main()))
