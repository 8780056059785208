"""Fault injection: runs whose stage devices lose memory mid-run, at random; how many the
strategy saves by planning again (``max_replans``), and whether any is lost.

    python -m benchmarks.faults [--cases 30] [--seed 0] [--runtime local|distributed]

Each case trains a random family (the example GPT, U-Net or encoder-decoder, small) on two
CPU stages for three steps under a limit with room (the fuller stage of an unconstrained plan,
plus half), with a random schedule; at a random step a random stage loses 5-40% of the memory
it has used so far, without the strategy being told (the meter's capacity drops, as when
another process takes device memory). A case is *recovered* when the run finishes with the
parameters of single-device training (1e-5), *refused* when it ends with the error naming the
stage because the planner finds no split that fits what is left, and *lost* otherwise.

``--runtime distributed``: two processes, a stage each (Lightning's launcher starts the second,
which runs the same cases), the memory limit that of the devices (the cut stage's meter is the
only one that refuses); every rank must agree on the failure, plan again and move parameters
and optimizer state between them. Global rank 0 prints.
"""

import argparse
import os
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch.utils.data import Dataset

from examples.models import GPT, EncoderDecoder, ImageDataset, Seq2SeqDataset, TokenDataset, UNet, loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.lightning.recovery import RecoveryError

STEPS = 3
# The families at their smallest that still plan with recompute: a case trains in seconds.
FAMILIES: dict[str, tuple[Callable[[], LightningModule], Callable[[], Dataset[Any]]]] = {
    "gpt": (lambda: GPT(layers=2), TokenDataset),
    "unet": (lambda: UNet(depth=2), ImageDataset),
    "encdec": (lambda: EncoderDecoder(layers=2), Seq2SeqDataset),
}


class Cut(Callback):
    """At training batch ``step`` the meter's capacity of ``stage`` drops to ``share`` of its
    limit (of its metered peak so far: ``of_peak``) without the strategy being told."""

    def __init__(self, strategy: MemoryPipeStrategy, stage: int, step: int, share: float, of_peak: bool = False):
        self.strategy, self.stage, self.step, self.share, self.of_peak = strategy, stage, step, share, of_peak
        self.capacity: int | None = None

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, batch_idx: int) -> None:
        meter = self.strategy.meter
        # under runtime="distributed" each rank meters its own stage, as its meter's stage 0
        mesh = module.device_mesh
        index = self.stage if mesh is None else 0 if mesh["pp"].get_local_rank() == self.stage else None
        if batch_idx == self.step and meter is not None and index is not None:
            base = meter.stages[index].peak if self.of_peak else meter.capacities[index]
            assert base is not None
            self.capacity = int(base * self.share)
            meter.capacities[index] = self.capacity


@dataclass
class Case:
    family: str
    schedule: str
    stage: int
    step: int
    cut: float


def cases(count: int, seed: int = 0) -> Iterator[Case]:
    rnd = random.Random(seed)
    for _ in range(count):
        family, schedule = rnd.choice(list(FAMILIES)), rnd.choice(["gpipe", "1f1b"])
        yield Case(family, schedule, rnd.randrange(2), rnd.randrange(1, STEPS), rnd.uniform(0.05, 0.4))


def fit(family: str, strategy: Any = "auto", devices: int = 1, steps: int = STEPS,
        callbacks: list[Callback] | None = None) -> Trainer:
    """A Trainer that trained ``family``'s model (seeded) ``steps`` steps on CPU devices, on
    the batches of one device."""
    make, data = FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks or [], use_distributed_sampler=False)
    trainer.fit(model, loader(data(), 4))
    return trainer


@cache
def limit(family: str, schedule: str) -> int:
    """A limit with room: the fuller stage of an unconstrained plan of ``family``, plus half."""
    strategy = MemoryPipeStrategy(chunks=2, schedule=schedule, measure_memory=True)  # type: ignore[arg-type]
    fit(family, strategy, 2, steps=1)
    assert strategy.plan is not None
    return int(1.5 * max(s.peak.total for s in strategy.plan.stages))


@cache
def reference(family: str) -> dict[str, torch.Tensor]:
    return cast(LightningModule, fit(family).lightning_module).state_dict()


def run(case: Case, runtime: str = "local") -> tuple[str, str]:
    """The case's outcome (``recovered``, ``refused`` or ``lost``) and what happened; under
    ``runtime="distributed"``, on every rank (the parameters compared on global rank 0, the
    peaks on each rank: the others say ``recovered`` where theirs are within their limits)."""
    distributed = runtime == "distributed"
    limits = {} if distributed else {"memory_limit": limit(case.family, case.schedule)}
    strategy = MemoryPipeStrategy(chunks=2, schedule=case.schedule, measure_memory=True,  # type: ignore[arg-type]
                                  runtime=runtime, **limits)  # type: ignore[arg-type]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = fit(case.family, strategy, 2,
                          callbacks=[Cut(strategy, case.stage, case.step, 1 - case.cut, True)])
    except RecoveryError as error:
        refused = f"Stage {case.stage} is out of memory" in str(error) and "No plan keeps every stage" in str(error)
        return ("refused" if refused else "lost"), str(error).splitlines()[0][:160]
    replans = [str(w.message) for w in caught if str(w.message).startswith("Planned again")]
    meter = strategy.meter
    assert meter is not None
    within = all(m.peak <= c for m, c in zip(meter.stages, meter.capacities) if c is not None)
    if distributed:  # the whole model, gathered on global rank 0 (a checkpoint's state)
        state = strategy.lightning_module_state_dict()
        if trainer.global_rank != 0:
            return ("recovered" if within else "lost"), f"peaks within limits: {within}"
    else:
        state = cast(LightningModule, trainer.lightning_module).state_dict()
    diff = max(((state[k] - v).norm() / v.norm().clamp_min(1e-12)).item()
               for k, v in reference(case.family).items() if v.is_floating_point())
    if not replans or not within or diff >= 1e-5:
        return "lost", f"{len(replans)} re-plans, peaks within limits: {within}, parameters off by {diff:.1e}"
    return "recovered", f"{len(replans)} re-plan(s), parameters off by {diff:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runtime", choices=["local", "distributed"], default="local")
    args = parser.parse_args()
    outcomes = []
    show = print if int(os.environ.get("LOCAL_RANK", "0")) == 0 else lambda *a, **k: None  # (the launched rank's 1)
    for k, case in enumerate(cases(args.cases, args.seed)):
        outcome, detail = run(case, args.runtime)
        outcomes.append(outcome)
        show(f"{k:>3} {case.family:<7} {case.schedule:<6} stage {case.stage} step {case.step} cut {case.cut:5.1%}: "
             f"{outcome} ({detail})", flush=True)
    show(f"{len(outcomes)} runs ({args.runtime}): {outcomes.count('recovered')} recovered, "
         f"{outcomes.count('refused')} refused (no split fits), {outcomes.count('lost')} lost")


if __name__ == "__main__":
    main()
