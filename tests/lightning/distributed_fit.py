"""A script the distributed tests run: Lightning's launcher starts one process per device and
re-runs it in each. Runs the scenarios named on the command line in order, in the same
processes; each saves what the tests compare (checkpoints, what each rank logged or returned).

    python tests/lightning/distributed_fit.py OUT DEVICES SCENARIO...

A scenario is ``family:schedule:stages[:metered][:features][:vN][:cN][:lN][:bf16|:fp16][:fsdp]`` (a few steps with
``MemoryPipeStrategy(runtime="distributed")``, :func:`fit`; ``schedule`` may be ``auto``, with ``metered``), a
number (the steps of the configurations after it), ``metrics:schedule:stages`` (:func:`metrics`),
``denoiser:schedule:stages[:vN]`` (:func:`denoiser`), ``recover:family:schedule:stage:step:cut[:pN][:vN]``
(:func:`recover`), ``shrink:family:limit[:pN]`` (:func:`shrink`; ``pN``: N pipeline ranks, the rest replicas),
``drift``, ``replans`` (:func:`replans`), ``faults:N`` (:func:`faults`), ``hooks``, ``features``, ``sharded``,
``fsdp-sharded`` (:func:`sharded`), ``fsdp-empty``, ``fsdp-peaks`` (:func:`fsdp_peaks`; after a fit: on its group),
``refused``, ``exported``, ``indivisible``, ``raise`` or ``hang`` (:func:`fail`). ``exported`` ends with an error,
which ends the processes; so do ``indivisible``, ``raise`` and ``hang``: each comes last (``replans`` ends with
errors every rank raises together: the processes go on). Every object collective fails on a tensor that is not a
CPU copy.
"""

import functools
import inspect
import io
import json
import os
import pickle
import sys
import time
import warnings
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.faults import Cut, cases, run
from examples.hf_gpt2 import GPT2LM, Counting
from examples.models import ImageDataset, TokenDataset, UNet, loader
from lightning_pipe import MemoryPipeStrategy
from tests.models import Denoiser, HookRecorder, LlamaLM, MetricUNet, WritesInForward, make
from tests.plan.fsdp_ranks import measure

BATCH, CHUNKS = 8, 4
# the GPT's fuller stage at pp=2 under 1F1B needs 707,456 B unconstrained, no plan less than 512,896 B:
# a limit with room, which lowered by 30% binds and still fits
SHRINK_LIMIT = 900_000
# at pp=2 x dp=2 (micro-batches of one, a gradient bucket) the GPT's fuller stage needs 539,040 B
# unconstrained, no plan less than 474,112 B: lowered by 30%, 504,000 binds and fits
SHRINK_LIMIT_DP = 720_000
METRIC_STEPS = 4  # the metrics scenario validates every two steps
ACCUMULATE, CLIP, GAMMA = 2, 0.05, 0.5  # a features run: accumulation, clipping by norm, a step-wise LR decay


