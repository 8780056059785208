"""The interface between :class:`~lightning_pipe.lightning.strategy.MemoryPipeStrategy` and the
engine that holds this process's stages: all of them (:mod:`.local`) or this rank's of a
``("pp", "dp")`` mesh of processes (:mod:`.distributed`).

The strategy is what Lightning talks to and what both runtimes share: the options, skipping
Lightning's backward when the schedule runs it, the optimizer step and its metrics, teardown.
An engine builds this process's stages, runs a training step and an evaluation step on them,
gathers or shards their state for checkpoints, and says which processes and devices exist.
The defaults here are one process's.
"""

import gc
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.graph.capture import Captured, buffer_writes
from lightning_pipe.graph.shapes import Shapes
from lightning_pipe.internals import BatchNormBase
from lightning_pipe.lightning.internals import PATH
from lightning_pipe.lightning.options import PipeOptions
from lightning_pipe.lightning.recovery import Corrections, Failure, RecoveryError, UndoPoint, failure_of, replanned
from lightning_pipe.measure.clock import StageClock
from lightning_pipe.measure.meter import MemoryMeter, StageOutOfMemoryError
from lightning_pipe.plan.plan import InfeasiblePlanError, Plan
from lightning_pipe.plan.profile import Profile
from lightning_pipe.runtime.build import Policy

_T = TypeVar("_T")

__all__ = [
    "Engine", "check_buffer_writes", "check_follows", "check_microbatch", "device_memory", "policies_of",
    "state_to_param_devices",
]


