"""Predicted against metered per-stage peaks, worst over and under, per model x schedule x
memory optimisation, on the benchmark models.

    python -m benchmarks.accuracy [bert gpt t5 unet]

Each configuration trains two steps (the second is the steady one) with
``MemoryPipeStrategy(measure_memory=True)``: with memory to spare (every activation kept), and
under a per-stage limit of ``LIMIT`` times the largest metered stage peak of the unplanned
even GPipe split, planned with recompute and, given a host link, swap. Predicted: the plan's
``stages[s].peak.total``; metered: ``strategy.meter.peaks()``.
"""

import argparse
import logging

from benchmarks.models import suite
from benchmarks.run import CHUNKS, REFERENCE_MICROBATCH, STEPS, fit
from lightning_pipe.lightning.strategy import MemoryPipeStrategy
from lightning_pipe.measure.meter import StageOutOfMemoryError
from lightning_pipe.plan.plan import InfeasiblePlanError

STAGES, LIMIT, HOST_BANDWIDTH = 4, 0.6, 1e9


def errors(strategy: MemoryPipeStrategy) -> list[float]:
    """Per stage, (predicted - metered) / metered."""
    assert strategy.plan is not None and strategy.meter is not None
    return [(s.peak.total - m) / m for s, m in zip(strategy.plan.stages, strategy.meter.peaks())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["bert", "gpt", "t5", "unet"])
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    benches = suite()
    batch = REFERENCE_MICROBATCH * CHUNKS
    print(f"{'model':<6}{'schedule':<9}{'memopt':<10}{'over':>8}{'under':>8}  per stage")
    for name in args.models:
        bench = benches[name]
        even = MemoryPipeStrategy(chunks=CHUNKS, planner=None, measure_memory=True)
        fit(bench.model(), bench.data(batch * STEPS), batch, even, STAGES, STEPS)
        limit = int(LIMIT * max(even.meter.peaks()))
        for schedule in ("gpipe", "1f1b", "2bw"):
            for memopt, kwargs in (("off", {}), ("recompute", {"memory_limit": limit}),
                                   ("swap", {"memory_limit": limit, "host_bandwidth": HOST_BANDWIDTH})):
                strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, measure_memory=True, **kwargs)
                try:
                    fit(bench.model(), bench.data(batch * STEPS), batch, strategy, STAGES, STEPS)
                except (InfeasiblePlanError, StageOutOfMemoryError) as error:
                    print(f"{name:<6}{schedule:<9}{memopt:<10}  {type(error).__name__}")
                    continue
                e = errors(strategy)
                print(f"{name:<6}{schedule:<9}{memopt:<10}{max(0.0, max(e)):>8.1%}{max(0.0, -min(e)):>8.1%}  "
                      + " ".join(f"{x:+.1%}" for x in e), flush=True)


if __name__ == "__main__":
    main()