def fit(out: Path, devices: int, steps: int, family: str, schedule: str, stages: int, metered: bool,
        features: bool, virtual: int | None = None, saved: bool = False, precision: str = "32-true",
        chunks: int = CHUNKS, fsdp: bool = False, memory_limit: int | None = None) -> None:
    """``metered``: plan (rank 0 profiles), measure memory and log per-stage metrics to a CSV
    logger in ``out``; else an even split by parameter bytes. ``features``: accumulate, clip
    and decay the learning rate every step (:func:`with_scheduler`). ``virtual``: stages per
    process (``None``: the schedule's default). ``chunks``: micro-batches per batch (``-cN`` in the
    tag where not :data:`CHUNKS`). ``saved``: the plan ``out/saved-plan-SCHEDULE.json`` (written by the
    test), followed as is. ``precision``: the Trainer's (``bf16-mixed``, ``16-mixed``: named in the tag).
    ``fsdp``: each stage sharded over its replicas (``data_parallel="fsdp"``). ``memory_limit``: bytes (``:lN``,
    not in the tag)."""
    model, data = make_model(family)
    if features:
        with_scheduler(model)
    strategy = MemoryPipeStrategy(runtime="distributed", stages=stages, schedule=schedule, chunks=chunks,
                                  planner="dawnpiper" if metered else None, measure_memory=metered,
                                  virtual_stages=virtual, plan=out / f"saved-plan-{schedule}.json" if saved else None,
                                  data_parallel="fsdp" if fsdp else "ddp", memory_limit=memory_limit)
    tag = f"{family}-{schedule}-{stages}" + (f"-v{virtual}" if virtual else "") + \
        (f"-c{chunks}" if chunks != CHUNKS else "") + \
        {"bf16-mixed": "-bf16", "16-mixed": "-fp16"}.get(precision, "") + ("-fsdp" if fsdp else "")
    # (on the CPU, Lightning runs 16-mixed as bf16-mixed, without the grad scaler a GPU has: given here)
    mixed = {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]} \
        if precision == "16-mixed" else {"precision": precision}
    if precision == "16-mixed":
        overflow_at_second_step(model, lambda: model.trainer.global_step)
    logger = CSVLogger(out, name=tag) if metered else False
    extra = {"accumulate_grad_batches": ACCUMULATE, "gradient_clip_val": CLIP} if features else {}
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=logger,
                      log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **mixed, **extra)
    replicas = devices // stages
    dtypes: set[str] = set()  # of every linear layer's output in the steps after the first (planned), this rank's
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(lambda m, args, out: dtypes.add(str(out.dtype))
                                        if m.training and model.trainer.global_step else None)
    trainer.fit(model, loader(data, BATCH // replicas))
    name = tag + ("-features" if features else "")
    trainer.save_checkpoint(out / f"{name}.ckpt")
    rank = trainer.global_rank
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    mesh, plan = model.device_mesh, strategy.plan
    result = {"logged": logged, "mesh": list(mesh.shape), "balance": plan.balance if plan else None,
              "policies": plan.policies if plan else None, "linear_dtypes": sorted(dtypes),
              "schedule": [plan.schedule, plan.virtual_stages] if plan else None,  # (schedule="auto": the pick)
              "considered": [[c.schedule, c.virtual_stages, c.step_ms] for c in plan.considered] if plan else None,
              "stages": strategy.engine.pipe.stages,  # this rank's
              "local_shapes": {n: list(p.to_local().shape) for n, p in model.named_parameters()
                               if hasattr(p, "to_local")}}  # (FSDP's shards)
    if ((virtual or 1) > 1 or schedule == "zbv") and replicas == 1 and is_overridden("validation_step", model):
        # evaluation through every rank's stages in turn (one replica: all data), in a loop or a V
        result["val"] = trainer.validate(model, loader(data, BATCH), verbose=False)[0]["val_loss"]
    (out / f"{name}-rank{rank}.json").write_text(json.dumps(result))


def overflow_at_second_step(model: LightningModule, step: Any) -> None:
    """The GPT's final norm's weight gets an infinite gradient in the second step (``step()``:
    the steps done): an overflow on the last stage alone, which every stage's scaler must skip."""
    model.ln_f.weight.register_hook(lambda grad: grad * float("inf") if step() == 1 else grad)


def make_model(family: str) -> tuple[LightningModule, Any]:
    """A freshly seeded model of :data:`tests.models.FAMILIES`, ``hf``: a Hugging Face GPT-2
    from a config (torch.export captures it; its head tied to its embedding), ``llama``:
    :class:`~tests.models.LlamaLM` (AdamW, a metric logged), or ``droppy``: the GPT with dropout
    (:class:`~tests.lightning.test_dropout.DroppyGPT`), with its dataset."""
    if family == "hf":
        torch.manual_seed(0)
        return GPT2LM(layers=2, dim=32, heads=2, vocab=256, context=16, dropout=0.0), Counting(64, 256, 16)
    if family == "llama":
        torch.manual_seed(0)
        return LlamaLM(), Counting(64, 256, 16)
    if family == "droppy":
        from tests.lightning.test_dropout import DroppyGPT

        torch.manual_seed(0)
        return DroppyGPT(), TokenDataset()
    return make(family)


def with_scheduler(model: LightningModule) -> None:
    """The model's optimizer with its learning rate times ``GAMMA`` after every step."""
    configure = model.configure_optimizers

    def configure_optimizers() -> dict:
        optimizer = configure()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    model.configure_optimizers = configure_optimizers


def recover(out: Path, devices: int, steps: int, family: str, schedule: str, stage: int, step: int, cut: float,
            stages: int | None = None, virtual: int | None = None) -> None:
    """``family`` planned at pp=``stages`` (every process: ``None``; the rest replicas) with
    ``virtual`` stages a process (``None``: the schedule's; no memory limit); at batch ``step``
    the meter of pipeline rank ``stage`` of replica 0 alone is cut to ``1 - cut`` of its peak so
    far (:class:`_CutReplica`): the step runs out of memory there, every rank plans again and
    runs it again. Every rank saves the split before and after, its peak and capacity, the
    parameters it holds at the end, and the re-plans warned."""
    model, data = make_model(family)
    strategy = MemoryPipeStrategy(runtime="distributed", stages=stages, schedule=schedule, chunks=CHUNKS,
                                  planner="dawnpiper", measure_memory=True, virtual_stages=virtual,
                                  timeout=timedelta(minutes=1))
    splits = _Splits(strategy)
    tag = f"recover-{family}-{schedule}-{stage}-{step}" + (f"-p{stages}" if stages else "") + \
        (f"-v{virtual}" if virtual else "")
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[_CutReplica(strategy, stage, step, 1 - cut, of_peak=True), splits])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(data, BATCH // (devices // (stages or devices))))
    trainer.save_checkpoint(out / f"{tag}.ckpt")
    meter = strategy.meter
    result = {"splits": splits.seen, "peak": meter.stages[0].peak, "capacity": meter.capacities[0],
              "held": [name for name, p in model.named_parameters() if p.numel()],
              "warned": [str(w.message) for w in caught if "Planned again" in str(w.message)]}
    (out / f"{tag}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


class _CutReplica(Cut):
    """A :class:`~benchmarks.faults.Cut` on replica 0's rank alone: the stage's other replicas
    keep their memory."""

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, batch_idx: int) -> None:
        if module.device_mesh["dp"].get_local_rank() == 0:
            super().on_train_batch_start(trainer, module, batch, batch_idx)


class _Splits(Callback):
    """The plan's balance, recomputed or swapped nodes and targets at each training batch."""

    def __init__(self, strategy: MemoryPipeStrategy) -> None:
        self.strategy, self.seen = strategy, []

    def on_train_batch_end(self, trainer, *args) -> None:
        plan = self.strategy.plan
        self.seen.append([plan.balance, [k for k, p in enumerate(plan.policies) if p != "keep"], plan.targets])


def shrink(out: Path, devices: int, family: str, limit: int, stages: int | None = None) -> None:
    """``family`` planned at pp=``stages`` (every process: ``None``; the rest replicas) under
    ``memory_limit=limit``; at batch 2 of 5 a callback lowers every stage's limit by 30%
    (:class:`_Lower`), on every rank. Every rank saves the split at each batch, the limits,
    its metered peak from the re-plan on, and the parameters it holds at the end."""
    model, data = make(family)
    strategy = MemoryPipeStrategy(runtime="distributed", stages=stages, schedule="1f1b", chunks=CHUNKS,
                                  planner="dawnpiper", measure_memory=True, memory_limit=limit,
                                  timeout=timedelta(minutes=1))
    splits = _Splits(strategy)
    tag = f"shrink-{family}" + (f"-p{stages}" if stages else "")
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=5, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[_Lower(strategy, 2, 0.7), splits])
    trainer.fit(model, loader(data, BATCH // (devices // (stages or devices))))
    trainer.save_checkpoint(out / f"{tag}.ckpt")
    result = {"splits": splits.seen, "lowered": strategy.memory_limit, "peak": strategy.meter.stages[0].peak,
              "capacity": strategy.meter.capacities[0],
              "held": [name for name, p in model.named_parameters() if p.numel()]}
    (out / f"{tag}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


class _Lower(Callback):
    """At training batch ``step`` every stage's limit becomes ``share`` of what it was, as when
    another job takes memory."""

    def __init__(self, strategy: MemoryPipeStrategy, step: int, share: float) -> None:
        self.strategy, self.step, self.share = strategy, step, share

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == self.step:
            self.strategy.memory_limit = [int(self.share * limit) for limit in self.strategy.memory_limit]


def drift(out: Path, devices: int, steps: int) -> None:
    """The GPT planned at pp=``devices`` under ``memory_limit=SHRINK_LIMIT``; from batch 1 on,
    the last rank keeps a tensor the profile never saw, half the limit, and no meter
    refuses (:class:`_Hoard`): its peak drifts past its prediction and its target, and every
    rank plans again before the next step. Every rank saves the splits and the re-plans warned."""
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(runtime="distributed", schedule="1f1b", chunks=CHUNKS, planner="dawnpiper",
                                  measure_memory=True, memory_limit=SHRINK_LIMIT, timeout=timedelta(minutes=1))
    splits = _Splits(strategy)
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[_Hoard(strategy, devices - 1, SHRINK_LIMIT // 2), splits])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(data, BATCH))
    trainer.save_checkpoint(out / "drift.ckpt")
    result = {"splits": splits.seen, "warned": [str(w.message) for w in caught if "Planned again" in str(w.message)]}
    (out / f"drift-rank{trainer.global_rank}.json").write_text(json.dumps(result))


class _Hoard(Callback):
    """From training batch 1 on, pipeline rank ``stage`` keeps ``nbytes`` the profile never
    saw (a cache the user's code fills), and no meter refuses."""

    def __init__(self, strategy: MemoryPipeStrategy, stage: int, nbytes: int) -> None:
        self.strategy, self.stage, self.nbytes = strategy, stage, nbytes

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        meter = self.strategy.meter
        if meter is None:  # (the first batch builds the stages)
            return
        meter.capacities[0] = None
        if batch_idx == 1 and module.device_mesh["pp"].get_local_rank() == self.stage:
            meter.run_as(0, lambda: setattr(module, "hoard", torch.zeros(self.nbytes // 4)))


def replans(out: Path, devices: int) -> None:
    """Recovery giving up, each run saving a checkpoint every step (:func:`_saving`):
    ``max_replans=1`` with the last pipeline rank's meter cut at batch 1 (planned for) and the
    first's at batch 2 (one re-plan too many); then, under ``memory_limit=SHRINK_LIMIT``, the
    last rank's meter cut to 2% of it at batch 1: less than the tied head's weight, gradient and
    momentum, which the last stage holds in any plan. Every rank saves each error."""
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(runtime="distributed", schedule="1f1b", chunks=CHUNKS, planner="dawnpiper",
                                  measure_memory=True, max_replans=1, timeout=timedelta(minutes=1))
    cuts = [Cut(strategy, devices - 1, 1, 0.9, of_peak=True), Cut(strategy, 0, 2, 0.9, of_peak=True)]
    _saving(out, devices, "replans", model, data, strategy, cuts)
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(runtime="distributed", schedule="1f1b", chunks=CHUNKS, planner="dawnpiper",
                                  measure_memory=True, memory_limit=SHRINK_LIMIT, timeout=timedelta(minutes=1))
    _saving(out, devices, "infeasible", model, data, strategy, [Cut(strategy, devices - 1, 1, 0.02)])


def _saving(out: Path, devices: int, name: str, model: LightningModule, data: Any, strategy: MemoryPipeStrategy,
            callbacks: list[Callback]) -> None:
    """Fit with a checkpoint saved after every step, ``out/name/last.ckpt``; every rank saves
    the error the fit ended with, ``out/name-rankN.txt``."""
    saving = ModelCheckpoint(dirpath=out / name, save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, saving])
    try:
        trainer.fit(model, loader(data, BATCH))
        error = "no error"
    except Exception as e:  # the test reads it
        error = f"{type(e).__name__}: {e}"
    (out / f"{name}-rank{trainer.global_rank}.txt").write_text(error)


def faults(out: Path, devices: int, count: int) -> None:
    """The first ``count`` cases of ``python -m benchmarks.faults --runtime distributed``;
    every rank saves each case's outcome."""
    outcomes = [run(case, "distributed") for case in cases(count)]
    (out / f"faults-rank{dist.get_rank()}.json").write_text(json.dumps(outcomes))


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


def metrics(out: Path, devices: int, steps: int, schedule: str, stages: int) -> None:
    """The U-Net logging torchmetrics metrics (:class:`~tests.models.MetricUNet`), validated
    every two steps, with a checkpoint monitoring a metric and early stopping on a synced loss;
    a rank waits at most a minute for another. Every rank saves what it logged and decided,
    and the trained weights."""
    torch.manual_seed(0)
    model, data = MetricUNet(), ImageDataset()
    tag = f"metrics-{schedule}-{stages}"
    checkpoint = ModelCheckpoint(dirpath=out / tag, monitor="val_acc", mode="max")
    stopping = EarlyStopping(monitor="val_loss", patience=1)
    strategy = MemoryPipeStrategy(runtime="distributed", stages=stages, schedule=schedule, chunks=CHUNKS,
                                  planner=None, timeout=timedelta(minutes=1))
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0,
                      callbacks=[checkpoint, stopping],
                      enable_progress_bar=False, enable_model_summary=False)
    replicas = devices // stages
    trainer.fit(model, loader(data, BATCH // replicas), loader(data, BATCH // replicas))
    trainer.save_checkpoint(out / f"{tag}.ckpt")
    result = {"logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
              "best": float(checkpoint.best_model_score), "best_path": Path(checkpoint.best_model_path).name,
              "should_stop": trainer.should_stop, "wait": stopping.wait_count,
              "replica": model.device_mesh["dp"].get_local_rank()}
    (out / f"{tag}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


def denoiser(out: Path, devices: int, steps: int, schedule: str, stages: int, virtual: int) -> None:
    """:class:`~tests.models.Denoiser` (noise, a mask and a level drawn or changed in its step
    before ``self(...)``); every rank saves the losses it logged, and the weights."""
    torch.manual_seed(0)
    model = Denoiser()
    data = TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(0)))
    tag = f"denoiser-{schedule}-{stages}" + (f"-v{virtual}" if virtual > 1 else "")
    strategy = MemoryPipeStrategy(runtime="distributed", stages=stages, schedule=schedule, chunks=CHUNKS,
                                  planner=None, virtual_stages=virtual, timeout=timedelta(minutes=1))
    losses = []
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[_Losses(losses)])
    trainer.fit(model, DataLoader(data, batch_size=BATCH, drop_last=True))
    trainer.save_checkpoint(out / f"{tag}.ckpt")
    with warnings.catch_warnings(record=True) as caught:  # the module, read after training: this rank's stages
        warnings.simplefilter("always")
        model.state_dict()
        model.state_dict()
    warned = [str(w.message) for w in caught if "holds only the tensors" in str(w.message)]
    (out / f"{tag}-rank{trainer.global_rank}.json").write_text(json.dumps({"losses": losses, "warned": warned}))


class _Losses(Callback):
    """Keeps the loss every step logged."""

    def __init__(self, losses: list[float]) -> None:
        self.losses = losses

    def on_train_batch_end(self, trainer, *args) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def sharded(out: Path, devices: int, fsdp: bool = False) -> None:
    """Two steps saved as a sharded checkpoint; a fresh model resumed from it for two more,
    saved sharded again. ``fsdp``: at pp=2, each stage sharded over its replicas, which see the
    same batches; also saved full after the resumed steps."""
    name = "fsdp-sharded" if fsdp else "sharded"
    model, data = make("gpt")
    trainer = Trainer(**sharded_trainer(devices, steps=2, fsdp=fsdp))
    trainer.fit(model, loader(data, BATCH))
    trainer.save_checkpoint(out / name)
    resumed, _ = make("gpt", seed=1)
    again = Trainer(**sharded_trainer(devices, steps=4, fsdp=fsdp))
    again.fit(resumed, loader(data, BATCH), ckpt_path=out / name)
    again.save_checkpoint(out / f"{name}-resumed")
    if fsdp:
        again.strategy.options.state_dict_type = "full"
        again.save_checkpoint(out / f"{name}-resumed.ckpt")


def sharded_trainer(devices: int | None, steps: int, fsdp: bool = False) -> dict:
    """The sharded run's Trainer arguments; ``devices=None``: the single-device reference."""
    strategy = {} if devices is None else {
        "devices": devices, "use_distributed_sampler": False,
        "strategy": MemoryPipeStrategy(runtime="distributed", schedule="1f1b", chunks=CHUNKS, planner=None,
                                       state_dict_type="sharded", stages=2 if fsdp else None,
                                       data_parallel="fsdp" if fsdp else "ddp"),
    }
    return dict(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, **strategy)


def empty(out: Path, devices: int) -> None:
    """The U-Net built on the meta device, planned, validated first (a sanity check on a
    provisional split) and trained three steps; then a meta-built model resumed from its
    checkpoint for two more. Every rank saves which tensors of the model have storage."""
    _, data = make("unet")
    trainer = Trainer(**empty_trainer(devices, steps=3))
    with trainer.init_module(empty_init=True):
        torch.manual_seed(0)
        model = UNet()
    trainer.fit(model, loader(data, BATCH), loader(data, BATCH))
    trainer.save_checkpoint(out / "empty.ckpt")
    strategy = trainer.strategy
    stored = {name: not t.is_meta for name, t in model.state_dict(keep_vars=True).items()}
    result = {"stored": stored, "balance": strategy.plan.balance, "stage": strategy.engine.pipe.position}
    (out / f"empty-rank{trainer.global_rank}.json").write_text(json.dumps(result))
    again = Trainer(**empty_trainer(devices, steps=5))
    with again.init_module(empty_init=True):
        resumed = UNet()
    again.fit(resumed, loader(data, BATCH), loader(data, BATCH), ckpt_path=out / "empty.ckpt")
    again.save_checkpoint(out / "empty-resumed.ckpt")


def fsdp_empty(out: Path, devices: int) -> None:
    """:func:`empty`'s first run at pp=2, each stage sharded over its replicas: validated
    first (on the provisional, unsharded split), trained three steps, validated again (the
    sharded stages gathered outside the schedule); every rank saves the validation loss. Then
    the same without the sanity check: the sharded stages built straight from the meta device."""
    _, data = make("unet")
    trainer = Trainer(**empty_trainer(devices, steps=3, fsdp=True))
    with trainer.init_module(empty_init=True):
        torch.manual_seed(0)
        model = UNet()
    trainer.fit(model, loader(data, BATCH), loader(data, BATCH))
    trainer.save_checkpoint(out / "fsdp-empty.ckpt")
    val = trainer.validate(model, loader(data, BATCH), verbose=False)[0]["val_loss"]
    (out / f"fsdp-empty-rank{trainer.global_rank}.json").write_text(json.dumps({"val": val}))
    unchecked = Trainer(**{**empty_trainer(devices, steps=3, fsdp=True), "num_sanity_val_steps": 0})
    with unchecked.init_module(empty_init=True):
        torch.manual_seed(0)
        model = UNet()
    unchecked.fit(model, loader(data, BATCH))
    unchecked.save_checkpoint(out / "fsdp-empty-unchecked.ckpt")


def fsdp_peaks(out: Path, devices: int) -> None:
    """Real FSDP2 in a 1F1B pipeline at pp=2 x dp=2 on the launch's group, sharded by the plans
    the test wrote (``tests/plan/fsdp_ranks.py``): each rank's peak, for its prediction."""
    measure(out, 2)


def empty_trainer(devices: int | None, steps: int, fsdp: bool = False) -> dict:
    """The meta-built run's Trainer arguments; ``devices=None``: the single-device reference."""
    strategy = {} if devices is None else {
        "devices": devices, "strategy": MemoryPipeStrategy(runtime="distributed", schedule="1f1b", chunks=CHUNKS,
                                                           planner="dawnpiper", stages=2 if fsdp else None,
                                                           data_parallel="fsdp" if fsdp else "ddp"),
    }
    return dict(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, limit_val_batches=1,
                num_sanity_val_steps=1, enable_progress_bar=False, enable_model_summary=False,
                use_distributed_sampler=False, **strategy)


def exported(out: Path, devices: int) -> None:
    """Models torch.export captures: GPT-2 from a small config (1F1B, validated before and after
    training) and one that doubles in training and triples in evaluation; on every rank, the
    validation losses. Then GPT-2 predicts without labels, which needs a graph no rank can
    export any more: global rank 0 saves the error."""
    from tests.lightning.test_hf_models import Batches, Branchy, HFModule

    result = {}
    gpt2 = HFModule("gpt2")
    gpt2_trainer = Trainer(**exported_trainer(devices, steps=3, sanity=1))
    gpt2_trainer.fit(gpt2, DataLoader(Batches("gpt2"), batch_size=8), DataLoader(Batches("gpt2", size=8), batch_size=8))
    gpt2_trainer.save_checkpoint(out / "gpt2.ckpt")
    result["gpt2"] = gpt2_trainer.callback_metrics["val_loss"].item()
    branchy = Branchy(heads=True)
    trainer = Trainer(**exported_trainer(devices, steps=2, sanity=0))
    data = DataLoader(TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0))), batch_size=8)
    trainer.fit(branchy, data)
    result["branchy"] = trainer.validate(branchy, data)[0]["val_loss"]
    (out / f"exported-rank{trainer.global_rank}.json").write_text(json.dumps(result))
    unlabelled = [{"input_ids": ids} for ids in Batches("gpt2", size=8).ids]
    try:
        gpt2_trainer.predict(gpt2, DataLoader(unlabelled, batch_size=8))
    except RuntimeError as error:
        (out / f"predict-error-rank{trainer.global_rank}.txt").write_text(str(error))


def exported_trainer(devices: int | None, steps: int, sanity: int) -> dict:
    """The exported run's Trainer arguments; ``devices=None``: the single-device reference."""
    strategy = {} if devices is None else {
        "devices": devices, "strategy": MemoryPipeStrategy(runtime="distributed", schedule="1f1b", chunks=CHUNKS,
                                                           planner=None),
    }
    return dict(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, limit_val_batches=1,
                num_sanity_val_steps=sanity, enable_progress_bar=False, enable_model_summary=False,
                use_distributed_sampler=False, **strategy)


def fail(out: Path, devices: int, hang: bool) -> None:
    """The last rank raises in its first ``training_step`` call, or (``hang``) sleeps an hour in
    its first loss; timeout 5 s. The time the scenario starts is saved."""
    model, data = make("gpt")
    step = model.training_step
    (out / f"{'hang' if hang else 'raise'}-start-{os.getpid()}").write_text(str(time.time()))

    def training_step(batch, batch_idx):
        rank = model.trainer.global_rank
        if rank == devices - 1:
            if not hang:
                raise RuntimeError(f"rank {rank} fails on purpose")
            if torch.is_grad_enabled():  # not while every rank probes for self(...)'s arguments
                time.sleep(3600)
        return step(batch, batch_idx)

    model.training_step = training_step
    strategy = MemoryPipeStrategy(runtime="distributed", chunks=CHUNKS, planner=None, timeout=timedelta(seconds=5))
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(data, BATCH))


class _HostOnly(pickle.Pickler):
    """Pickles what an object collective carries, failing on a tensor that is not a plain CPU
    copy (one on a device unpickles on the sender's device index; one attached to autograd is
    the sender's live tensor, not a copy made for the trip)."""

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor) and (obj.device.type != "cpu" or obj.requires_grad):
            raise AssertionError(f"a {obj.device} tensor (requires_grad={obj.requires_grad}) in an object collective")
        return NotImplemented


def _host_only(collective, payload: str):
    """``collective`` checking its argument ``payload`` with :class:`_HostOnly` first."""
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def checked(*args, **kwargs):
        _HostOnly(io.BytesIO()).dump(signature.bind(*args, **kwargs).arguments[payload])
        return collective(*args, **kwargs)

    return checked


for _name, _payload in [("broadcast_object_list", "object_list"), ("all_gather_object", "obj"),
                        ("gather_object", "obj"), ("send_object_list", "object_list")]:
    setattr(dist, _name, _host_only(getattr(dist, _name), _payload))


def hooks(out: Path, devices: int) -> None:
    """The training hooks of four steps of the GPT under 1F1B, accumulating two batches a step,
    clipping by norm and decaying the learning rate; every rank saves them in order."""
    model, data = make("gpt")
    with_scheduler(model)
    recorder = HookRecorder()
    strategy = MemoryPipeStrategy(runtime="distributed", schedule="1f1b", chunks=CHUNKS, planner=None)
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, accumulate_grad_batches=2,
                      gradient_clip_val=0.05, callbacks=[recorder], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model, loader(data, BATCH))
    (out / f"hooks-rank{trainer.global_rank}.json").write_text(json.dumps(recorder.calls))


def indivisible(out: Path, devices: int) -> None:
    """Three stages asked of the processes (a depth that does not divide them): the start time
    is saved, then every rank fails."""
    model, data = make("gpt")
    (out / f"indivisible-start-{os.getpid()}").write_text(str(time.time()))
    strategy = MemoryPipeStrategy(runtime="distributed", stages=3, chunks=CHUNKS, planner=None)
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(data, BATCH))


