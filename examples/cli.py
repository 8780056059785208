"""LightningCLI entry point: every MemoryPipeStrategy argument is settable from YAML or flags.

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
from examples.models import SyntheticData


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(
        datamodule_class=SyntheticData,
        trainer_defaults={"default_root_dir": os.path.join("lightning_logs", "cli")},
        save_config_kwargs={"overwrite": True},  # the same folder on every run without a logger
        args=args,
    )


if __name__ == "__main__":
    main()
