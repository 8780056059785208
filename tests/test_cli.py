import pytest

from lightning_pipe import MemoryPipeStrategy


@pytest.fixture
def cli_main(monkeypatch):
    monkeypatch.syspath_prepend("examples")
    from examples.cli import main

    return main


def test_fit_from_yaml_builds_the_strategy_from_its_typed_arguments(cli_main, tmp_path):
    cli = cli_main(["fit", "--config", "examples/configs/gpt.yaml", "--trainer.strategy.chunks=2",
                    f"--trainer.default_root_dir={tmp_path}"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MemoryPipeStrategy)
    assert (strategy.chunks, strategy.schedule, strategy.measure_memory) == (2, "1f1b", True)
    assert cli.trainer.global_step == 4 and len(strategy.program.stages) == 4


def test_unet_config_runs(cli_main, tmp_path):
    cli = cli_main(["fit", "--config", "examples/configs/unet.yaml", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 4 and cli.trainer.strategy.schedule == "gpipe"


@pytest.mark.parametrize("flag, message", [
    ("--trainer.strategy.schedule=bogus", "Expected a typing.Literal"),
    ("--trainer.strategy.chunks=many", "chunks"),
])
def test_bad_strategy_arguments_are_rejected_by_type(cli_main, capsys, tmp_path, flag, message):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", "examples/configs/unet.yaml", flag, f"--trainer.default_root_dir={tmp_path}"])
    assert message in capsys.readouterr().err


def test_lightning_pipe_plan_prints_every_partitioner_with_its_max_microbatch(capsys):
    from lightning_pipe.cli import main

    assert main(["plan", "--model", "examples.models.UNet", "--init-args", '{"channels": 8}',
                 "--input", "image=float32[8,3,32,32]", "--devices", "2x64MiB", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("dawnpiper", "capslog", "time", "params", "uniform"):
        assert f"== {name}: largest micro-batch that fits: " in out
    largest = {line.split()[1].rstrip(":"): int(line.split()[-1]) for line in out.splitlines() if line.startswith("== ")}
    assert set(largest) == {"dawnpiper", "capslog", "time", "params", "uniform"}
    assert min(largest.values()) > 4  # 64 MiB per stage holds far more than the 4 samples profiled


def test_lightning_pipe_plan_reads_a_lightningcli_config(capsys):
    from lightning_pipe.cli import main

    assert main(["plan", "--config", "examples/configs/gpt.yaml", "--input", "batch.input_ids=int64[8,16]",
                 "--devices", "16MiB,16MiB,8MiB,8MiB", "--schedule", "gpipe"]) == 0
    assert "4 stages, gpipe" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--model", "examples.models.Nope", "--devices", "2x1GiB"], "cannot import 'examples.models.Nope'"),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "2 x lots"],
     "Cannot read 'lots' as a memory size"),
    (["--model", "examples.models.UNet", "--input", "image=complex[8]", "--devices", "2x1GiB"], "cannot read --input"),
    (["--model", "examples.models.UNet", "--devices", "2x1GiB"], "give the batch with --input"),
])
def test_lightning_pipe_plan_bad_input_exits_2_with_a_message(capsys, argv, message):
    from lightning_pipe.cli import main

    with pytest.raises(SystemExit) as info:
        main(["plan", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
