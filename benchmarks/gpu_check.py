"""Predicted against measured GPU memory: the plan check's figures (a fake training step, its
allocations replayed through the CUDA caching allocator's rules) against
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, on three model families: the
GPT and the U-Net of ``examples.models`` and a Hugging Face GPT-2 built from a config.

    python -m benchmarks.gpu_check [gpt unet gpt2] [--stages 4] [--devices cuda:0,cuda:1]

Each family trains ``--steps`` steps (1F1B, ``CHUNKS`` micro-batches) with
``MemoryPipeStrategy(measure_memory=True)``, its stages on ``--devices`` in turn (all on
``cuda:0`` by default); the device's peak statistics are reset after the first step, which
profiles and plans. Per stage it prints the plan's prediction, the meter's peak of the real run
and of the fake step, and the fake step's allocator figures for the stage alone; per device,
the fake step's allocator figures for the stages on it together against what CUDA measured,
and their ratios (predicted / measured). Needs a CUDA device; without one it says so and exits.
"""

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import Dataset

from benchmarks.run import quiet
from examples.models import GPT, ImageDataset, TokenDataset, UNet, loader
from lightning_pipe.lightning.check import fake_meter
from lightning_pipe.lightning.strategy import MemoryPipeStrategy
from lightning_pipe.measure.allocator import AllocatorPeaks

CHUNKS, MICROBATCH, STEPS = 4, 8, 3


@dataclass
class Family:
    """A model family at the sizes it is measured at: the model, and a data set of ``n`` samples."""

    name: str
    model: Callable[[], LightningModule]
    data: Callable[[int], Dataset[Any]]


def _gpt2(layers: int, dim: int, vocab: int, context: int) -> Family:
    from examples.hf_gpt2 import GPT2LM, Counting  # transformers only where this family runs

    return Family("gpt2", lambda: GPT2LM(layers=layers, dim=dim, heads=8, vocab=vocab, context=context, dropout=0.0),
                  lambda n: Counting(n, vocab=vocab, context=context))


def families(tiny: bool = False) -> dict[str, Callable[[], Family]]:
    """The three families, built on demand; ``tiny``: sizes that run in seconds on a CPU."""
    dim, layers, context, vocab, res, channels = (32, 2, 16, 64, 16, 8) if tiny else (512, 8, 256, 2048, 128, 32)
    return {
        "gpt": lambda: Family("gpt", lambda: GPT(vocab=vocab, dim=dim, heads=8, layers=layers, context=context),
                              lambda n: TokenDataset(n, vocab=vocab, context=context)),
        "unet": lambda: Family("unet", lambda: UNet(channels=channels, depth=3),
                               lambda n: ImageDataset(n, resolution=res)),
        "gpt2": lambda: _gpt2(layers, dim, vocab, context),
    }


@dataclass
class StageRow:
    """One stage's bytes: planned (the cost model), metered (the real run), fake (the check's
    meter), and the check's allocator replay for the stage alone."""

    stage: int
    device: str
    planned: int
    metered: int
    fake: int
    allocated: int
    reserved: int


@dataclass
class DeviceRow:
    """One device's bytes: the check's allocator replay for its stages together, and what the
    device's allocator showed (``None`` off CUDA)."""

    device: str
    stages: list[int]
    allocated: int
    reserved: int
    max_allocated: int | None
    max_reserved: int | None


