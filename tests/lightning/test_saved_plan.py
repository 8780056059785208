"""MemoryPipeStrategy(plan=...): train with the plan a dry run showed, exactly: its split and
per-node choices, no profiling, never planned again; a plan that does not belong is named."""

import functools
import json
from dataclasses import replace

import pytest
import torch

from examples.models import GPT, TokenDataset, UNet, loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.plan.plan import PLAN_FORMAT, Plan
from tests.helpers import max_rel_diff, trainer

CHUNKS, SCHEDULE = 4, "1f1b"


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(layers=2, dim=32)


@functools.cache
def _dry_run(out: str) -> Plan:
    """``lightning-pipe plan --out`` on two stages of 1 MiB: dawnpiper's plan at its largest
    micro-batch, with recompute (the model's 8 samples need far less)."""
    from lightning_pipe.cli import main

    assert main(["plan", "--model", "examples.models.GPT", "--init-args", '{"layers": 2, "dim": 32}',
                 "--input", "batch.input_ids=int64[8,16]", "--devices", "2x1MiB", "--chunks", str(CHUNKS),
                 "--schedule", SCHEDULE, "--out", out]) == 0
    return Plan.read(f"{out}/dawnpiper/plan.json")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dry_run")
    return out / "dawnpiper" / "plan.json", _dry_run(str(out))


@pytest.mark.slow
def test_training_with_the_dry_runs_plan_builds_its_split_and_choices_and_trains_as_one_device(dry_run):
    path, saved = dry_run
    assert "recompute" in saved.policies  # a plan that is more than a split
    batch = saved.microbatch_size * CHUNKS
    strategy = MemoryPipeStrategy(plan=str(path), chunks=CHUNKS, schedule=SCHEDULE, measure_memory=True)
    piped = _gpt()
    trainer(strategy, 2, max_steps=2).fit(piped, loader(TokenDataset(2 * batch), batch))
    reference = _gpt()
    trainer(max_steps=2).fit(reference, loader(TokenDataset(2 * batch), batch))

    assert strategy.plan == saved  # the same split and per-stage predictions, not a plan of its own
    assert strategy.engine.profile is None  # nothing was profiled
    stages = strategy.engine.program.stages
    assert [len(s.node_names) for s in stages] == saved.balance
    assert max_rel_diff(piped, reference) < 1e-5
    # its recompute choices were built: those stages hold less than the same split keeping everything
    recomputing = [s for s, r in enumerate(saved.stages) if r.recomputed_bytes]
    assert recomputing and all(any(seg.policy == "recompute" for seg in stages[s].segments) for s in recomputing)
    kept = MemoryPipeStrategy(balance=saved.balance, planner=None, chunks=CHUNKS, schedule=SCHEDULE,
                              measure_memory=True)
    trainer(kept, 2, max_steps=2).fit(_gpt(), loader(TokenDataset(2 * batch), batch))
    assert all(strategy.meter.peaks()[s] < kept.meter.peaks()[s] for s in recomputing)


@pytest.mark.slow
def test_a_plan_that_does_not_belong_is_named(dry_run, tmp_path):
    path, saved = dry_run
    strategy = MemoryPipeStrategy(plan=path, chunks=CHUNKS, schedule=SCHEDULE)
    with pytest.raises(ValueError, match=r"the plan was made for another graph: \d+ nodes, this model's \d+; node 0 "):
        trainer(strategy, 2, max_steps=1).fit(UNet(channels=8, depth=2), loader(_images(), 8))
    too_many = saved.microbatch_size * CHUNKS + CHUNKS
    strategy = MemoryPipeStrategy(plan=str(path), chunks=CHUNKS, schedule=SCHEDULE)
    with pytest.raises(ValueError, match=f"a training batch of {too_many} samples makes micro-batches of "
                                         f"{saved.microbatch_size + 1} in {CHUNKS} chunks, but the plan was made for "
                                         f"micro-batches of {saved.microbatch_size}"):
        trainer(strategy, 2, max_steps=1).fit(_gpt(), loader(TokenDataset(too_many), too_many))
    older = tmp_path / "older.json"
    older.write_text(replace(saved, nodes=[]).to_json())
    with pytest.raises(ValueError, match="the plan names no graph nodes"):
        trainer(MemoryPipeStrategy(plan=older, chunks=CHUNKS, schedule=SCHEDULE), 2, max_steps=1).fit(
            _gpt(), loader(TokenDataset(8), 8))
    bf16 = tmp_path / "bf16.json"  # its bytes are bf16's: the fp32 run would outgrow them
    bf16.write_text(replace(saved, precision="bf16-mixed").to_json())
    with pytest.raises(ValueError, match=r"the plan was made for precision 'bf16-mixed', this Trainer trains in "
                                         r"'32-true': give Trainer\(precision='bf16-mixed'\), or plan again with "
                                         r"lightning-pipe plan --precision 32-true --out."):
        trainer(MemoryPipeStrategy(plan=bf16, chunks=CHUNKS, schedule=SCHEDULE), 2, max_steps=1).fit(
            _gpt(), loader(TokenDataset(8), 8))


