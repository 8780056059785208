"""Micro-batches of one sample: torch.export would fix the batch size it sees as 1, so a
pipeline of micro-batch 1 is captured from a batch of two stand-ins and its graph holds for
every batch size. Planned fits train as on one device, through either front end."""

import re
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from examples.models import GPT, TokenDataset
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.graph.export import bind_arguments
from tests.helpers import max_rel_diff, trainer

CHUNKS = 4  # and batches of 4: micro-batches of 1


def _gpt2() -> LightningModule:
    """The example's Hugging Face GPT-2, small, under SGD: AdamW would make the rounding noise
    in the attention key biases' gradients (zero in exact arithmetic, as softmax ignores a
    shift) whole steps."""
    pytest.importorskip("transformers")
    from examples.hf_gpt2 import GPT2LM

    class SGDGPT2(GPT2LM):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    return SGDGPT2(layers=2, dim=32, heads=2, vocab=64, context=16, dropout=0.0)


def _counting() -> Any:
    from examples.hf_gpt2 import Counting

    return DataLoader(Counting(2 * CHUNKS, vocab=64, context=16), batch_size=CHUNKS)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt2_at_micro_batch_one_plans_and_trains_as_on_one_device(schedule):
    reference = _gpt2()
    trainer(max_steps=2).fit(reference, _counting())
    piped = _gpt2()
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule)  # the default planner
    t = trainer(strategy, 2, max_steps=2)
    t.fit(piped, _counting())
    captured = strategy.engine.captured
    assert captured.front_end == "torch.export" and strategy.profile.microbatch_size == 1
    assert sum(strategy.plan.balance) == len(captured.nodes)
    assert len({id(c) for _, c in strategy.engine.variants.graphs}) == 1  # captured once, for every size
    for n in (1, CHUNKS):
        ids = torch.zeros(n, 16, dtype=torch.long)
        assert captured.admits(bind_arguments(piped, (), {"input_ids": ids, "labels": ids}))
    assert torch.isfinite(t.callback_metrics["train_loss"])
    assert max_rel_diff(piped, reference) < 1e-5
    assert max_rel_diff(piped, _gpt2()) > 1e-3  # training moved the parameters


def test_fx_model_at_micro_batch_one_plans_and_trains_as_on_one_device():
    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(dim=32, layers=1, context=16)

    data = DataLoader(TokenDataset(2 * CHUNKS, context=16), batch_size=CHUNKS)
    reference = gpt()
    trainer(max_steps=2).fit(reference, data)
    piped = gpt()
    strategy = MemoryPipeStrategy(chunks=CHUNKS)
    trainer(strategy, 2, max_steps=2).fit(piped, data)
    assert strategy.engine.captured.front_end == "torch.fx" and strategy.engine.captured.specialization is None
    assert strategy.profile.microbatch_size == 1
    assert max_rel_diff(piped, reference) < 1e-5


@pytest.mark.slow
def test_cli_plans_gpt2_at_micro_batch_one_and_searches_larger_ones(capsys):
    """The issue's command, small: the profile is at micro-batch 1, and the search for the
    largest micro-batch that fits runs the same graph at larger sizes."""
    pytest.importorskip("transformers")
    from lightning_pipe.cli import main

    assert main(["plan", "--model", "examples.hf_gpt2.GPT2LM", "--init-args", '{"layers": 1, "dim": 32, "context": 16}',
                 "--input", "input_ids=int64[4,16]", "--input", "labels=int64[4,16]", "--devices", "2x2MiB",
                 "--schedule", "1f1b", "--chunks", "4"]) == 0
    out = capsys.readouterr().out
    assert "nodes (torch.export) on cpu at micro-batch 1;" in out.splitlines()[0]
    largest = [int(size) for size in re.findall(r"^== \w+: largest micro-batch that fits: (\d+)", out, re.M)]
    assert len(largest) == 5 and min(largest) > 1
