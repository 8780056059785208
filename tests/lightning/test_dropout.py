"""Dropout under recompute: a recomputed segment replays the random masks of its first run
(torch.utils.checkpoint restores the random state), and profiling restores it too, so training
that recomputes ends with the parameters of training that keeps its activations, bit for bit.
For a torch.fx graph (``nn.Dropout`` modules) and a torch.export one (Hugging Face GPT-2)."""

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from examples.models import GPT, TokenDataset, loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.plan import InfeasiblePlanError, make_plan
from lightning_pipe.plan.request import PlanRequest
from tests.helpers import max_rel_diff, trainer

CHUNKS, STAGES = 4, 2


class DroppyGPT(GPT):
    """The example GPT with dropout after the embeddings and after every block."""

    def __init__(self) -> None:
        super().__init__(layers=2)
        self.drop = nn.Dropout(0.1)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        ids = batch["input_ids"]
        x = self.drop(self.tok_emb(ids) + self.pos_emb[: ids.shape[1]])
        for block in self.blocks:
            x = self.drop(block(x))
        return self.head(self.ln_f(x))

    def example(self, batch: dict[str, Tensor]) -> tuple[tuple[object, ...], dict[str, object]]:
        return (batch,), {}


class DroppyGPT2(LightningModule):
    """Hugging Face GPT-2 with its three dropouts at 0.1."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(
            vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False,
        )
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, **batch: Tensor):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        return self(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def example(self, batch: dict[str, Tensor]) -> tuple[tuple[object, ...], dict[str, object]]:
        return (), batch


MODELS = {"fx": DroppyGPT, "export": DroppyGPT2}


def _model(front_end: str) -> LightningModule:
    torch.manual_seed(0)
    return MODELS[front_end]()


def _data():
    return loader(TokenDataset(24), batch_size=8)


def _fit(front_end: str, strategy: MemoryPipeStrategy, seed: int = 0) -> LightningModule:
    model = _model(front_end)
    torch.manual_seed(seed)  # the dropout masks
    trainer(strategy, STAGES, max_steps=3).fit(model, _data())
    return model


def _tight_limit(front_end: str, schedule: str) -> int:
    """A memory limit just above the least any plan reaches, by recomputing: as the strategy
    plans, from a profile of one micro-batch. Derived, not fixed, so it stays tight when the
    memory model changes."""
    model = _model(front_end).train()
    sample = next(iter(loader(TokenDataset(24), batch_size=8 // CHUNKS)))
    args, kwargs = model.example(sample)
    captured = capture(model, example_inputs=(args, kwargs))
    profile = profile_graph(captured, args, kwargs, optimizer=model.configure_optimizers(), repeats=1)
    with pytest.raises(InfeasiblePlanError) as nothing_fits:
        make_plan(profile, PlanRequest([1] * STAGES, "dawnpiper", schedule, CHUNKS))
    # 1% over the floor: the plans there recompute nearly every node, dropouts included, while
    # 3% lets a GPipe plan keep the (cheap to keep, region-bounding) dropout nodes
    return int(nothing_fits.value.min_peak * 1.01)


# Every schedule on the torch.fx graph; the torch.export one (whose capture takes most of a
# minute here) under 1F1B, where recompute runs inside the schedule's interleaved backwards.
@pytest.mark.slow
@pytest.mark.parametrize(("front_end", "schedule"),
                         [("fx", "gpipe"), ("fx", "1f1b"), ("fx", "2bw"), ("export", "1f1b")])
def test_recomputing_replays_the_dropout_masks(front_end, schedule):
    recomputing = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, memory_limit=_tight_limit(front_end, schedule))
    recomputed = _fit(front_end, recomputing)
    assert recomputing.engine.captured is not None and recomputing.engine.captured.front_end == f"torch.{front_end}"
    assert recomputing.plan is not None
    dropouts = [p for n, p in zip(recomputing.engine.captured.nodes, recomputing.plan.policies) if "drop" in n.name]
    assert "recompute" in dropouts, "the plan must recompute a dropout node"

    keeping = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, planner=None, balance=recomputing.plan.balance)
    kept = _fit(front_end, keeping)
    assert max_rel_diff(recomputed, kept) == 0.0
    other_masks = _fit(front_end, MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, planner=None,
                                                     balance=recomputing.plan.balance), seed=1)
    assert max_rel_diff(other_masks, kept) > 1e-3  # dropout is on: other masks train otherwise