def refused(out: Path, devices: int) -> None:
    """Bad input every rank refuses before any collective, each saving its error: a buffer
    written in forward, a batch smaller than ``chunks`` per replica, a balance without an entry
    per process. Under torchrun, which leaves each rank to go on after a failed fit (Lightning's
    launcher's rank 0 ends the others)."""
    cases: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "buffer": (WritesInForward("ema"), loader(TokenDataset(16), 8), {}),
        "small": (make("gpt")[0], loader(TokenDataset(16), 2), {}),  # 2 samples a replica (pp=2), chunks=4
        "balance": (make("gpt")[0], loader(TokenDataset(16), 8), {"balance": [6]}),  # stages=None: counted at start
    }
    for name, (model, data, options) in cases.items():
        strategy = MemoryPipeStrategy(runtime="distributed", chunks=CHUNKS, planner=None, **options)
        trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        try:
            trainer.fit(model, data)
            error = "no error"
        except Exception as e:  # the test reads it
            error = f"{type(e).__name__}: {e}"
        (out / f"refused-{name}-rank{trainer.global_rank}.txt").write_text(error)


SCENARIOS = {"hooks": hooks, "refused": refused, "indivisible": indivisible, "features": features, "sharded": sharded,
             "fsdp-sharded": partial(sharded, fsdp=True), "empty": empty, "fsdp-empty": fsdp_empty,
             "fsdp-peaks": fsdp_peaks,
             "exported": exported, "replans": replans,
             "raise": partial(fail, hang=False), "hang": partial(fail, hang=True)}


