"""Smoke tests of the benchmarks' smallest pieces, so ``benchmarks/run.py`` and
``benchmarks/hf_capture.py`` cannot silently rot."""

import functools
import json
import logging
from dataclasses import asdict, replace

import pytest
import torch

from benchmarks.models import Bench
from benchmarks.run import Config, memory_config, reference_capacity, sample_profile, search
from examples.models import GPT, TokenDataset
from lightning_pipe.plan.devices import DEVICES
from lightning_pipe.plan.request import PlanRequest


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(dim=32, layers=2, context=16)


@functools.cache
def _tiny_gpt2_workload():
    transformers = pytest.importorskip("transformers")
    from benchmarks import paper

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64, use_cache=False)
    return paper.Workload("gpt2", "tiny GPT-2", paper._hf(transformers.GPT2LMHeadModel, config), paper._tokens(16),
                          paper._keywords, paper._hf_loss)


def _tiny_gpt2_on_a_small_gpu():
    """The paper benchmark's module, a 1-layer GPT-2 workload built from its config, and an
    A100 with 16 MiB, so that the paper's pipeline runs in seconds (the benchmark profiles the
    workload once for this file's tests)."""
    tiny = _tiny_gpt2_workload()
    from benchmarks import paper

    return paper, tiny, replace(DEVICES["A100-40GB"], name="A100-16MiB", memory=16 * 2**20)


@pytest.mark.slow
def test_max_microbatch_search_trains_at_the_size_it_finds():
    assert search(lambda n: n <= 5, guess=1, limit=8) == (5, True)
    assert search(lambda n: n <= 5, guess=12, limit=8) == (5, True)
    assert search(lambda n: False, guess=3, limit=8) == (0, True)

    bench = Bench("gpt", _tiny_gpt, lambda n: TokenDataset(n, context=16))
    capacity = reference_capacity(bench, stages=2)
    config = Config("gpt", 2, "time", "1f1b", memopt=True, capacity=capacity)
    memory_config(bench, config, functools.partial(sample_profile, bench), guess=2, limit=3)

    assert 1 <= len(config.probes) <= 3
    assert config.max_microbatch >= 1
    found = next(p for p in config.probes if p.microbatch == config.max_microbatch)
    assert found.fits and len(found.metered) == 2 and max(found.metered) <= capacity
    assert len(found.predicted) == 2 and all(p > 0 for p in found.predicted)
    assert all(not p.fits for p in config.probes if p.microbatch > config.max_microbatch)


@pytest.mark.slow
def test_hugging_face_capture_benchmark_runs_on_a_tiny_gpt2():
    pytest.importorskip("transformers")
    from benchmarks.hf_capture import main

    result = main(["--layers", "1", "--dim", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--stages", "2",
                   "--chunks", "2", "--memory", "64MiB"])
    assert result["nodes"] > 20 and result["parameters"] > 0
    assert all(result[k] >= 0 for k in ("capture_s", "profile_s", "plan_s"))


