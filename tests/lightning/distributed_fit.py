"""A script the distributed tests run: Lightning's launcher starts one process per device and
re-runs it in each. Trains each ``family:schedule:stages`` for a few steps with
``MemoryPipeStrategy(runtime="distributed")`` and saves a checkpoint and what each rank logged.

    python tests/lightning/distributed_fit.py OUT DEVICES STEPS gpt:gpipe:2 unet:1f1b:4:metered ...
    python tests/lightning/distributed_fit.py OUT DEVICES features
    python tests/lightning/distributed_fit.py OUT DEVICES raise   # rank 1 raises in its first step
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from examples.models import loader
from lightning_pipe import MemoryPipeStrategy
from tests.models import make

BATCH, CHUNKS = 8, 4


def fit(out: Path, devices: int, steps: int, family: str, schedule: str, stages: int, metered: bool) -> None:
    """``metered``: plan (rank 0 profiles), measure memory and log per-stage metrics to a CSV
    logger in ``out``; else an even split by parameter bytes."""
    model, data = make(family)
    strategy = MemoryPipeStrategy(runtime="distributed", stages=stages, schedule=schedule, chunks=CHUNKS,
                                  planner="dawnpiper" if metered else None, measure_memory=metered)
    logger = CSVLogger(out, name=f"{family}-{schedule}-{stages}") if metered else False
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=logger,
                      log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    replicas = devices // stages
    trainer.fit(model, loader(data, BATCH // replicas))
    name = f"{family}-{schedule}-{stages}"
    trainer.save_checkpoint(out / f"{name}.ckpt")
    rank = trainer.global_rank
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    mesh = model.device_mesh
    (out / f"{name}-rank{rank}.json").write_text(json.dumps({"logged": logged, "mesh": list(mesh.shape)}))


def features(out: Path, devices: int) -> None:
    """1F1B with gradient accumulation, clipping, validation with a monitored checkpoint, then
    validate/test/predict and a resumed fit; on every rank, what each returned."""
    model, data = make("gpt")
    trainer = Trainer(**features_trainer(out, devices, steps=4))
    trainer.fit(model, loader(data, BATCH), loader(data, BATCH))
    trainer.save_checkpoint(out / "features.ckpt")
    val = trainer.validate(model, loader(data, BATCH))
    test = trainer.test(model, loader(data, BATCH))
    predictions = trainer.predict(model, loader(data, BATCH))
    resumed, _ = make("gpt", seed=1)
    again = Trainer(**features_trainer(out, devices, steps=6))
    again.fit(resumed, loader(data, BATCH), loader(data, BATCH), ckpt_path=out / "features.ckpt")
    again.save_checkpoint(out / "features-resumed.ckpt")
    result = {"val": val[0]["val_loss"], "test": test[0]["test_loss"],
              "predictions": [p.sum().item() for p in predictions],
              "best": trainer.checkpoint_callback.best_model_score.item()}
    (out / f"features-rank{trainer.global_rank}.json").write_text(json.dumps(result))


def features_trainer(out: Path, devices: int | None, steps: int) -> dict:
    """The features run's Trainer arguments; ``devices=None``: the single-device reference."""
    strategy = {} if devices is None else {
        "devices": devices, "use_distributed_sampler": False,
        "strategy": MemoryPipeStrategy(runtime="distributed", schedule="1f1b", chunks=CHUNKS, planner=None),
    }
    checkpoint = ModelCheckpoint(dirpath=out / f"checkpoints-{devices}", monitor="val_loss")
    return dict(accelerator="cpu", max_steps=steps, accumulate_grad_batches=2, gradient_clip_val=0.05,
                limit_val_batches=2, logger=False, callbacks=[checkpoint], enable_progress_bar=False,
                enable_model_summary=False, **strategy)


def fail(devices: int) -> None:
    model, data = make("gpt")
    step = model.training_step

    def training_step(batch, batch_idx):
        if model.trainer.global_rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        return step(batch, batch_idx)

    model.training_step = training_step
    strategy = MemoryPipeStrategy(runtime="distributed", chunks=CHUNKS, planner=None,
                                  timeout=timedelta(seconds=20))
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(data, BATCH))


if __name__ == "__main__":
    out, devices = Path(sys.argv[1]), int(sys.argv[2])
    if sys.argv[3] == "raise":
        fail(devices)
    elif sys.argv[3] == "features":
        features(out, devices)
    else:
        for config in sys.argv[4:]:
            family, schedule, stages, *metered = config.split(":")
            fit(out, devices, int(sys.argv[3]), family, schedule, int(stages), metered == ["metered"])
