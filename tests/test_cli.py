import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.plan import Plan
from lightning_pipe.units import parse_bytes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cli_main():
    from examples.cli import main

    return main


@pytest.mark.slow
def test_fit_from_yaml_builds_the_strategy_from_its_typed_arguments(cli_main, tmp_path):
    cli = cli_main(["fit", "--config", "examples/configs/gpt.yaml", "--trainer.strategy.chunks=2",
                    f"--trainer.default_root_dir={tmp_path}"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MemoryPipeStrategy)
    assert (strategy.options.chunks, strategy.options.schedule, strategy.options.measure_memory) == (2, "1f1b", True)
    assert strategy.options.memory_limit == [64 * 2**20]
    assert cli.trainer.global_step == 4 and len(strategy.engine.program.stages) == 4


def test_unet_config_runs_and_ends_with_its_outcome(cli_main, tmp_path):
    from examples.cli import outcome

    cli = cli_main(["fit", "--config", "examples/configs/unet.yaml", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 4 and cli.trainer.strategy.options.schedule == "gpipe"
    loss = float(cli.trainer.callback_metrics["train_loss"])
    assert outcome(cli).splitlines() == [
        f"4 steps; train_loss {loss:.4f}, val_loss {float(cli.trainer.callback_metrics['val_loss']):.4f}",
        "no logger: the plan was printed above, no files written (set trainer.logger to keep them)",
        f"config: {tmp_path}/config.yaml",
    ]


@pytest.mark.slow
def test_example_cli_keeps_its_config_out_of_the_working_directory_and_runs_twice(cli_main, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        cli = cli_main(["fit", "--config", str(ROOT / "examples/configs/unet.yaml"), "--trainer.max_steps=1"])
        assert cli.trainer.global_step == 1
    assert [p.name for p in tmp_path.iterdir()] == ["lightning_logs"]
    assert (tmp_path / "lightning_logs" / "cli" / "config.yaml").read_text().count("examples.models.UNet") == 1


def test_a_config_with_schedule_auto_builds_the_distributed_strategy(tmp_path):
    """LightningCLI takes ``schedule: auto`` (a value of the annotation's one Literal); the
    training it builds is the distributed launch's (tests/lightning/test_distributed.py)."""
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(args=["--config", "examples/configs/gpt.yaml", "--trainer.strategy.schedule=auto",
                             "--trainer.strategy.runtime=distributed", f"--trainer.default_root_dir={tmp_path}"],
                       run=False)
    options = cli.trainer.strategy.options
    assert (options.schedule, options.runtime, options.memory_limit) == ("auto", "distributed", [64 * 2**20])


@pytest.mark.parametrize("flag, message", [
    ("--trainer.strategy.schedule=bogus", "Expected a typing.Literal"),
    ("--trainer.strategy.chunks=many", "chunks"),
])
def test_bad_strategy_arguments_are_rejected_by_type(cli_main, capsys, tmp_path, flag, message):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", "examples/configs/unet.yaml", flag, f"--trainer.default_root_dir={tmp_path}"])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    ({"chunks": "4"}, "chunks must be int, got '4' of type str."),
    ({"chunks": True}, "chunks must be int, got True of type bool."),
    ({"host_bandwidth": "1e9"}, "host_bandwidth must be float or None, got '1e9' of type str."),
    ({"measure_memory": "yes"}, "measure_memory must be bool, got 'yes' of type str."),
])
def test_strategy_arguments_of_the_wrong_type_are_named(kwargs, message):
    with pytest.raises(TypeError) as err:
        MemoryPipeStrategy(**kwargs)
    assert str(err.value) == message


def test_strategy_takes_an_int_host_bandwidth():
    assert MemoryPipeStrategy(host_bandwidth=10**9).options.host_bandwidth == 10**9


def default_schedule() -> str:
    return inspect.signature(MemoryPipeStrategy).parameters["schedule"].default


def _largest(out):
    return {m[1]: int(m[2]) for m in re.finditer(r"^== (\w+): largest micro-batch that fits: (\d+)", out, re.M)}


@pytest.mark.slow
def test_lightning_pipe_plan_prints_every_partitioner_with_its_max_microbatch(capsys, tmp_path):
    from lightning_pipe.cli import main

    assert main(["plan", "--model", "examples.models.UNet", "--init-args", '{"channels": 8}',
                 "--input", "image=float32[8,3,32,32]", "--devices", "2x64MiB", "--chunks", "2",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("dawnpiper", "capslog", "time", "params", "uniform"):
        assert f"== {name}: largest micro-batch that fits: " in out
    largest = _largest(out)
    assert set(largest) == {"dawnpiper", "capslog", "time", "params", "uniform"}
    assert min(largest.values()) > 4  # 64 MiB per stage holds far more than the 4 samples profiled
    # the plan shown is the one at the largest micro-batch, not at the input's 4
    for name, size in largest.items():
        assert f"== {name}: largest micro-batch that fits: {size}; planned at it, not at the input's 4\n" in out
        assert f"{name}, {default_schedule()}, 2 micro-batches of {size}: step " in out
    # Planned as training plans: to the limit, each plan near it checked on fake tensors, with the strategy's
    # default schedule; a stage's target is the limit, or below it by the error a check measured.
    assert f"2 stages, {default_schedule()}, 2 micro-batches; memory limit 2 x 64.0MiB, each plan checked by a" in out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("stage"))
    assert head.split()[5] == "target" and "capacity" not in out
    table = [line for line in out.splitlines() if line.lstrip().startswith(("stage ", "0 ", "1 "))]
    assert max(map(len, table)) <= 100  # a terminal's width
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 10 and all(parse_bytes(row[5]) <= 64 * 2**20 for row in rows)
    # --out: the plans shown, each as the strategy writes its own
    for name, size in largest.items():
        saved = Plan.from_json((tmp_path / name / "plan.json").read_text())
        assert (saved.partitioner, saved.microbatch_size) == (name, size)
        assert (tmp_path / name / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_the_partitioners_plan_in_processes_of_their_own_and_print_the_same(capsys, monkeypatch, tmp_path):
    """Where profiling took long enough, each partitioner plans and checks in a process forked
    per CPU (two here), and the dry run prints what it prints planning all in one."""
    import lightning_pipe.cli as cli

    plan = cli.checked_largest_plan

    def spied(profile, request, check):  # each partitioner's process, where it plans
        (tmp_path / request.partitioner).write_text(str(os.getpid()))
        return plan(profile, request, check)

    monkeypatch.setattr(cli, "checked_largest_plan", spied)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    monkeypatch.setattr(cli, "PARTITIONERS", ("dawnpiper", "capslog", "time"))  # (three are enough, and quicker)
    args = ["plan", "--model", "examples.models.UNet", "--init-args", '{"channels": 4, "depth": 2}',
            "--input", "image=float32[8,3,16,16]", "--devices", "2xA100-40GB", "--memory-limit", "2MiB",
            "--chunks", "4"]
    printed, planners = {}, {}  # (a named GPU's times, estimated: the same every run)
    for forked in (False, True):
        monkeypatch.setattr(cli, "FORK_AFTER_S", 0.0 if forked else float("inf"))
        assert cli.main(args) == 0
        printed[forked] = capsys.readouterr().out
        planners[forked] = {int(f.read_text()) for f in tmp_path.iterdir()}
    assert planners[False] == {os.getpid()}
    assert len(planners[True]) == 2 and os.getpid() not in planners[True]
    assert printed[True] == printed[False] and "== dawnpiper: largest micro-batch that fits" in printed[True]


@pytest.mark.slow
def test_lightning_pipe_plan_shows_progress_on_stderr_only(capsys, monkeypatch):
    from lightning_pipe.cli import main

    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws the bar as on a terminal
    assert main(["plan", "--model", "examples.models.UNet", "--input", "image=float32[4,3,16,16]",
                 "--devices", "2x64MiB", "--chunks", "2"]) == 0
    captured = capsys.readouterr()
    assert "profiling nodes" in captured.err and "planning" in captured.err
    assert "profiling" not in captured.out and "\x1b" not in captured.out
    assert captured.out.startswith("profiled ") and len(_largest(captured.out)) == 5


@pytest.mark.slow
def test_lightning_pipe_plan_reads_a_lightningcli_config_from_the_repository_root():
    """The installed command in a fresh process, so no earlier import of the example models
    helps it; no --devices, --chunks or --schedule: they come from the config's trainer and
    strategy sections."""
    out = subprocess.run(
        [Path(sys.executable).parent / "lightning-pipe", "plan", "--config", "examples/configs/gpt.yaml",
         "--input", "batch.input_ids=int64[8,16]"],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""}, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "4 stages, 1f1b, 4 micro-batches; memory limit 4 x 64.0MiB, each plan checked" in out.stdout


@pytest.mark.slow
def test_lightning_pipe_plan_command_line_overrides_the_config(capsys):
    from lightning_pipe.cli import main

    assert main(["plan", "--config", "examples/configs/gpt.yaml", "--input", "batch.input_ids=int64[8,16]",
                 "--devices", "16MiB,16MiB,8MiB,8MiB", "--schedule", "gpipe", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 stages, gpipe, 2 micro-batches; memory limit 16.0MiB, 16.0MiB, 8.0MiB, 8.0MiB" in out
    assert "(training_step on the config's data module)" in out  # data.class_path gives the training batch


def test_a_config_whose_data_module_gives_no_batch_is_named(tmp_path, capsys):
    from lightning_pipe.cli import main

    config = (ROOT / "examples/configs/gpt.yaml").read_text().replace("family: gpt", "family: words")
    (tmp_path / "bad.yaml").write_text(config)
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--config", str(tmp_path / "bad.yaml"), "--input", "batch.input_ids=int64[8,16]"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "bad.yaml's data module examples.models.SyntheticData gives no training batch: ValueError: family must be" \
           in err and "Check data.init_args, or give the batch with --batch." in err


@pytest.mark.slow
def test_lightning_pipe_plan_captures_with_torch_export_what_fx_cannot_trace(capsys):
    """Hugging Face GPT-2 (the example's LightningModule, ``forward(**batch)``): torch.fx
    cannot trace it, so the sample micro-batch goes to torch.export."""
    pytest.importorskip("transformers")
    from lightning_pipe.cli import main

    assert main(["plan", "--model", "examples.hf_gpt2.GPT2LM", "--init-args", '{"layers": 1, "dim": 32, "context": 16}',
                 "--input", "input_ids=int64[4,16]", "--input", "labels=int64[4,16]", "--devices", "2x64MiB",
                 "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("profiled ") and "nodes (torch.export) on cpu at micro-batch 2" in out.splitlines()[0]
    assert len(_largest(out)) == 5


@pytest.mark.slow
def test_lightning_pipe_plan_for_named_gpus_takes_their_memory_links_and_times(capsys):
    from lightning_pipe.cli import main

    unet = ["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--chunks", "2"]
    assert main(["plan", *unet, "--devices", "2xA100-40GB"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "on fake tensors, times for A100-40GB, at micro-batch 4" in first
    assert "memory limit 2 x 40.0GiB, each plan checked" in first
    assert "host link 32 GB/s, link between stages 300 GB/s; optimizer" in first
    assert main(["plan", *unet, "--devices", "2xh100-80gb", "--memory-limit", "20GiB", "--host-bandwidth", "1e9",
                 "--link-bandwidth", "2e9"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "times for H100-80GB" in first and "memory limit 2 x 20.0GiB" in first
    assert "host link 1 GB/s, link between stages 2 GB/s; optimizer" in first


def test_lightning_pipe_plan_for_named_gpus_runs_the_model_on_no_data(capsys):
    """Building the model, checking that it runs on the input, capturing, profiling and
    checking plans all run without data for a named GPU: a large model's initialisation and
    forward on the CPU cost minutes, and its weights gigabytes."""
    from lightning_pipe.cli import main
    from tests.models import CountsData

    for batch in ([], ["--batch", "x=float32[8,4]"]):  # the forward's check, or training_step's
        CountsData.with_data = 0
        assert main(["plan", "--model", "tests.models.CountsData", "--input", "x=float32[8,4]", *batch, "--devices",
                     "2xA100-40GB", "--chunks", "2"]) == 0
        assert "largest micro-batch that fits" in capsys.readouterr().out and CountsData.with_data == 0
        assert CountsData.built_on == "meta"  # its initialisation wrote no memory


@pytest.mark.parametrize("devices", ["2x64MiB", "2xA100-40GB"])
def test_a_model_with_lazy_parameters_is_checked_on_its_input_with_data(capsys, devices):
    """Its first forward makes its lazy parameters: on fake tensors they would stay fake."""
    from lightning_pipe.cli import main

    assert main(["plan", "--model", "tests.models.Lazy", "--input", "x=float32[8,3]", "--devices", devices,
                 "--chunks", "2"]) == 0
    assert "largest micro-batch that fits" in capsys.readouterr().out


GPT = ["--model", "examples.models.GPT", "--devices", "4x1GiB"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "examples.models.Nope", "--devices", "2x1GiB"],
     "examples.models has no 'Nope'; give a class path such as examples.models.GPT."),
    (["--model", "examples.nope.GPT", "--devices", "2x1GiB"],
     "cannot import 'examples.nope.GPT': there is no module 'examples.nope'"),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "2 x lots"],
     "unknown device 'lots' in '2 x lots': give one of V100-32GB, A100-40GB, A100-80GB, H100-80GB (e.g. "
     "8xA100-40GB), or a memory size per device such as 4x16GiB."),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "2xA100",
      "--chunks", "2"], "unknown device 'A100' in '2xA100'"),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "2x1GiB",
      "--memory-limit", "1GiB"], "--memory-limit goes with a named GPU"),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "0xA100-40GB"],
     "--devices '0xA100-40GB' has no stages"),
    (["--model", "examples.models.UNet", "--input", "image=complex[8]", "--devices", "2x1GiB"], "cannot read --input"),
    (["--model", "examples.models.UNet", "--devices", "2x1GiB"], "give the batch with --input"),
    (["--model", "examples.models.UNet", "--input", "img=float32[8,3,32,32]", "--devices", "2x1GiB"],
     "examples.models.UNet.forward has no argument 'img'; its arguments are image."),
    ([*GPT, "--input", "batch.ids=int64[8,16]"],
     "examples.models.GPT fails on a micro-batch of --input batch.ids=int64[8,16]: KeyError: 'input_ids'."),
    ([*GPT, "--input", "batch.input_ids=float32[8,16]"],
     "fails on a micro-batch of --input batch.input_ids=float32[8,16]: RuntimeError: Expected tensor for "
     "argument #1 'indices'"),
    ([*GPT, "--input", "batch.input_ids=int64[8,512]"],  # longer than the default context of 16
     "fails on a micro-batch of --input batch.input_ids=int64[8,512]: RuntimeError: The size of tensor a (512)"),
    ([*GPT, "--init-args", '{"nope": 1}', "--input", "batch.input_ids=int64[8,16]"],
     "examples.models.GPT does not take init args {'nope': 1}: got an unexpected keyword argument 'nope'. "
     "It takes: vocab, dim, heads, layers, context, lr, optimizer."),
    ([*GPT, "--init-args", "[1]", "--input", "batch.input_ids=int64[8,16]"], "--init-args must be a JSON object"),
    ([*GPT, "--input", "batch.input_ids=int64[8,16]", "--batch", "input_ids=int64[8,16]"],
     "examples.models.GPT.training_step fails on a micro-batch of --batch input_ids=int64[8,16]: KeyError: 'labels'."),
    ([*GPT, "--input", "batch.input_ids=int64[8,16]", "--batch", "input_ids=int64(8)"],
     "cannot read --batch 'input_ids=int64(8)': use NAME=DTYPE[SHAPE]"),
    (["--model", "tests.models.Untraceable", "--input", "x=float32[8,4]", "--batch", "x=float32[8,4]", "--devices",
      "2x1GiB"], "--batch goes with a LightningModule: tests.models.Untraceable has no training_step."),
    ([*GPT, "--config-json", "cfg.json", "--input", "batch.input_ids=int64[8,16]"],
     "--config-json goes with a transformers model class (one with a config_class, such as "
     "transformers.GPT2LMHeadModel); examples.models.GPT has none."),
    (["--model", "transformers.GPT2LMHeadModel", "--config-json", "no/such.json", "--devices", "2x1GiB"],
     "cannot read --config-json 'no/such.json': No such file or directory."),
    (["--config", "no/such.yaml", "--devices", "2x1GiB"], "cannot read --config 'no/such.yaml': No such file"),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "16"],
     "--devices '16': '16' has no unit"),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "2x16"],
     "--devices '2x16': '16' has no unit"),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]"], "give --devices"),
    (["--model", "tests.models.Untraceable", "--input", "x=float32[8,4]", "--devices", "2x1GiB"],
     "Neither torch.fx nor torch.export could capture Untraceable.forward; either fix works.\n"
     "torch.fx could not trace Untraceable.forward in submodule 'gate' (Gate)"),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "16MiB,16MiB,8MiB",
      "--search"], "--search regroups the GPUs into pipelines of any depth, so they must be alike: --devices gives "
                   "stages of 16.0MiB, 16.0MiB, 8.0MiB. Give COUNTxGPU or COUNTxSIZE, e.g. 32xA100-80GB."),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "4x1GiB", "--search",
      "--schedule", "2bw"], "--schedule 2bw runs only with runtime='local', one process without data-parallel "
                            "replicas; with --search give one of gpipe, 1f1b, or leave --schedule out"),
    (["--model", "examples.models.UNet", "--input", "image=float32[7,3,32,32]", "--devices", "4x1GiB", "--search",
      "--chunks", "2"], "chunks=2 divides no replica's batch (7 samples for widths 1): give a number of "
                        "micro-batches dividing one of them, or leave chunks out to search them."),
    ([*GPT, "--input", "batch.input_ids=int64[8,16]", "--search", "--batch", "input_ids=int64[8,16]"],
     "--batch goes without --search"),
    (["--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--devices", "4x1GiB", "--json",
      "c.json"], "--json goes with --search: it writes the configurations searched."),
])
def test_lightning_pipe_plan_bad_input_exits_2_with_a_message(capsys, argv, message):
    from lightning_pipe.cli import main

    with pytest.raises(SystemExit) as info:
        main(["plan", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_module_the_model_imports_that_is_not_installed_is_named(tmp_path, monkeypatch, capsys):
    from lightning_pipe.cli import main

    (tmp_path / "needs_hf.py").write_text("import transformers_not_here\n\nclass Model:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "needs_hf.Model", "--devices", "2x1GiB"])
    assert exit_.value.code == 2
    assert ("needs_hf imports 'transformers_not_here', which is not installed: pip install transformers_not_here."
            in capsys.readouterr().err)


@pytest.mark.slow
def test_a_hugging_face_model_plans_from_its_config_json_without_a_wrapper(tmp_path, capsys):
    pytest.importorskip("transformers")
    from lightning_pipe.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 16, "vocab_size": 64,
                                  "use_cache": False}))
    assert main(["plan", "--model", "transformers.GPT2LMHeadModel", "--config-json", str(config),
                 "--init-args", '{"n_layer": 2}', "--input", "input_ids=int64[4,16]", "--devices", "2x4MiB",
                 "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "nodes (torch.export) on cpu at micro-batch 2" in first  # GPT-2, traced by torch.export
    assert first.endswith("no optimizer state counted (the model configures no optimizer)")
    assert set(_largest(out)) == {"dawnpiper", "capslog", "time", "params", "uniform"}
    assert "blocks" not in out and int(re.search(r"profiled (\d+) nodes", first)[1]) > 120  # two layers (one: 95)


@pytest.mark.slow
def test_with_the_training_batch_each_check_runs_training_step_and_sees_its_loss(capsys):
    """The GPT's cross-entropy keeps logits-sized tensors on the last stage that the outputs'
    sum does not: checked with training_step, plans leave room for them."""
    from lightning_pipe.cli import main

    model = ["--model", "examples.models.GPT", "--init-args", '{"layers": 2, "dim": 32}',
             "--input", "batch.input_ids=int64[8,16]", "--devices", "2x1MiB", "--chunks", "4"]
    assert main(["plan", *model]) == 0
    summed = capsys.readouterr().out
    assert ("(loss not checked: the outputs' sum stands in; give --batch, or a config with a data module, to run "
            "training_step)") in summed
    assert main(["plan", *model, "--batch", "input_ids=int64[8,16]", "--batch", "labels=int64[8,16]"]) == 0
    stepped = capsys.readouterr().out
    assert "(training_step on --batch)" in stepped
    assert _largest(stepped)["dawnpiper"] < _largest(summed)["dawnpiper"]


def _spied_profiles(monkeypatch) -> list:
    """The profiles the CLI makes, in order."""
    import lightning_pipe.cli as cli

    profiles = []

    def spied(*args, **kwargs):
        profiles.append(profile_graph(*args, **kwargs))
        return profiles[-1]

    monkeypatch.setattr(cli, "profile_graph", spied)
    return profiles


@pytest.mark.slow
def test_a_bf16_mixed_dry_run_plans_smaller_activations_and_a_micro_batch_at_least_as_large(capsys, monkeypatch,
                                                                                             tmp_path):
    import lightning_pipe.cli as cli

    profiles = _spied_profiles(monkeypatch)
    monkeypatch.setattr(cli, "PARTITIONERS", ("dawnpiper",))  # one partitioner is enough, and quick
    model = ["plan", "--model", "examples.models.UNet", "--init-args", '{"channels": 4, "depth": 2}',
             "--input", "image=float32[8,3,16,16]", "--devices", "2x2MiB", "--chunks", "4"]
    largest = {}
    for precision in ("32-true", "bf16-mixed"):
        assert cli.main([*model, "--precision", precision, "--out", str(tmp_path / precision)]) == 0
        out = capsys.readouterr().out
        assert f"; precision {precision} (" in out.splitlines()[0]
        largest[precision] = _largest(out)["dawnpiper"]
        assert Plan.read(tmp_path / precision / "dawnpiper" / "plan.json").precision == precision  # as trained
    fp32, bf16 = (sum(n.saved_bytes for n in p.nodes) for p in profiles)
    # the convolutions' activations in bf16; CUDA's autocast runs group norm in fp32, and so the SiLU after it
    assert bf16 < 0.9 * fp32
    assert [n.param_bytes for n in profiles[0].nodes] == [n.param_bytes for n in profiles[1].nodes]  # fp32 weights
    assert largest["bf16-mixed"] >= largest["32-true"]


@pytest.mark.slow
def test_a_mixed_dry_run_casts_as_cudas_autocast_unless_the_config_trains_on_the_cpu(capsys, monkeypatch, tmp_path):
    import lightning_pipe.cli as cli

    profiles = _spied_profiles(monkeypatch)
    monkeypatch.setattr(cli, "PARTITIONERS", ("time",))  # one partitioner, the quickest: the profile is what differs
    gpt = ["plan", "--model", "examples.models.GPT", "--init-args", '{"layers": 1, "dim": 32}', "--input",
           "batch.input_ids=int64[8,16]", "--devices", "2x64MiB", "--precision", "bf16-mixed"]
    config = tmp_path / "cpu.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n")
    for args, autocast in ((gpt, "CUDA autocast to bfloat16"), ([*gpt, "--config", str(config)], "CPU autocast")):
        assert cli.main(args) == 0
        assert autocast in capsys.readouterr().out.splitlines()[0]
    cuda, cpu = ({n.name: n.saved_bytes for n in p.nodes} for p in profiles)
    # CUDA's policy runs softmax in float32: its output, which it saves, twice the CPU policy's bf16
    assert cuda["softmax"] == 2 * cpu["softmax"]
    assert cuda["blocks_0_attn_qkv"] == cpu["blocks_0_attn_qkv"]  # matrix products in bf16 under both
    assert sum(cuda.values()) > sum(cpu.values())


def test_the_search_profiles_under_the_precision(capsys, monkeypatch):
    import lightning_pipe.cli as cli

    profiles = _spied_profiles(monkeypatch)
    model = ["plan", "--model", "examples.models.UNet", "--init-args", '{"channels": 4, "depth": 2}',
             "--input", "image=float32[8,3,16,16]", "--devices", "2x2MiB", "--search", "--schedule", "1f1b"]
    for precision in ("32-true", "bf16-mixed"):
        assert cli.main([*model, "--precision", precision]) == 0
        assert f"; precision {precision} (" in capsys.readouterr().out.splitlines()[0]
    fp32, bf16 = (sum(n.saved_bytes for n in p.nodes) for p in profiles)
    assert bf16 < 0.9 * fp32  # (as above)


def test_the_precision_comes_from_the_config_and_an_unknown_one_exits_2(capsys, tmp_path):
    from lightning_pipe.cli import main

    gpt = ["plan", "--model", "examples.models.GPT", "--input", "batch.input_ids=int64[8,16]", "--devices", "2x1GiB"]
    with pytest.raises(SystemExit) as info:
        main([*gpt, "--precision", "bf16"])
    assert info.value.code == 2
    choices = "'32-true', 'bf16-mixed', '16-mixed', 'bf16-true'"
    assert f"argument --precision: invalid choice: 'bf16' (choose from {choices})" in capsys.readouterr().err
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  precision: 64-true\n")
    with pytest.raises(SystemExit) as info:
        main([*gpt, "--config", str(config)])
    assert info.value.code == 2
    assert ("trainer.precision in " + str(config) + " is '64-true', which a dry run cannot plan for: give --precision, "
            "one of 32-true, bf16-mixed, 16-mixed, bf16-true.") in capsys.readouterr().err
    from lightning_pipe.cli import PRECISIONS, resolve_precision

    assert resolve_precision(None, "bf16", "c.yaml") is PRECISIONS["bf16-mixed"]  # Lightning's older names
    assert resolve_precision(None, 32, "c.yaml") is PRECISIONS["32-true"]
    assert resolve_precision("bf16-true", "16-mixed", "c.yaml") is PRECISIONS["bf16-true"]  # the command line's first


def test_lightning_pipe_plan_search_ranks_the_configurations_of_a_cluster(capsys, tmp_path, monkeypatch):
    """--search on four GPUs: the top 10 of every depth x width, schedule and chunks for the
    --input batch as the global batch, the best's plan and how to train it, all of it as JSON;
    on a terminal a bar counts the configurations."""
    from lightning_pipe.cli import main

    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws the bar as on a terminal
    assert main(["plan", "--model", "examples.models.GPT", "--init-args", '{"layers": 2, "dim": 32}',
                 "--input", "batch.input_ids=int64[8,16]", "--devices", "4x64MiB", "--search",
                 "--json", str(tmp_path / "search.json"), "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "configurations" in captured.err and "\x1b" not in out
    head, *rows = [line for line in out.splitlines() if re.match(r"\s*(#|\d+)\s+(depth|\d+)\s", line)]
    assert head.split() == ["#", "depth", "width", "schedule", "chunks", "micro", "samples/s", "step", "ms",
                            "reduce", "ms", "fullest", "stage"]
    assert len(rows) == 10 and max(len(line) for line in [head, *rows]) <= 100
    rates = [float(row.split()[6]) for row in rows]
    assert rates == sorted(rates, reverse=True)
    assert all(int(row.split()[1]) * int(row.split()[2]) == 4 for row in rows)
    saved = json.loads((tmp_path / "search.json").read_text())
    configurations = saved["configurations"]
    assert len(configurations) >= 10 and configurations[0]["samples_per_second"] == pytest.approx(rates[0], abs=0.1)
    for entry in configurations:
        assert entry["depth"] * entry["width"] == 4
        assert entry["width"] * entry["chunks"] * entry["micro_batch"] == 8
        assert {"schedule", "samples_per_second", "step_ms"} <= set(entry)
        assert max(entry["stage_peaks"]) <= 64 * 2**20
    best = configurations[0]
    plan = Plan.read(tmp_path / "dawnpiper" / "plan.json")
    assert (len(plan.balance), plan.schedule, plan.chunks, plan.microbatch_size) == (
        best["depth"], best["schedule"], best["chunks"], best["micro_batch"])
    assert f"== best: depth {best['depth']} x width {best['width']}, {best['schedule']}" in out
    assert (f'MemoryPipeStrategy(runtime="distributed", stages={best["depth"]}, schedule="{best["schedule"]}", '
            f'chunks={best["chunks"]}, plan="{tmp_path}/dawnpiper/plan.json")') in out


def test_lightning_pipe_plan_search_where_nothing_fits_says_so_and_exits_1(capsys, tmp_path):
    from lightning_pipe.cli import main

    assert main(["plan", "--model", "examples.models.GPT", "--init-args", '{"layers": 2, "dim": 32}',
                 "--input", "batch.input_ids=int64[8,16]", "--devices", "4x64KiB", "--search", "--chunks", "2",
                 "--json", str(tmp_path / "search.json")]) == 1
    assert "no configuration fits: add GPUs or memory, or give a smaller global batch." in capsys.readouterr().out
    saved = json.loads((tmp_path / "search.json").read_text())
    assert saved["configurations"] == [] and saved["infeasible"] == saved["planned"] > 0


def test_lightning_pipe_plan_schedule_auto_prints_its_pick_and_the_runners_up(capsys):
    from lightning_pipe.cli import main

    assert main(["plan", "--model", "examples.models.UNet", "--input", "image=float32[8,3,32,32]", "--chunks", "4",
                 "--devices", "2xA100-40GB", "--schedule", "auto"]) == 0
    out = capsys.readouterr().out
    assert out.count('schedule="auto" weighed (fastest simulated step that fits, first):') == 5  # per partitioner
    assert all(f"  {name} x" in out for name in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv",
                                                 "dualpipev"))
