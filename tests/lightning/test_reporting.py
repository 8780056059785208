"""What the strategy reports: plan files at setup and per-stage metrics in the loggers."""

import csv
import json

import pytest
from lightning.pytorch.loggers import CSVLogger

from examples.models import loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.plan.plan import Plan
from tests.helpers import trainer
from tests.models import make


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_metrics_reach_a_csv_logger_with_plausible_values(tmp_path, schedule):
    model, data = make("gpt")
    strategy = MemoryPipeStrategy(chunks=2, schedule=schedule, measure_memory=True)
    t = trainer(strategy, 2, max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=2)
    t.fit(model, loader(data, 8))
    rows = list(csv.DictReader(open(t.logger.log_dir + "/metrics.csv")))
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


def test_plan_report_written_to_the_log_dir(tmp_path, capsys):
    model, data = make("unet")
    strategy = MemoryPipeStrategy(chunks=2)
    t = trainer(strategy, 2, max_steps=1, logger=CSVLogger(tmp_path))
    t.fit(model, loader(data, 8))
    plan = Plan.from_json(open(t.logger.log_dir + "/plan.json").read())
    assert plan == strategy.plan and sum(plan.balance) == sum(len(s.node_names) for s in strategy.program.stages)
    with open(t.logger.log_dir + "/plan.png", "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "lightning_pipe plan: dawnpiper, gpipe" in capsys.readouterr().out
    assert json.loads(plan.to_json())["partitioner"] == "dawnpiper"