@pytest.mark.slow
def test_paper_benchmark_confirms_each_prediction_by_a_fake_run_on_a_tiny_gpt2(tmp_path, monkeypatch):
    """fp32, then bf16-mixed rows beside them: autocast saves activations in bf16 (a profile
    on CPU tensors, since autocast casts no meta tensor), so no configuration trains a smaller
    micro-batch than in fp32."""
    paper, tiny, small = _tiny_gpt2_on_a_small_gpu()
    results = paper.main(["--stages", "2", "--out", str(tmp_path)], workloads=[tiny], device=small)

    rows = results["rows"]
    assert [(r["schedule"], r["memopt"], r["partitioner"]) for r in rows] == [
        (s, m, p) for s in ("gpipe", "2bw") for m in (False, True) for p in ("dawnpiper", "time")]
    for r in rows:  # trained by fake execution, at most what the planner predicted, under the cap
        assert 1 <= r["max_microbatch"] <= r["predicted"] and r["fake_runs"] >= 1
        assert 0 < r["fake_peak_gib"] * 2**30 <= small.memory and r["batch"] == 2 * r["max_microbatch"]
    assert [r["vs_time"] for r in results["ratios"]] == [
        d["max_microbatch"] / t["max_microbatch"] for d, t in zip(rows[::2], rows[1::2])]
    # dawnpiper's search from the size another partitioner fits finds what max_microbatch finds
    bench = paper.Bench(tiny, small)
    time_fits = bench.largest(2, "2bw", True, "time").microbatch_size
    started = bench.largest(2, "2bw", True, "dawnpiper", at_least=time_fits)
    assert started == bench.largest(2, "2bw", True, "dawnpiper") != bench.largest(2, "2bw", True, "time")
    page = (tmp_path / "docs" / "paper-scale.md").read_text()
    assert "## Table 1: synchronous" in page and "## Table 2: asynchronous" in page and "| tiny GPT-2 |" in page
    assert json.loads((tmp_path / "benchmarks" / "paper_results.json").read_text())["rows"] == rows

    merged = paper.main(["--stages", "2", "--precision", "bf16-mixed", "--out", str(tmp_path)], workloads=[tiny],
                        device=small)["rows"]
    bf16 = [r for r in merged if r["precision"] == "bf16-mixed"]
    assert [r for r in merged if r["precision"] == "32-true"] == rows
    assert [paper._key(r)[:-1] for r in bf16] == [paper._key(r)[:-1] for r in rows]
    assert all(f["max_microbatch"] <= b["max_microbatch"] <= b["predicted"] for f, b in zip(rows, bf16))
    activations = {p: sum(n.saved_bytes - n.cast_bytes for n in paper.Bench(tiny, small, p).profile.nodes)
                   for p in paper.PAPER_PRECISIONS}
    assert activations["bf16-mixed"] < 0.9 * activations["32-true"]
    page = (tmp_path / "docs" / "paper-scale.md").read_text()
    assert "| tiny GPT-2 | tiny GPT-2, bf16-mixed |" in page and paper.BF16 in page


@pytest.mark.slow
def test_a_paper_run_cut_short_keeps_the_tasks_it_finished(tmp_path, monkeypatch):
    # a task (model, stage count) is written out as it ends: the run of 2 then 3 stages fails
    # in its second task, and the first task's rows are on file and on the page
    paper, tiny, small = _tiny_gpt2_on_a_small_gpu()
    measure = paper.measure_stages

    def failing(workload, stages, settings, device):
        if stages == 3:
            raise KeyboardInterrupt
        return measure(workload, stages, settings, device)

    monkeypatch.setattr(paper, "measure_stages", failing)
    with pytest.raises(KeyboardInterrupt):
        paper.main(["--stages", "2", "3", "--out", str(tmp_path)], workloads=[tiny], device=small)
    results = json.loads((tmp_path / "benchmarks" / "paper_results.json").read_text())
    assert {r["stages"] for r in results["rows"]} == {2} and len(results["rows"]) == 8
    assert results["runs"][-1]["configurations"] == 8
    assert "| tiny GPT-2 |" in (tmp_path / "docs" / "paper-scale.md").read_text()


@pytest.mark.parametrize(("normal", "filters", "millions"), [(6, 208, 82), (6, 416, 318), (6, 544, 542),
                                                         (12, 544, 1050), (24, 512, 1800), (6, 120, 28)])
def test_amoebanet_has_gpipes_parameter_counts(normal, filters, millions):
    """GPipe's Table 1 (AmoebaNet-D (L, D), rounded as it prints them) and the paper's 28M."""
    from benchmarks.amoebanet import AmoebaNetD

    with torch.device("meta"):
        count = sum(p.numel() for p in AmoebaNetD(normal, filters).parameters())
    assert abs(count / 1e6 - millions) <= 0.026 * millions