if __name__ == "__main__":
    out, devices, steps = Path(sys.argv[1]), int(sys.argv[2]), 3
    for scenario in sys.argv[3:]:
        if scenario.isdigit():
            steps = int(scenario)
        elif scenario in SCENARIOS:
            SCENARIOS[scenario](out, devices)
        elif scenario.startswith("denoiser:"):
            _, schedule, stages, *flags = scenario.split(":")
            virtual = next((int(f[1:]) for f in flags if f.startswith("v")), 1)
            denoiser(out, devices, steps, schedule, int(stages), virtual)
        elif scenario.startswith("recover:"):
            _, family, schedule, stage, step, cut, *flags = scenario.split(":")
            pp = next((int(f[1:]) for f in flags if f.startswith("p")), None)
            virtual = next((int(f[1:]) for f in flags if f.startswith("v")), None)
            recover(out, devices, steps, family, schedule, int(stage), int(step), float(cut), pp, virtual)
        elif scenario == "drift":
            drift(out, devices, steps)
        elif scenario.startswith("shrink:"):
            _, family, limit, *flags = scenario.split(":")
            shrink(out, devices, family, int(limit), next((int(f[1:]) for f in flags if f.startswith("p")), None))
        elif scenario.startswith("faults:"):
            faults(out, devices, int(scenario.split(":")[1]))
        elif scenario.startswith("metrics:"):
            _, schedule, stages = scenario.split(":")
            metrics(out, devices, steps, schedule, int(stages))
        else:
            family, schedule, stages, *flags = scenario.split(":")
            virtual = next((int(f[1:]) for f in flags if f.startswith("v")), None)
            fit(out, devices, steps, family, schedule, int(stages), "metered" in flags, "features" in flags, virtual,
                "saved" in flags, "bf16-mixed" if "bf16" in flags else "16-mixed" if "fp16" in flags else "32-true",
                next((int(f[1:]) for f in flags if f.startswith("c")), CHUNKS), "fsdp" in flags,
                next((int(f[1:]) for f in flags if f.startswith("l")), None))
