"""Variants: one graph per training mode (and, exported, per input specialization)."""

import pytest
import torch
from torch import nn

from examples.models import GPT
from lightning_pipe.graph.variants import Variants, follow_balance
from lightning_pipe.plan.balance import balance_by_weight
from tests.graph.test_export import Heads, TiedLM, _batch


class Branchy(nn.Module):
    """Doubles in training and triples in evaluation: an explicit ``self.training`` branch."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        y = y * 2 if self.training else y * 3
        return self.b(y)


def test_each_mode_gets_its_graph_and_the_training_graph_whatever_the_mode():
    model = Branchy().eval()
    variants = Variants(model)
    train = variants.training_graph()
    assert not model.training and not model.a.training  # the modes are given back
    evaluation = variants.get()
    assert evaluation is not train
    x = torch.randn(3, 4)
    assert torch.allclose(evaluation.graph_module(x), model(x))
    model.train()
    assert variants.get() is train
    assert torch.allclose(train.graph_module(x), model(x))


def test_graphs_that_come_out_the_same_are_one_variant():
    model = GPT(layers=1)
    variants = Variants(model)
    train = variants.training_graph()
    model.eval()
    assert variants.get() is train
    assert len({id(c) for _, c in variants.graphs}) == 1


@pytest.mark.slow
def test_exported_variants_by_input_structure_and_sizes():
    model = TiedLM()
    variants = Variants(model)
    batch, labels = _batch()
    first = variants.get(((batch,), {"labels": labels}))
    assert variants.get(((batch,), {"labels": labels})) is first
    assert variants.get((({"ids": batch["ids"][:1]},), {"labels": labels[:1]})) is first  # another batch size
    unlabelled = variants.get(((batch,), {}))
    assert unlabelled is not first
    longer = {"ids": torch.zeros(4, 9, dtype=torch.long)}
    every = variants.get(((longer,), {"labels": longer["ids"]}))  # a new length: every size symbolic
    assert every is not first and every.specialization.leaves[0].sizes == (None, None)
    other = {"ids": torch.zeros(2, 5, dtype=torch.long)}
    assert variants.get(((other,), {"labels": other["ids"]})) is every


def test_a_first_call_with_a_batch_of_one_captures_the_graph_for_every_batch_size():
    model = TiedLM()
    variants = Variants(model)
    batch, labels = _batch(n=1)
    first = variants.get(((batch,), {"labels": labels}))
    batch, labels = _batch(n=4)
    assert variants.get(((batch,), {"labels": labels})) is first and len(variants.graphs) == 1
    assert first.specialization.leaves[0].sizes == (None, 6)  # the length alone stays fixed


def test_follow_balance_keeps_each_parameters_first_user_on_its_stage():
    model = nn.Sequential(Heads(8), nn.Dropout(0.1), Heads(8), nn.Dropout(0.1), Heads(8), nn.Linear(8, 2))
    variants = Variants(model)
    x = torch.randn(4, 8)
    train = variants.training_graph(((x,), {}))
    balance = balance_by_weight(train.param_bytes(), 3)
    stage_of = {}
    for stage, params in zip(_stages(balance), train.params_by_node()):
        stage_of.update((id(p), stage) for p in params)
    model.eval()
    evaluation = variants.get(((x,), {}))
    assert evaluation.graph_module.code != train.graph_module.code
    followed = follow_balance(evaluation, stage_of, 3)
    assert sum(followed) == len(evaluation.nodes) and min(followed) >= 1
    for stage, params in zip(_stages(followed), evaluation.params_by_node()):
        assert all(stage_of[id(p)] == stage for p in params)


def _stages(balance):
    return [stage for stage, count in enumerate(balance) for _ in range(count)]