@pytest.mark.slow
def test_paper_benchmark_trains_a_small_amoebanet_at_its_prediction(tmp_path, monkeypatch):
    """AmoebaNet-D's cells read the two cells before them: under 2BW with memory optimisation,
    each partitioner's plan trains at exactly its predicted size; the page's targets take its
    ratio as the CNN's."""
    paper, _, small = _tiny_gpt2_on_a_small_gpu()
    from benchmarks.amoebanet import AmoebaNetD

    def build():
        with torch.device("meta"):
            return AmoebaNetD(normal=1, filters=16, classes=10)

    def batch(n):  # 64x64 images: fewer samples fit than at 32x32, so each search plans fewer sizes
        return {"image": torch.zeros(n, 3, 64, 64, device="meta"), "label": torch.zeros(n, dtype=torch.long,
                                                                                        device="meta")}

    tiny = paper.Workload("amoebanet", "tiny AmoebaNet-D", build, batch, paper._image, paper._classification_loss)
    rows = paper.run([tiny], paper.Settings(["amoebanet"], [2], ["2bw"], ["time", "dawnpiper"], [True]), small)
    assert len(rows) == 2 and all(r.max_microbatch == r.predicted > 0 for r in rows), rows
    ratios = paper.ratios(rows)
    targets = paper._targets_section({"rows": [asdict(r) for r in rows], "ratios": ratios})
    assert f"on the CNN (AmoebaNet-D) (target 2x): **{ratios[0]['vs_time']:.2f}x** over 1 configurations" in targets


@pytest.mark.slow
def test_a_value_read_on_its_stage_and_on_a_later_one_has_its_gradients_summed_on_its_stage():
    """AmoebaNet-D's first cell over 2 stages under 2BW, stage 0 as dawnpiper split it at paper
    scale (through the cell's last add, recomputing all but three nodes). The cell's first add
    is read there by an add that hands its gradient on as it is, and by the next cell on stage
    1: autograd adds the two gradients into a new tensor on stage 0, which holds it through
    the region's run again (2.65% under the fake run when it counted as stage 1's storage,
    as a gradient handed on from a later stage alone is)."""
    from benchmarks import paper
    from benchmarks.amoebanet import AmoebaNetD
    from lightning_pipe.plan.memory import predict_peaks
    from lightning_pipe.plan.plan import planning_stages
    from lightning_pipe.runtime.fake import fake_training, meta_copy

    def build():
        with torch.device("meta"):
            return AmoebaNetD(normal=1, filters=120)

    workload = paper.Workload("amoebanet", "AmoebaNet-D, one cell a stack", build, paper._labelled_images,
                              paper._image, paper._classification_loss)
    bench = paper.Bench(workload, DEVICES["A100-40GB"])
    names = [n.name for n in bench.profile.nodes]
    first = names.index("add_1") + 1
    recomputed = set(names[: names.index("cells_0_ops_3_5")]) | {"cells_0_ops_3_7", "cells_0_ops_3_8"}
    balance, policies = [first, len(names) - first], ["recompute" if n in recomputed else "keep" for n in names]
    profile = bench.profile.scaled(8)
    stages = planning_stages(profile, PlanRequest([2**40] * 2, schedule="2bw", chunks=2))
    predicted = predict_peaks(profile, balance, stages.in_flight, policies, stages.weight_versions, stages.waits,
                              backward_states=stages.backward_states, schedule="2bw", chunks=2)
    model, graph = meta_copy(bench.model, bench.captured)
    metered = fake_training(model, graph, workload.batch(16), workload.step, bench._optimizer(model), balance,
                            dict.fromkeys(recomputed, "recompute"), schedule="2bw", chunks=2).peaks()
    assert abs(predicted[0].total - metered[0]) <= 0.001 * metered[0], ([p.total for p in predicted], metered)


