"""MemoryPipeStrategy(runtime="distributed"): Lightning's launcher starts a process per device
(gloo on CPU); after 3 optimizer steps on the same global batches the parameters equal
single-device training, for pp=2, pp=4 and pp=2 x dp=2, GPipe and 1F1B."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DistributedSampler, default_collate

from examples.models import loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.lightning.distributed import DistributedPipeStrategy
from tests.lightning.distributed_fit import BATCH, features_trainer
from tests.models import FAMILIES, make

ROOT = Path(__file__).parents[2]
SCRIPT = Path(__file__).with_name("distributed_fit.py")
STEPS = 3
SCHEDULES = ("gpipe", "1f1b")


def _launch(out: Path, devices: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), str(out), str(devices), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _reference(family: str, replicas: int) -> dict[str, torch.Tensor]:
    """Single-device training on the global batches the replicas see together: Lightning's
    distributed sampler shuffles training data (seed 0) and deals it out by replica."""
    model, data = make(family)
    optimizer = model.configure_optimizers()
    share = BATCH // replicas
    orders = [list(DistributedSampler(data, replicas, r, shuffle=True, seed=0)) for r in range(replicas)]
    for k in range(STEPS):
        batch = default_collate([data[i] for order in orders for i in order[k * share : (k + 1) * share]])
        optimizer.zero_grad()
        model.loss(batch).backward()
        optimizer.step()
    return model.state_dict()


def _check(out: Path, devices: int, stages: int) -> None:
    for family in FAMILIES:
        expected = _reference(family, devices // stages)
        for schedule in SCHEDULES:
            name = f"{family}-{schedule}-{stages}"
            state = torch.load(out / f"{name}.ckpt", weights_only=False)["state_dict"]
            assert list(state) == list(expected), name  # the plain module's keys
            for key, value in expected.items():
                torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
            ranks = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(devices)]
            assert all(r["mesh"] == [stages, devices // stages] for r in ranks)
            assert all("train_loss" in r["logged"] for r in ranks), name  # logged on every rank
            for r in range(devices):  # the ranks of one pipeline log the same (its last stage's) values
                assert ranks[r]["logged"] == ranks[r % (devices // stages)]["logged"], name
            model, _ = make(family)
            model.load_state_dict(state)  # loads into the plain LightningModule


def _configs(stages: int) -> list[str]:
    """Every family and schedule; GPT under 1F1B is planned and logs metered per-stage metrics."""
    configs = [f"{family}:{schedule}:{stages}" for family in FAMILIES for schedule in SCHEDULES]
    return [c + ":metered" if c.startswith("gpt:1f1b") else c for c in configs]


def _check_metrics(out: Path, stages: int) -> None:
    """Global rank 0 logged every stage's metered peak, planned peak and times under the local
    runtime's names."""
    (csv,) = (out / f"gpt-1f1b-{stages}").rglob("metrics.csv")
    header = csv.read_text().splitlines()[0].split(",")
    for s in range(stages):
        for key in ("forward_ms", "backward_ms", "peak_bytes", "activation_bytes", "predicted_peak_bytes"):
            assert f"pipe/stage{s}/{key}" in header
    assert "pipe/step_ms" in header and "pipe/bubble_fraction" in header


@pytest.mark.slow
def test_pp2_equals_single_device(tmp_path):
    result = _launch(tmp_path, 2, str(STEPS), *_configs(2))
    assert result.returncode == 0, result.stderr[-3000:]
    _check(tmp_path, 2, 2)
    _check_metrics(tmp_path, 2)


@pytest.mark.slow
def test_pp4_and_pp2_dp2_equal_single_device(tmp_path):
    result = _launch(tmp_path, 4, str(STEPS), *_configs(4), *_configs(2))
    assert result.returncode == 0, result.stderr[-3000:]
    _check(tmp_path, 4, 4)
    _check(tmp_path, 4, 2)
    _check_metrics(tmp_path, 4)


@pytest.mark.slow
def test_an_error_on_one_rank_ends_every_rank(tmp_path):
    start = time.perf_counter()
    result = _launch(tmp_path, 2, "raise", timeout=120)
    assert result.returncode != 0
    assert "rank 1 fails on purpose" in result.stderr
    assert time.perf_counter() - start < 90


def test_runtime_distributed_builds_the_distributed_strategy():
    strategy = MemoryPipeStrategy(runtime="distributed", stages=2, schedule="1f1b")
    assert isinstance(strategy, DistributedPipeStrategy) and strategy.stages == 2
    assert type(MemoryPipeStrategy()) is MemoryPipeStrategy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"runtime": "distributed", "schedule": "2bw"}, "2bw"),
        ({"stages": 2}, "runtime='distributed'"),
        ({"runtime": "distributed", "stages": 0}, "positive"),
        ({"runtime": "mpi"}, "runtime must be"),
    ],
)
def test_bad_runtime_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemoryPipeStrategy(**kwargs)


@pytest.mark.slow
def test_accumulation_clipping_evaluation_and_resume_equal_single_device(tmp_path):
    result = _launch(tmp_path, 2, "features")
    assert result.returncode == 0, result.stderr[-3000:]
    model, data = make("gpt")
    trainer = Trainer(**features_trainer(tmp_path, None, steps=4))
    trainer.fit(model, loader(data, BATCH), loader(data, BATCH))
    expected = {"val": trainer.validate(model, loader(data, BATCH))[0]["val_loss"],
                "test": trainer.test(model, loader(data, BATCH))[0]["test_loss"],
                "predictions": [p.sum().item() for p in trainer.predict(model, loader(data, BATCH))],
                "best": trainer.checkpoint_callback.best_model_score.item()}
    state = torch.load(tmp_path / "features.ckpt", weights_only=False)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for rank in range(2):  # every rank returns what the single-device run returns
        got = json.loads((tmp_path / f"features-rank{rank}.json").read_text())
        assert got.keys() == expected.keys()
        for key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-4), key
    # the distributed checkpoint resumes a single-device run (weights and optimizer state) as
    # it resumed the distributed run
    fresh, _ = make("gpt", seed=1)
    Trainer(**features_trainer(tmp_path, None, steps=6)).fit(
        fresh, loader(data, BATCH), loader(data, BATCH), ckpt_path=tmp_path / "features.ckpt"
    )
    resumed = torch.load(tmp_path / "features-resumed.ckpt", weights_only=False)["state_dict"]
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(resumed[key], value, rtol=1e-5, atol=1e-6, msg=key)
