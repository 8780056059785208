"""LightningCLI entry point: every MemoryPipeStrategy argument is settable from YAML or flags.

    python examples/cli.py fit --config examples/configs/gpt.yaml
    python examples/cli.py fit --config examples/configs/gpt.yaml --trainer.strategy.chunks=8
"""

import os
import sys

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(__file__))  # so "models.GPT" resolves when run as a script

from models import SyntheticData

import lightning_pipe  # noqa: F401  (registers the "memory_pipe" strategy name)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(datamodule_class=SyntheticData, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