def test_paper_results_keep_the_configurations_a_later_run_did_not_measure():
    from benchmarks import paper

    def row(model: str, partitioner: str, size: int) -> paper.Row:
        return paper.Row(model, 4, "gpipe", False, partitioner, 4, size, size)

    def run(rows: list[paper.Row]) -> dict:  # a run of the settings those rows come from
        settings = {"models": sorted({r.model for r in rows}), "stages": [4], "schedules": ["gpipe"],
                    "memopt": [False], "partitioners": sorted({r.partitioner for r in rows})}
        return {"command": "paper", "seconds": 1.0, "cpu_seconds": 1.0, "configurations": len(rows),
                "settings": settings}

    def merged(earlier, rows, device=DEVICES["A100-40GB"]):
        return paper.merged(earlier, run(rows), device, {r.model: r.model.upper() for r in rows}, rows)

    first = merged(None, [row("bert", "time", 10), row("bert", "dawnpiper", 20)])
    second = merged(first, [row("gpt2", "time", 3), row("gpt2", "dawnpiper", 3)])
    third = merged(second, [row("bert", "dawnpiper", 30)])
    assert [(r["model"], r["partitioner"], r["max_microbatch"]) for r in third["rows"]] == [
        ("bert", "dawnpiper", 30), ("bert", "time", 10), ("gpt2", "dawnpiper", 3), ("gpt2", "time", 3)]
    assert [r["vs_time"] for r in third["ratios"]] == [3.0, 1.0] and len(third["runs"]) == 3
    assert third["labels"] == {"bert": "BERT", "gpt2": "GPT2"}
    # a run whose rows were all replaced is no longer listed; another device's results are not joined
    assert len(merged(third, [row("gpt2", "time", 4), row("gpt2", "dawnpiper", 4)])["runs"]) == 3
    other = merged(third, [row("gpt2", "time", 5)], replace(DEVICES["A100-40GB"], name="A100-80GB"))
    assert len(other["rows"]) == 1 and len(other["runs"]) == 1


def test_paper_benchmark_guesses_the_next_size_from_the_measured_peaks():
    from benchmarks.paper import _next_size

    gib = 2**30
    assert _next_size(0, 120, {120: 50 * gib}, 40 * gib) == 96  # the peak taken as proportional to the size
    assert _next_size(96, 120, {96: 36 * gib, 120: 44 * gib}, 40 * gib) == 108  # straight between two sizes
    assert _next_size(96, 100, {96: 36 * gib, 100: 36 * gib + 1}, 40 * gib) == 98  # past high: bisect


@pytest.mark.slow
def test_paper_benchmark_rows_are_the_same_from_worker_processes(monkeypatch):
    # the workers run one (stages, schedule, memopt) group each, on the profile made before they forked
    paper, tiny, small = _tiny_gpt2_on_a_small_gpu()
    settings = paper.Settings(["gpt2"], [2, 3], ["1f1b", "2bw"], ["params", "dawnpiper"], [False])
    pooled, inline = (paper.run([tiny], settings, small, jobs) for jobs in (2, 1))
    assert [(r.stages, r.schedule, r.partitioner, r.max_microbatch) for r in pooled] == [
        (r.stages, r.schedule, r.partitioner, r.max_microbatch) for r in inline]
    assert [(r.stages, r.schedule) for r in pooled[::2]] == [(2, "1f1b"), (2, "2bw"), (3, "1f1b"), (3, "2bw")]
    assert all(r.max_microbatch > 0 for r in pooled)
    # a run's CPU time counts the workers' by their rows: the system counts a worker's only
    # once it has exited, after a run cut short has saved its rows
    assert all(r.cpu_seconds > 0 for r in pooled)
    assert paper._cpu_seconds(pooled, workers=True) == pytest.approx(
        paper._cpu_seconds([], workers=True) + sum(r.cpu_seconds for r in pooled), abs=0.1)


@pytest.mark.slow
def test_distributed_benchmark_runs_every_runtime_and_matches_pipelinings_peaks(monkeypatch, capsys):
    """``python -m benchmarks.distributed`` at a tiny size: a row per runtime, and on the same
    split our 1F1B holds what torch.distributed.pipelining's does on every rank. Its ``main``
    runs here, on the command line's arguments (the ranks it spawns start fresh interpreters
    of their own; a process of its own for ``main`` cost one more start-up of torch and
    Lightning)."""
    from benchmarks import distributed

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what the spawned ranks start with
    monkeypatch.setattr("sys.argv", ["benchmarks/distributed.py", "--width", "128", "--depth", "4", "--batch", "16",
                                     "--steps", "1"])
    distributed.main()
    rows = {line[:36].strip(): line[36:].split(maxsplit=1) for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"lightning_pipe distributed 1F1B", "torch pipelining Schedule1F1B",
                         "lightning_pipe interleaved 1F1B, v=2", "lightning_pipe local GPipe (1 proc)"}
    assert rows["lightning_pipe distributed 1F1B"][1] == rows["torch pipelining Schedule1F1B"][1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="it measures where a CUDA device is present")
