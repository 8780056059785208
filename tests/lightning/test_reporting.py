"""What the strategy reports: plan files at setup and per-stage metrics in the loggers."""

import csv
import io
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from rich.console import Console

from examples.models import loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.plan import report
from lightning_pipe.plan.memory import StagePeak
from lightning_pipe.plan.plan import Plan, StageReport
from tests.helpers import trainer
from tests.models import make


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_metrics_reach_a_csv_logger_with_plausible_values(tmp_path, schedule):
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, schedule=schedule, measure_memory=True)
    t = trainer(strategy, 2, max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=2)
    t.fit(model, loader(data, 8))
    with open(t.logger.log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("pipe/step_ms")]
    assert len(logged) == 2  # steps 2 and 4
    for row in logged:
        assert 0 < float(row["pipe/step_ms"]) < 60_000
        assert 0 <= float(row["pipe/bubble_fraction"]) < 1
        for s in range(2):
            assert float(row[f"pipe/stage{s}/forward_ms"]) > 0
            assert float(row[f"pipe/stage{s}/backward_ms"]) > 0
            peak = float(row[f"pipe/stage{s}/peak_bytes"])
            assert 0 < float(row[f"pipe/stage{s}/activation_bytes"]) < peak
            predicted = float(row[f"pipe/stage{s}/predicted_peak_bytes"])
            assert 0.5 < predicted / peak < 2  # the plan's formula against the meter


@pytest.mark.cuda
def test_the_cuda_allocators_peak_is_logged_beside_the_meters(tmp_path):
    """On a GPU the loggers also get ``torch.cuda.max_memory_allocated``: at least the metered
    peak (the allocator rounds every block up and sees what no stage is charged)."""
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, schedule="1f1b", measure_memory=True)
    t = Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=2, logger=CSVLogger(tmp_path),
                log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False)
    t.fit(model, loader(data, 8))
    with open(t.logger.log_dir + "/metrics.csv") as f:
        row = [r for r in csv.DictReader(f) if r.get("pipe/step_ms")][-1]
    assert float(row["pipe/stage0/cuda_peak_bytes"]) >= float(row["pipe/stage0/peak_bytes"]) > 0


def test_plan_report_written_to_the_log_dir(tmp_path, capsys):
    model, data = make("unet")
    strategy = MemoryPipeStrategy(chunks=2, memory_limit="256MiB")
    t = trainer(strategy, 2, max_steps=1, logger=CSVLogger(tmp_path))
    t.fit(model, loader(data, 8))
    with open(t.logger.log_dir + "/plan.json") as f:
        saved = json.load(f)
    plan = Plan.from_json(json.dumps(saved))
    assert plan == strategy.plan and sum(plan.balance) == sum(len(s.node_names) for s in strategy.engine.program.stages)
    # The JSON names what the planner fitted each stage into: the limit, which a plan this far below needs no check for
    assert saved["targets"] == [256 * 2**20] * 2 and "capacities" not in saved
    with open(t.logger.log_dir + "/plan.png", "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "lightning_pipe plan: dawnpiper, gpipe" in out and "256.0MiB" in out
    assert "target: the memory limit, less the memory model's error" in " ".join(out.split())
    assert saved["partitioner"] == "dawnpiper"


@pytest.mark.slow
def test_after_training_the_plot_shows_each_stages_metered_peak_beside_its_prediction(tmp_path):
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, schedule="1f1b", measure_memory=True)
    t = trainer(strategy, 2, max_steps=2, logger=CSVLogger(tmp_path))
    t.fit(model, loader(data, 8))
    metered = strategy.meter.peaks()

    def drawn(*peaks):
        out = io.BytesIO()
        report.figure(strategy.plan, *peaks).savefig(out, format="png", dpi=100)
        return out.getvalue()

    saved = (Path(t.logger.log_dir) / "plan.png").read_bytes()
    assert saved == drawn(metered) != drawn()  # written again at the end, with the metered peaks
    ax, labels, _ = _memory_plot(strategy.plan, metered)
    assert "metered peak" in labels and ax.get_title() == "predicted and metered peak memory per stage"
    (marks,) = [line for line in ax.get_lines() if line.get_label() == "metered peak"]
    scale = 2**10 if ax.get_ylabel() == "KiB" else 2**20
    assert list(marks.get_ydata()) == pytest.approx([m / scale for m in metered])
    assert all(m > 0 for m in metered)
    with pytest.raises(ValueError, match="1 metered peaks given for a plan of 2 stages"):
        report.figure(strategy.plan, metered[:1])