class _ResetPeaks(Callback):
    """Reset the CUDA devices' peak statistics once the first step (profile, plan) is done,
    returning the cached blocks it left: the steps after it are what the check predicts."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = [d for d in dict.fromkeys(devices) if d.type == "cuda"]

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            for device in self.devices:
                with torch.cuda.device(device):
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()


def measure(family: Family, devices: Sequence[torch.device], steps: int = STEPS,
            microbatch: int = MICROBATCH) -> tuple[list[StageRow], list[DeviceRow]]:
    """Train ``family`` over one stage per entry of ``devices``; its rows."""
    batch = microbatch * CHUNKS
    torch.manual_seed(0)
    model = family.model()
    data = loader(family.data(batch * steps), batch)
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", measure_memory=True,
                                  parallel_devices=list(devices))
    trainer = Trainer(accelerator=devices[0].type, strategy=strategy, max_steps=steps, logger=False,
                      callbacks=[_ResetPeaks(devices)], enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    with quiet():
        trainer.fit(model, data)
    measured = {d: (torch.cuda.max_memory_allocated(d), torch.cuda.max_memory_reserved(d))
                for d in dict.fromkeys(devices) if d.type == "cuda"}
    assert strategy.plan is not None and strategy.meter is not None and strategy.engine.captured is not None
    model.forward = strategy.engine.run_forward  # type: ignore[method-assign]  # (teardown gave it its own back)
    meter = fake_meter(model, strategy.engine.captured, next(iter(data)), 0, strategy.optimizers[0],
                       strategy.precision_plugin, strategy.plan, trace=True)
    stages = [StageRow(s, str(d), strategy.plan.stages[s].peak.total, strategy.meter.peaks()[s], meter.peaks()[s],
                       *_bytes(meter.allocator_peaks([s])))
              for s, d in enumerate(devices)]
    rows = []
    for device in dict.fromkeys(devices):
        on = [s for s, d in enumerate(devices) if d == device]
        rows.append(DeviceRow(str(device), on, *_bytes(meter.allocator_peaks(on)), *measured.get(device, (None, None))))
    return stages, rows


def _bytes(peaks: AllocatorPeaks) -> tuple[int, int]:
    return peaks.allocated, peaks.reserved


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _ratio(predicted: int, measured: int | None) -> str:
    return "-" if not measured else f"{predicted / measured:.3f}"


def show(name: str, stages: list[StageRow], devices: list[DeviceRow]) -> None:
    """Print a family's rows (MiB)."""
    print(f"\n{name}: per stage, MiB (allocator: the check's replay for the stage alone)")
    print(f"{'stage':>5}  {'device':<8}{'planned':>10}{'metered':>10}{'fake':>10}{'allocated':>11}{'reserved':>10}")
    for s in stages:
        print(f"{s.stage:>5}  {s.device:<8}{_mib(s.planned):>10}{_mib(s.metered):>10}{_mib(s.fake):>10}"
              f"{_mib(s.allocated):>11}{_mib(s.reserved):>10}")
    print(f"{name}: per device, MiB, predicted (the stages on it together) / measured by CUDA")
    print(f"{'device':<8}{'stages':<12}{'allocated':>10}{'max_alloc':>10}{'ratio':>7}"
          f"{'reserved':>10}{'max_resv':>10}{'ratio':>7}")
    for d in devices:
        print(f"{d.device:<8}{','.join(map(str, d.stages)):<12}{_mib(d.allocated):>10}{_mib(d.max_allocated):>10}"
              f"{_ratio(d.allocated, d.max_allocated):>7}{_mib(d.reserved):>10}{_mib(d.max_reserved):>10}"
              f"{_ratio(d.reserved, d.max_reserved):>7}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, tuple[list[StageRow], list[DeviceRow]]]:
    """Measure and print each family named; exits with a message where no CUDA device is present."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", default=["gpt", "unet", "gpt2"], choices=["gpt", "unet", "gpt2"])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--devices", default="cuda:0", help="comma-separated; stage s runs on entry s mod their count")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--microbatch", type=int, default=MICROBATCH)
    parser.add_argument("--tiny", action="store_true", help="small models: a quick run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu_check needs a CUDA device, and this machine has none: run it where a GPU is lent.")
    names = [torch.device(d) for d in args.devices.split(",")]
    devices = [names[s % len(names)] for s in range(args.stages)]
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    builders = families(args.tiny)
    results = {}
    for name in args.families:
        results[name] = measure(builders[name](), devices, args.steps, args.microbatch)
        show(name, *results[name])
    return results


if __name__ == "__main__":
    main()
