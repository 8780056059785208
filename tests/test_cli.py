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