def _plan(peaks: list[int], targets: list[int]) -> Plan:
    """A plan with these stage peaks (bytes, split over the kinds) and planning targets."""
    stages = [StageReport(k, k + 1, p // 4, StagePeak(p // 4, p // 2, p // 8, p - p // 4 - p // 2 - p // 8),
                          1.0, 2.0, 0.5, 0.0, 0, 0) for k, p in enumerate(peaks)]
    return Plan("dawnpiper", "1f1b", targets, 2, 4, None, [1] * len(peaks), ["keep"] * len(peaks), stages, 20.0, 0.3)


def _memory_plot(plan: Plan, metered: list[int] | None = None):
    fig = report.figure(plan, metered or ())
    fig.draw_without_rendering()
    ax = fig.axes[0]
    legend = ax.get_legend()
    below = legend.get_window_extent().y1 <= ax.get_window_extent().y0
    return ax, [t.get_text() for t in legend.get_texts()], below


def test_plot_scales_the_memory_axis_to_the_bars_and_notes_a_target_far_above_them():
    plan = _plan([900 * 2**10, 700 * 2**10, 500 * 2**10], [int(6 * 2**30 * 0.9)] * 3)
    ax, labels, below = _memory_plot(plan)
    assert ax.get_ylabel() == "KiB"
    assert 900 < ax.get_ylim()[1] < 1200  # the bars fill the axis; 5.4 GiB would flatten them
    assert "planning target (\u25b2 off scale: 5.4GiB)" in labels and below


def test_plot_draws_a_target_near_the_bars_on_the_axis():
    plan = _plan([60 * 2**20, 50 * 2**20], [64 * 2**20, 96 * 2**20])
    ax, labels, below = _memory_plot(plan)
    assert ax.get_ylabel() == "MiB" and ax.get_ylim()[1] >= 96
    assert "planning target" in labels and not any("off scale" in label for label in labels) and below
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0\n60.0MiB", "1\n50.0MiB"]


def test_stages_sharing_a_process_are_drawn_against_its_target():
    plan = _plan([60 * 2**20, 50 * 2**20, 40 * 2**20, 30 * 2**20], [100 * 2**20, 80 * 2**20])
    plan.placement, plan.virtual_stages = [0, 1, 1, 0], 2  # a V over two processes
    ax, _, _ = _memory_plot(plan)
    (step,) = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert list(step.get_ydata()) == [100, 80, 80, 100, 100]


# That importing lightning_pipe and saving a plan picks no matplotlib backend and leaves no
# figures: tests/test_package.py, in the one fresh process it starts for such checks.


def test_the_plan_table_fits_a_terminal_of_100_columns():
    """Every column whole (no cell cut short with an ellipsis) at 100 columns, even for large
    figures; every term of the peak is in plan.json and the plot."""
    big = _plan([37 * 2**30 + 123_456_789, 35 * 2**30], [40 * 2**30, 40 * 2**30])
    console = Console(width=100, file=io.StringIO(), color_system=None)
    console.print(report.table(big, [torch.device("cuda", 0), torch.device("cuda", 1)]))
    text = console.file.getvalue()
    assert "\u2026" not in text and max(map(len, text.splitlines())) <= 100
    assert "37.1GiB" in text and "cuda:1" in text and "40.0GiB" in text
    assert max(map(len, big.table().splitlines()[:-1])) <= 100