def _images():
    from examples.models import ImageDataset

    return ImageDataset(8, resolution=16)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"schedule": "gpipe"}, "the plan was made for schedule='1f1b', chunks=4, not schedule='gpipe', chunks=4: pass "
                            "schedule='1f1b', chunks=4 with it, or plan again."),
    ({"chunks": 2}, "the plan was made for schedule='1f1b', chunks=4, not schedule='1f1b', chunks=2"),
    ({"balance": [1, 1]}, "give plan or balance, not both"),
])
def test_settings_other_than_the_plans_are_named(kwargs, message, tmp_path):
    saved = tmp_path / "plan.json"
    saved.write_text(Plan("dawnpiper", "1f1b", [1 << 20] * 2, 2, 4, None, [1, 1], ["keep"] * 2, [], 1.0, 0.1,
                          nodes=["a", "b"]).to_json())
    with pytest.raises(ValueError) as error:
        MemoryPipeStrategy(plan=saved, **{"chunks": 4, "schedule": "1f1b", **kwargs})
    assert message in str(error.value)


def test_a_plan_of_interleaved_1f1b_is_followed_under_its_alias(tmp_path):
    saved = _written(tmp_path / "plan.json", Plan("dawnpiper", "interleaved-1f1b", [1 << 20] * 2, 2, 4, None,
                                                  [1] * 4, ["keep"] * 4, [], 1.0, 0.1, nodes=list("abcd")).to_json())
    options = MemoryPipeStrategy(plan=saved, chunks=4, schedule="1f1b", runtime="distributed", virtual_stages=2).options
    assert options.plan is not None and options.plan.schedule == "interleaved-1f1b"


def test_a_plan_auto_picked_is_followed_under_the_schedule_it_names(tmp_path):
    """A run under schedule="auto" saves its pick; following it names that schedule, and its
    stages per process where the schedule's own count is another."""
    saved = _written(tmp_path / "plan.json", Plan("dawnpiper", "interleaved-zb", [1 << 20] * 2, 2, 4, None, [1, 1],
                                                  ["keep"] * 2, [], 1.0, 0.1, nodes=["a", "b"],
                                                  virtual_stages=1).to_json())
    with pytest.raises(ValueError, match="the plan was made for schedule='interleaved-zb', chunks=4, virtual_stages=1, "
                                         "not schedule='auto', chunks=4: pass schedule='interleaved-zb', chunks=4, "
                                         "virtual_stages=1 with it"):
        MemoryPipeStrategy(plan=saved, chunks=4, schedule="auto", runtime="distributed")
    options = MemoryPipeStrategy(plan=saved, chunks=4, schedule="interleaved-zb", virtual_stages=1,
                                 runtime="distributed").options
    assert options.plan is not None and options.virtual_stages == 1


def test_a_file_that_is_not_a_plan_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"plan='.*missing.json' cannot be read \(No such file or directory\)"):
        MemoryPipeStrategy(plan=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"balance": [1]}')
    with pytest.raises(ValueError, match=r"plan='.*bad.json' is not a plan.json written by lightning_pipe"):
        MemoryPipeStrategy(plan=str(tmp_path / "bad.json"))
    plan = Plan("dawnpiper", "1f1b", [1 << 20] * 2, 2, 4, None, [1, 1], ["keep"] * 2, [], 1.0, 0.1, nodes=["a", "b"])
    assert Plan.read(_written(tmp_path / "plan.json", plan.to_json())) == plan
    for fields in ({"format": PLAN_FORMAT + 1}, {"format": None}):  # a later version's, one from before formats
        other = _written(tmp_path / "other.json", json.dumps({**json.loads(plan.to_json()), **fields}))
        with pytest.raises(ValueError, match=rf"plan='.*other.json' was written by another version of lightning_pipe "
                                             rf"\(plan format {fields['format']}; this one reads {PLAN_FORMAT}\): "
                                             rf"plan again with lightning-pipe plan --out."):
            MemoryPipeStrategy(plan=other)


def _written(path, text: str):
    path.write_text(text)
    return path


@pytest.mark.slow
def test_lightningcli_takes_the_plan_from_yaml(dry_run, tmp_path):
    from examples.cli import main

    path, saved = dry_run
    cli = main(["fit", "--config", "examples/configs/gpt.yaml", "--model.init_args.layers=2", "--trainer.devices=2",
                f"--trainer.strategy.init_args.plan={path}", "--trainer.max_steps=1",
                f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.strategy.plan == saved and cli.trainer.global_step == 1
