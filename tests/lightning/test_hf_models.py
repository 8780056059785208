"""Hugging Face models in plain LightningModules: captured by torch.export, pipelined, and
trained as on one device. Small configs built in code; nothing is downloaded."""

import functools
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_pipe
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.graph.export import bind_arguments
from tests.helpers import max_rel_diff, trainer

VOCAB = 64


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


def _t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, use_cache=False,
    )
    return transformers.T5ForConditionalGeneration(config)


MODELS = {"gpt2": _gpt2, "bert": _bert, "t5": _t5}


class Batches(Dataset):
    """Dict samples as a Hugging Face collator makes them; BERT's have padding."""

    def __init__(self, family: str, size: int = 24, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.family = family
        self.ids = torch.randint(1, VOCAB, (size, length), generator=g)
        self.mask = (torch.arange(length) < torch.randint(length // 2, length + 1, (size, 1), generator=g)).long()
        self.classes = torch.randint(0, 3, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.family == "gpt2":
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        if self.family == "bert":
            return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.classes[i]}
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i, :8]}


class HFModule(LightningModule):
    """A plain LightningModule around a Hugging Face model: keyword arguments in, the
    model's output (with the loss it computes from ``labels``) out."""

    def __init__(self, family: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MODELS[family]()

    def forward(self, **batch: torch.Tensor):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        loss = self(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(**batch).loss)

    def predict_step(self, batch, batch_idx):
        return self(**batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(family, strategy="auto", devices=1, val=False):
    model = HFModule(family)
    data = DataLoader(Batches(family), batch_size=8)
    t = trainer(strategy, devices, max_steps=3, num_sanity_val_steps=1 if val else 0)
    t.fit(model, data, DataLoader(Batches(family, size=8), batch_size=8) if val else None)
    return model, t


@functools.cache
def _single_device(family: str) -> LightningModule:
    """Three steps of single-device training, shared by the tests comparing with them (read only)."""
    return _fit(family)[0]


def _parity(piped, reference):
    """``max_rel_diff`` but for BERT's attention key biases: their true gradient is exactly
    zero (softmax ignores a shift), so they hold only rounding noise, which differs with the split."""
    return max_rel_diff(piped, reference, [k for k in reference.state_dict() if "key.bias" not in k])


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, schedule, stages",
    [("gpt2", "gpipe", 2), ("gpt2", "1f1b", 2), ("gpt2", "gpipe", 4), ("gpt2", "1f1b", 4),
     ("bert", "gpipe", 2), ("bert", "1f1b", 4), ("t5", "gpipe", 2), ("t5", "1f1b", 4)],
)
def test_three_steps_match_single_device_training(family, schedule, stages):
    reference = _single_device(family)
    strategy = MemoryPipeStrategy(chunks=4, schedule=schedule, planner=None)
    piped, _ = _fit(family, strategy, stages)
    assert strategy.engine.captured.front_end == "torch.export"
    assert _parity(piped, reference) < 1e-5
    assert _parity(piped, HFModule(family)) > 1e-3  # training moved the parameters
    assert piped.state_dict().keys() == HFModule(family).state_dict().keys()
    assert len(list(piped.parameters())) == len(list(HFModule(family).parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_tied_embedding_is_one_parameter_on_the_first_stage(family):
    strategy = MemoryPipeStrategy(chunks=2, planner=None)
    model, _ = _fit(family, strategy, 2)
    embedding, head = model.model.get_input_embeddings().weight, model.model.lm_head.weight
    assert embedding is head
    first, last = strategy.engine.program.stages
    assert any(t is embedding for t in first.owned) and not any(t is embedding for t in last.owned)


@pytest.mark.slow
def test_planned_pipeline_with_validation_before_training_matches_single_device():
    reference, plain = _fit("gpt2", val=True)
    strategy = MemoryPipeStrategy(chunks=4)  # the default planner profiles the exported graph
    piped, t = _fit("gpt2", strategy, 2, val=True)
    assert strategy.plan is not None and sum(strategy.plan.balance) == len(strategy.engine.captured.nodes)
    assert _parity(piped, reference) < 1e-5
    assert t.callback_metrics["val_loss"].item() == pytest.approx(plain.callback_metrics["val_loss"].item(), rel=1e-5)
    predictions = t.predict(piped, DataLoader(Batches("gpt2", size=8), batch_size=8))
    assert type(predictions[0]).__name__ == "CausalLMOutputWithCrossAttentions"
    expected = piped.model.eval()(**next(iter(DataLoader(Batches("gpt2", size=8), batch_size=8))))
    assert torch.allclose(predictions[0].logits, expected.logits, atol=1e-5)


class Heads(nn.Module):
    """``(*shape, heads, -1)``: torch.fx cannot unpack a traced shape."""

    def forward(self, x):
        return x.view(*x.shape[:-1], 2, -1).flatten(-2)


class Branchy(LightningModule):
    """Doubles in training and triples in evaluation, an explicit ``self.training`` branch;
    ``heads`` decides whether torch.fx or torch.export captures it."""

    def __init__(self, heads: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
        self.heads = Heads() if heads else nn.Identity()

    def forward(self, x):
        y = self.heads(self.a(x))
        return self.b(y * 2 if self.training else y * 3)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(batch[0]).pow(2).mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("heads", [False, True], ids=["fx", "export"])
def test_each_mode_runs_its_own_graph(heads):
    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=8)
    reference = Branchy(heads)
    trainer(max_steps=2).fit(reference, data)
    strategy = MemoryPipeStrategy(chunks=2, planner=None)
    piped = Branchy(heads)
    t = trainer(strategy, 2, max_steps=2)
    t.fit(piped, data)
    assert max_rel_diff(piped, reference) < 1e-5  # trained on the training branch
    predictions = torch.cat(t.predict(piped, data))
    assert len({c.graph_module.code for _, c in strategy.engine.variants.graphs}) == 2  # training and evaluation
    x = data.dataset.tensors[0]
    with torch.no_grad():
        assert torch.allclose(predictions, reference.eval()(x), atol=1e-6)  # the evaluation branch
        assert not torch.allclose(predictions, reference.train()(x), atol=1e-3)


def test_lightning_pipe_imports_no_transformers_of_its_own():
    """No module of lightning_pipe names transformers. (That importing lightning_pipe, its
    strategy and its CLI adds no module of it to what Lightning loaded, which a fresh process
    shows: tests/test_package.py, in the one it starts for such checks.)"""
    package = Path(lightning_pipe.__file__).parent
    assert not [p for p in package.rglob("*.py") if re.search(r"^\s*(from|import) transformers", p.read_text(), re.M)]


class Normed(Branchy):
    def __init__(self, bypass: bool = False) -> None:
        super().__init__(heads=True)
        self.norm = nn.BatchNorm1d(4)
        self.bypass = bypass

    def forward(self, x):
        return self.b(self.norm(self.heads(self.a(x))))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        y = self.b(self.norm(self.heads(self.a(x)))) if self.bypass else self(x)  # bypass: not via forward
        return y.pow(2).mean()


def test_exported_models_refuse_what_needs_fx_or_forward():
    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=8)
    with pytest.raises(ValueError, match=r"deferred_batch_norm=True needs BatchNorm layers as torch\.fx leaf modules"):
        trainer(MemoryPipeStrategy(chunks=2, planner=None, deferred_batch_norm=True), 2).fit(Normed(), data)
    with pytest.raises(RuntimeError, match=r"training_step never called the module's forward"):
        trainer(MemoryPipeStrategy(chunks=2, planner=None, schedule="1f1b"), 2).fit(Normed(bypass=True), data)
    with pytest.raises(RuntimeError, match=r"training_step never called the module's forward"):
        trainer(MemoryPipeStrategy(chunks=2), 2).fit(Normed(bypass=True), data)  # planning needs it too


def _gpt2_batch(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_longer_sequences_are_planned_again_on_their_own_graph(schedule):
    """torch.export specializes a graph to its sizes: a batch of longer sequences is captured
    again, and the plan is made again for that graph."""
    batches = DataLoader([_gpt2_batch(8, 12, 0), _gpt2_batch(8, 20, 1), _gpt2_batch(6, 16, 2)], batch_size=None)
    reference = HFModule("gpt2")
    trainer(max_steps=3).fit(reference, batches)
    piped = HFModule("gpt2")
    strategy = MemoryPipeStrategy(chunks=4, schedule=schedule)
    trainer(strategy, 2, max_steps=3).fit(piped, batches)
    assert strategy.plan.input_shapes == {"input_ids": [8, 20], "labels": [8, 20]}
    longest = bind_arguments(piped, (), _gpt2_batch(2, 20, 0))
    assert strategy.engine.captured.admits(longest)  # the graph planned is the longer batch's
    assert sum(strategy.plan.balance) == len(strategy.engine.captured.nodes)
    assert _parity(piped, reference) < 1e-5