def test_gpu_check_says_it_needs_a_cuda_device():
    from benchmarks.gpu_check import main

    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["gpt"])


def test_gpu_check_predicts_the_allocator_of_a_tiny_gpt_on_cpu_stages():
    from benchmarks.gpu_check import families, measure

    stages, devices = measure(families(tiny=True)["gpt"](), [torch.device("cpu")] * 2, steps=2, microbatch=2)
    assert [s.stage for s in stages] == [0, 1] and all(0 < s.fake <= s.allocated <= s.reserved for s in stages)
    (device,) = devices  # both stages on the CPU: one allocator, no CUDA figures
    assert device.stages == [0, 1] and device.max_allocated is None and device.max_reserved is None
    assert max(s.allocated for s in stages) <= device.allocated <= sum(s.allocated for s in stages)


@pytest.mark.cuda
def test_gpu_check_compares_with_what_cuda_measured():
    from benchmarks.gpu_check import main

    for stages, devices in main(["--tiny", "--stages", "2", "--steps", "2"]).values():
        assert all(0 < s.fake <= s.allocated <= s.reserved for s in stages)
        assert all(d.max_allocated and d.max_reserved and d.allocated <= d.reserved for d in devices)


def _tiny_results() -> dict:
    """What ``benchmarks.run.measure`` returns, for one configuration of each table."""
    from benchmarks import run

    probe = {"microbatch": 2, "fits": True, "error": "", "predicted": [100, 90], "metered": [98, 95]}
    config = asdict(run.Config("gpt", 2, "dawnpiper", "1f1b", True, 200, max_microbatch=2, exact=True,
                               predicted_max=2, probes=[run.Probe(**probe)]))
    return {
        "mode": "quick", "machine": run.machine(), "settings": asdict(run.QUICK), "memory": [config],
        "ratios": run.ratios([run.Config(**{**config, "probes": [run.Probe(**probe)]})]),
        "accuracy": run.accuracy([run.Config(**{**config, "probes": [run.Probe(**probe)]})]),
        "simulated": [{"model": "gpt", "stages": 2, "schedule": "1f1b", "microbatch": 2, "planner": "dawnpiper",
                       "step_ms": 1.0, "bubble": 0.25}],
        "overhead": {"model": "gpt", "batch": 8, "timed_steps": 1, "plain_ms": 1.0, "pipe1_ms": 1.1,
                     "pipe4_ms": 2.0, "pipe4_stage_sum_ms": 1.5},
        "peers": {"batch": 8, "chunks": 4, "stages": 2, "torch": torch.__version__, "ours_ms": 1.0,
                  "ours_balance": [2, 2], "ours_peaks": [1, 2], "ours_process_peak": 3, "pipelining_ms": 1.0,
                  "pipelining_peaks": [1, 2], "pipelining_threads": 1, "torchgpipe": "skipped"},
        "seconds": 1.0,
    }