class Engine:
    """What a runtime implements for the strategy (see the module docstring)."""

    def __init__(self, strategy: ParallelStrategy, options: PipeOptions) -> None:
        self.strategy = strategy
        self.options = options
        self.plan: Plan | None = None
        self.profile: Profile | None = None
        self.meter: MemoryMeter | None = None
        self.clock = StageClock(0)
        self.stepping = False  # inside the optimizer step (its closure runs the training step)
        self._corrections: Corrections | None = None  # what training showed the plan's check misses

    # --- what the strategy holds ---------------------------------------------------------

    @property
    def module(self) -> LightningModule:
        module = self.strategy.lightning_module
        assert module is not None, "the Trainer has not connected a LightningModule yet"
        return module

    @property
    def optimizers(self) -> list[Optimizer]:
        return self.strategy.optimizers

    @property
    def precision_plugin(self) -> Precision:
        return self.strategy.precision_plugin

    @property
    def parallel_devices(self) -> list[torch.device]:
        devices = self.strategy.parallel_devices
        assert devices, "the Trainer has not assigned devices to the strategy yet"
        return devices

    # --- processes and devices -----------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        return False

    @property
    def sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    def configure_launcher(self) -> None:
        """Start the other processes, where this engine has any."""

    def setup_ranks(self) -> None:
        """Tell the cluster environment this process's rank, where this engine has several."""

    def setup_environment(self) -> None:
        """Join the other processes, where this engine has any."""

    def tensor_init_context(self, empty_init: bool | None) -> AbstractContextManager[None] | None:
        """Where ``trainer.init_module`` builds the model; ``None``: Lightning's own."""
        return None

    # --- the module and its stages -------------------------------------------------------

    def check_setup(self, trainer: Trainer) -> None:
        """Refuse what this engine cannot run, before anything is placed."""

    def model_to_device(self) -> None:
        """Place the module (or what of it this process holds) and route its ``forward``."""
        raise NotImplementedError

    def after_setup(self, trainer: Trainer) -> None:
        """Once the optimizers and the precision exist."""

    @property
    def runs_backward(self) -> bool:
        """Whether ``training_step`` runs the backward itself, so that Lightning must skip its own."""
        raise NotImplementedError

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Plan or build at the first training batch (and again for a larger one)."""

    def training_step(self, step: Callable[[], Any], forwards_only: bool, *args: Any, **kwargs: Any) -> Any:
        """One training step; ``step`` runs the user's ``training_step`` as Lightning would.
        ``forwards_only``: Lightning skips backward itself (an epoch of forwards, as SWA runs)."""
        raise NotImplementedError

    def eval_step(self, hook: str, step: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        """One ``validation_step``, ``test_step`` or ``predict_step``; ``step`` runs it as Lightning would."""
        return step()

    def surviving(self, step: Callable[[], _T], undo: bool = True) -> _T:
        """Run one optimizer ``step`` (Lightning's closure inside: the training step, its
        backward), and where a stage runs out of memory in it, undo the attempt, plan again
        (:meth:`recover`) and run it again (:mod:`~lightning_pipe.lightning.recovery`).
        ``undo``: whether the step changes what an attempt must undo (loading a batch does not)."""
        replans = undo and self.replans()
        point = UndoPoint(self.module, self.parallel_devices, self.written_buffers()) if replans else None
        while True:
            try:
                return step()
            except (StageOutOfMemoryError, torch.OutOfMemoryError) as error:
                if not self.replans():  # nothing plans again: the error as it is
                    raise
                failure = self.failure_of(error)
            # Out of the handler the failed attempt's frames are unreachable, but cycles through
            # them (a traceback's frames, autograd's saved tensors) keep its tensors until collected.
            gc.collect()
            if point is not None:
                point.restore()
            self.recover(failure)

    def failure_of(self, error: BaseException) -> Failure:
        """What a step's out-of-memory ``error`` says of the stage that ran out."""
        return failure_of(error, self.parallel_devices)

    def written_buffers(self) -> list[Tensor]:
        """Buffers a training step writes in place (BatchNorm's statistics): an attempt that
        fails is undone by putting them back."""
        return [b for m in self.module.modules() if isinstance(m, BatchNormBase)
                for b in m.buffers(recurse=False)]

    def replans(self) -> bool:
        """Whether a step that runs out of memory is planned for again (:meth:`recover`)."""
        return False

    def recover(self, failure: Failure) -> None:
        """Plan and build the stages again after ``failure``, so the step can run again.

        Raises:
            RecoveryError: no new plan can be made, or ``max_replans`` were made already.
        """
        raise RecoveryError(f"{failure.message} This runtime does not plan again after running out of memory.")

    def after_step(self) -> None:
        """After a step that succeeded: plan again before the next where a stage's metered peak
        drifted past its prediction (:data:`~lightning_pipe.lightning.recovery.DRIFT`)."""

    @property
    def _memories(self) -> int:
        """How many memories training corrects the plan's check for (one factor each in
        :class:`~lightning_pipe.lightning.recovery.Corrections`)."""
        raise NotImplementedError

    def _corrections_so_far(self) -> Corrections:
        return self._corrections or Corrections.none(self._memories)

    def _replan(self, learn: Callable[[Corrections], None], why: str) -> None:
        """Plan again with what ``learn`` takes from training, rebuild (:meth:`_plan_again`),
        and warn why, with the split before and after.

        Raises:
            RecoveryError: ``max_replans`` were made already, or no plan fits.
        """
        assert self.plan is not None
        o = self.options
        corrections = self._corrections_so_far()
        corrections.count(why, o.max_replans)
        learn(corrections)
        self._corrections = corrections
        before = self.plan
        try:
            self._plan_again()
        except InfeasiblePlanError as error:
            raise RecoveryError(f"{why} No plan keeps every stage under its limit: {error}") from error
        rank_zero_warn(replanned(corrections, o.max_replans, why, before, self.plan))

    def _plan_again(self) -> None:
        """Plan this training batch again, below the limits divided by :attr:`_corrections`, and
        rebuild the stages with parameters and optimizer state moved.

        Raises:
            InfeasiblePlanError: no plan fits.
        """
        raise NotImplementedError

    def log_step_metrics(self, step_ms: float) -> None:
        """Per-stage time and memory of the step just taken, to the Trainer's loggers; called
        only at steps they take (reading the stage clocks waits for the device)."""
        raise NotImplementedError

    # --- state ---------------------------------------------------------------------------

    def module_state_dict(self) -> dict[str, Any] | None:
        """The module's state for a checkpoint; ``None``: Lightning's own."""
        return None

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any] | None:
        """An optimizer's state for a checkpoint; ``None``: Lightning's own."""
        return None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PATH) -> bool:
        """Write ``checkpoint`` where Lightning's own writing does not fit; whether it did."""
        return False

    def load_checkpoint(self, path: PATH) -> dict[str, Any] | None:
        """Read a checkpoint Lightning's own reading cannot; ``None``: Lightning reads it."""
        return None

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool) -> bool:
        """Load the module's state where Lightning's own loading does not fit; whether it did."""
        return False

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
            state_to_param_devices(optimizer)

    # --- collectives ---------------------------------------------------------------------

    def reduce(self, tensor: Tensor | Any, group: Any | None, reduce_op: Any) -> Tensor | Any:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool) -> bool:
        return decision

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any, src: int) -> Any:
        return obj

    def all_gather(self, tensor: Tensor, group: Any | None, sync_grads: bool) -> Tensor:
        return tensor

    def on_exception(self, exception: BaseException) -> None:
        pass

    def set_memory_limit(self, limits: list[int] | None) -> None:
        """A new memory limit per stage (``strategy.memory_limit = ...``), for the next plan."""
        self.options.memory_limit = limits

    def teardown(self, lightning_teardown: Callable[[], None]) -> None:
        """Undo what ``model_to_device`` and the steps changed on the module, around
        Lightning's own teardown (which moves the module and the optimizer state to the CPU)."""
        lightning_teardown()

    # --- reading the split ---------------------------------------------------------------

    def describe(self) -> str:
        """The per-stage split as a text table."""
        raise NotImplementedError

    def memory_summary(self) -> str:
        """Metered bytes per stage now and at peak, by kind."""
        raise NotImplementedError


