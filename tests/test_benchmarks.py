"""Smoke tests of the benchmarks' smallest pieces, so ``benchmarks/run.py`` and
``benchmarks/hf_capture.py`` cannot silently rot."""

import pytest
import torch

from benchmarks.models import Bench
from benchmarks.run import Config, memory_config, reference_capacity, sample_profile, search
from examples.models import GPT, TokenDataset


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(dim=32, layers=2, context=16)


def test_max_microbatch_search_trains_at_the_size_it_finds():
    assert search(lambda n: n <= 5, guess=1, limit=8) == (5, True)
    assert search(lambda n: n <= 5, guess=12, limit=8) == (5, True)
    assert search(lambda n: False, guess=3, limit=8) == (0, True)

    bench = Bench("gpt", _tiny_gpt, lambda n: TokenDataset(n, context=16))
    capacity = reference_capacity(bench, stages=2)
    config = Config("gpt", 2, "time", "1f1b", memopt=True, capacity=capacity)
    memory_config(bench, config, sample_profile(bench, 2), guess=2, limit=3)

    assert 1 <= len(config.probes) <= 3
    assert config.max_microbatch >= 1
    found = next(p for p in config.probes if p.microbatch == config.max_microbatch)
    assert found.fits and len(found.metered) == 2 and max(found.metered) <= capacity
    assert len(found.predicted) == 2 and all(p > 0 for p in found.predicted)
    assert all(not p.fits for p in config.probes if p.microbatch > config.max_microbatch)


def test_hugging_face_capture_benchmark_runs_on_a_tiny_gpt2():
    pytest.importorskip("transformers")
    from benchmarks.hf_capture import main

    result = main(["--layers", "1", "--dim", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--stages", "2",
                   "--chunks", "2", "--memory", "64MiB"])
    assert result["nodes"] > 20 and result["parameters"] > 0
    assert all(result[k] >= 0 for k in ("capture_s", "profile_s", "plan_s"))