def test_benchmark_run_writes_a_folder_of_its_own_and_the_docs_only_when_asked(tmp_path, monkeypatch, capsys, request):
    from benchmarks import run

    quieted = logging.getLogger("lightning.pytorch")  # main() quiets Lightning for the whole process
    request.addfinalizer(functools.partial(quieted.setLevel, quieted.level))

    faults = "## Fault injection (measured)\n\nkept\n"  # sections other benchmarks write
    planner = "## Planner time vs graph size\n\nkept too\n"  # (benchmarks.planner_speed --grid --update-docs)
    tracked = {tmp_path / "docs" / "benchmarks.md": (
        f"# Benchmarks\n\nOLD-PAGE-TEXT\n\n## Simulated step time at equal batch (simulated, not measured)\n\n"
        f"OLD-PAGE-TEXT\n\n{faults}\n{planner}"),
               tmp_path / "benchmarks" / "results.json": "{}"}
    for path, text in tracked.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(run, "ROOT", tmp_path)  # the repository, as main sees it
    monkeypatch.setattr(run, "measure", lambda full=False: _tiny_results())

    run.main(["--quick"])
    assert all(path.read_text() == text for path, text in tracked.items())  # the default leaves the docs alone
    (folder,) = (tmp_path / "benchmark-results").iterdir()
    page = (folder / "benchmarks.md").read_text()
    assert f"wrote {folder / 'results.json'} and {folder / 'benchmarks.md'}" in capsys.readouterr().out
    machine = json.loads((folder / "results.json").read_text())["machine"]
    assert machine["commit"] and machine["cpu"] and folder.name.endswith(machine["commit"])
    assert (f"Commit {machine['commit']}; machine: {machine['cpu']}, {machine['cpu_count']} CPUs" in page
            and f"torch {torch.__version__}" in page)

    run.main(["--quick", "--out", str(tmp_path / "mine"), "--update-docs"])
    docs = (tmp_path / "docs" / "benchmarks.md").read_text()
    mine = (tmp_path / "mine" / "benchmarks.md").read_text()
    assert docs.replace(faults + "\n", "").replace(planner + "\n", "") == mine
    assert "OLD-PAGE-TEXT" not in docs and faults in docs and planner in docs
    assert docs.index("## Simulated step time") < docs.index("## Fault injection") < docs.index("## Planner time")
    assert json.loads((tmp_path / "benchmarks" / "results.json").read_text())["mode"] == "quick"


def test_benchmark_commit_without_git_is_unknown(tmp_path, monkeypatch):
    from benchmarks import run

    monkeypatch.setenv("PATH", str(tmp_path))  # no git to run
    assert run.commit() == "unknown"


def test_planner_speed_grid_goes_in_place_of_the_docs_planner_time_section_with_targets_and_growth(tmp_path):
    from benchmarks import planner_speed

    timings = [planner_speed.Timing(n, s, n * s / 100, 10 * n, 1, 1.0) for n in (1_000, 10_000) for s in (8, 32)]
    section = planner_speed.grid_section(timings, "MACHINE")
    assert "| 1,000 | 8 | 80 | 20 | 10,000 | 1 |" in section  # issue #47's target beside the figure
    assert "| 10,000 | 32 | 3200 | 500 | 100,000 | 1 |" in section and "| 1,000 | 32 | 320 |  |" in section
    assert ("Pricings grow as nodes^k from 1,000 to 10,000 nodes, k = 1.00 at 8 stages, 1.00 at 32 stages; "
            "stages^k from 8 to 32 stages, k = 0.00 at 1,000 nodes" in section)
    assert "CPU time as nodes^k from 1,000 to 10,000 nodes, k = 1.00 at 8 stages" in section
    assert "MACHINE" in section
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n\n## Planner time vs graph size\n\nold\n\n## Runtime overhead\n\nkept\n")
    planner_speed.update_docs(section, page)
    assert page.read_text() == "# B\n\n" + section + "## Runtime overhead\n\nkept\n"


@pytest.mark.slow  # fake-profiles two small decoders: about 4 s of CPU
def test_a_decoders_middle_layer_repeated_profiles_as_the_deeper_decoder_does(monkeypatch):
    # benchmarks.paper --fsdp plans decoders of hundreds of layers from a three-layer profile
    pytest.importorskip("transformers")
    from benchmarks import fsdp_scale
    from benchmarks.paper import Bench as PaperBench

    monkeypatch.setattr(fsdp_scale, "SEQ", 16)
    monkeypatch.setattr(fsdp_scale, "WIDTH", {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                                               "num_key_value_heads": 2, "vocab_size": 64})
    device = DEVICES["A100-80GB"]
    three, five = (PaperBench(fsdp_scale.llama(n), device, "bf16-mixed").profile for n in (3, 5))
    assert fsdp_scale.repeated(three, 3) == three
    assert fsdp_scale.repeated(three, 5) == five