def device_memory(device: torch.device) -> int:
    """The bytes of ``device`` this process's tensors can use: on a GPU, what is free now plus
    what this process's allocator already holds (its model's tensors among them), not what
    other processes or the CUDA context take; for the CPU, the host's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_buffer_writes(captured: Captured, module: nn.Module, chunks: int) -> None:
    """Refuse a ``forward`` that writes a buffer in place (a call counter, an EMA of
    activations) when it runs once per micro-batch: the buffer would be updated ``chunks``
    times a step, not once as on one device. BatchNorm's running statistics have their own
    answer (``deferred_batch_norm``) and are left to it.

    Raises:
        ValueError: naming each buffer, where forward writes it, and the fix.
    """
    if chunks == 1:
        return
    norms = {name for name, m in module.named_modules() if isinstance(m, BatchNormBase)}
    writes = {b: where for b, where in buffer_writes(captured).items() if b.rpartition(".")[0] not in norms}
    if writes:
        named = "; ".join(f"{buffer!r} ({where})" for buffer, where in writes.items())
        raise ValueError(
            f"forward writes the buffer {named} in place. The pipeline runs forward once per micro-batch, so with "
            f"chunks={chunks} it would be updated {chunks} times a step, unlike training on one device. Update it "
            f"in training_step (after self(...), from what forward returns) or a callback (on_train_batch_end), "
            f"or train with chunks=1."
        )


def policies_of(captured: Captured, plan: Plan) -> dict[str, Policy]:
    """The plan's recompute and swap choices by node name."""
    return {n.name: cast(Policy, p) for n, p in zip(captured.nodes, plan.policies) if p != "keep"}


def check_follows(plan: Plan, captured: Captured, precision: str) -> None:
    """That a saved ``plan`` was made for this graph (the same nodes in the same order) and
    this Trainer ``precision`` (its bytes are that precision's).

    Raises:
        ValueError: naming the first node that differs, a plan that names none, or the
            precisions.
    """
    if plan.precision != precision:
        raise ValueError(f"the plan was made for precision {plan.precision!r}, this Trainer trains in {precision!r}: "
                         f"give Trainer(precision={plan.precision!r}), or plan again with lightning-pipe plan "
                         f"--precision {precision} --out.")
    names = [n.name for n in captured.nodes]
    if not plan.nodes:
        raise ValueError("the plan names no graph nodes (a plan.json from an older lightning_pipe): plan again with "
                         "lightning-pipe plan --out, or train without plan= to plan at the first batch.")
    if plan.nodes == names:
        return
    at = next((k for k, (a, b) in enumerate(zip(plan.nodes, names)) if a != b), min(len(names), len(plan.nodes)))
    theirs = plan.nodes[at] if at < len(plan.nodes) else "nothing"
    ours = names[at] if at < len(names) else "nothing"
    raise ValueError(
        f"the plan was made for another graph: {len(plan.nodes)} nodes, this model's {len(names)}; node {at} is "
        f"{theirs!r} in the plan and {ours!r} here. Plan this model again (lightning-pipe plan --out), or train "
        f"without plan=."
    )


def check_microbatch(plan: Plan, shapes: Shapes) -> None:
    """That a training batch's micro-batches are at most the size a saved ``plan`` was made
    for: its predictions hold for that size, and it is never planned again.

    Raises:
        ValueError: naming the batch, the plan's size and the fix.
    """
    batch = max((shape[0] for shape in shapes.values() if shape), default=0)
    microbatch = -(-batch // plan.chunks)
    if microbatch > plan.microbatch_size:
        raise ValueError(
            f"a training batch of {batch} samples makes micro-batches of {microbatch} in {plan.chunks} chunks, but "
            f"the plan was made for micro-batches of {plan.microbatch_size}: give batches of at most "
            f"{plan.microbatch_size * plan.chunks} samples, or plan for this size (lightning-pipe plan --out)."
        )


def state_to_param_devices(optimizer: Optimizer) -> None:
    """Move each optimizer state tensor to its parameter's device (Lightning moves all of
    them to the root device); ``step`` counters stay where the optimizer keeps them."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if key != "step" and isinstance(value, Tensor):
                state[key] = value.to(param.device)
