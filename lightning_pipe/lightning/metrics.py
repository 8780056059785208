"""Per-stage memory and time of one training step, as metrics for Lightning's loggers."""


from lightning.pytorch import Trainer

from lightning_pipe.lightning.internals import batches_that_stepped, should_update_logs
from lightning_pipe.measure.clock import StageClock
from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.plan.plan import Plan
from lightning_pipe.plan.schedule import Schedule, actions
from lightning_pipe.plan.simulate import StageTime, simulate

__all__ = ["log_step_metrics", "logs_this_step", "step_metrics"]


def step_metrics(
    clock: StageClock,
    meter: MemoryMeter | None,
    plan: Plan | None,
    schedule: Schedule,
    chunks: int,
    step_ms: float,
    cuda_peaks: list[int] | None = None,
) -> dict[str, float]:
    """Step time, per-stage forward/backward time, metered and predicted peaks (and the CUDA
    allocator's, ``cuda_peaks``, when each stage has a GPU of its own), and the bubble the
    measured stage times imply for the schedule."""
    stages = len(clock.forward_ms)
    metrics: dict[str, float] = {"pipe/step_ms": step_ms}
    for s in range(stages):
        metrics[f"pipe/stage{s}/forward_ms"] = clock.forward_ms[s]
        metrics[f"pipe/stage{s}/backward_ms"] = clock.backward_ms[s]
        if meter is not None:
            metrics[f"pipe/stage{s}/peak_bytes"] = meter.stages[s].peak
            metrics[f"pipe/stage{s}/activation_bytes"] = meter.stages[s].kind_peaks["activations"]
        if plan is not None:
            metrics[f"pipe/stage{s}/predicted_peak_bytes"] = plan.stages[s].peak.total
        if cuda_peaks is not None:
            metrics[f"pipe/stage{s}/cuda_peak_bytes"] = cuda_peaks[s]
    times = [StageTime(f / chunks, b / chunks) for f, b in zip(clock.forward_ms, clock.backward_ms)]
    metrics["pipe/bubble_fraction"] = simulate(times, actions(schedule, chunks, stages)).bubble
    return metrics


def logs_this_step(trainer: Trainer) -> bool:
    """Whether the Trainer's loggers take metrics at this step (``log_every_n_steps``): only
    then are the stage clocks read, which on CUDA waits for the device."""
    return bool(trainer.loggers) and should_update_logs(trainer)


def log_step_metrics(trainer: Trainer, metrics: dict[str, float]) -> None:
    """Send ``metrics`` to every logger."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=batches_that_stepped(trainer))