@pytest.mark.slow
def test_schedule_time_benchmark_prints_simulated_and_measured_step_per_schedule(monkeypatch, capsys):
    """``python -m benchmarks.schedule_time`` at a tiny size, on a V-shape schedule (two stages
    per process, the split backward): a row with the plan's simulated step, the measured one and
    their ratio."""
    from benchmarks import schedule_time

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr("sys.argv", ["benchmarks/schedule_time.py", "--width", "64", "--layers", "2", "--context",
                                     "16", "--batch", "8", "--chunks", "4", "--warmup", "1", "--steps", "2",
                                     "--schedules", "zbv"])
    schedule_time.main()
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:-1]}
    assert set(rows) == {"zbv"}
    simulated, measured, ratio, *_ = rows["zbv"]
    assert float(simulated) > 0 and float(measured) > 0
    assert float(ratio) == pytest.approx(float(simulated) / float(measured), abs=0.01)


def test_paper_bound_is_the_largest_micro_batch_whose_bytes_fit_the_devices_together():
    """B_agg: the whole model priced as one stage, holding as many micro-batches as the
    schedule's stage holding the fewest (GPipe: both, 1F1B: the last stage's one), fits the
    two devices' memory together at B_agg and not one more; no row trains more, memory
    optimisation only raises it, and the page gives each row's max over it."""
    from benchmarks import paper
    from lightning_pipe.plan.memory import CostModel

    _, tiny, small = _tiny_gpt2_on_a_small_gpu()
    bench = paper.Bench(tiny, small)
    rows = [bench.measure(2, schedule, False, "dawnpiper") for schedule in ("gpipe", "1f1b")]

    def total(row: paper.Row, size: int, held: int) -> int:
        model = CostModel(bench.profile.scaled(size), schedule=row.schedule, chunks=2)
        return model.peak(0, model.n, held).total

    for row, held in zip(rows, (2, 1)):
        assert 0 < row.max_microbatch <= row.b_agg
        assert total(row, row.b_agg, held) <= 2 * small.memory < total(row, row.b_agg + 1, held)
    assert rows[1].b_agg > rows[0].b_agg  # 1F1B's last stage holds one micro-batch, GPipe's every stage both
    optimised = paper.aggregate_bound(bench.profile, "1f1b", 2, 2, 1, True, 2 * small.memory, small.host_bandwidth)
    assert optimised >= rows[1].b_agg
    page = "\n\n".join(paper._schedule_sections(rows, {"gpt2": "tiny GPT-2"}))
    assert all(f"{r.max_microbatch} ({r.max_microbatch / r.b_agg:.2f})" in page for r in rows)


@pytest.mark.slow
def test_paper_schedule_rows_train_by_fake_execution_of_each_ranks_schedule():
    """``--schedules``: a V-shape schedule's largest micro-batch trains rank by rank on torch's
    own action order (the planner's prediction may be refused), its throughput is the
    simulated step's, and ``auto``, planned at the size of the fastest of the others, is at
    least as fast, says what it picked and stays under the largest of its candidates' bounds."""
    _, tiny, small = _tiny_gpt2_on_a_small_gpu()
    from benchmarks import paper

    rows = paper.measure_schedules(paper.Bench(tiny, small), 2, True, ["dist-1f1b", "zbv", "auto"])
    for r in rows:
        assert 0 < r.max_microbatch <= r.predicted and r.fake_peak_gib * 2**30 <= small.memory
        assert r.samples_per_s == pytest.approx(r.max_microbatch * r.chunks * 1e3 / r.step_ms)
        assert r.chunks == 4 and r.max_microbatch <= r.b_agg
    one, zbv, auto = rows
    assert (one.virtual_stages, zbv.virtual_stages) == (1, 2)
    fastest = max(one, zbv, key=lambda r: r.samples_per_s)
    assert auto.max_microbatch == fastest.max_microbatch and auto.picked
    assert auto.samples_per_s >= fastest.samples_per_s
    assert auto.b_agg >= max(one.b_agg, zbv.b_agg)
