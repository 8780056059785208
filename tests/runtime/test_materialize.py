"""Modules built on the meta device get storage and their own initialisation, in place."""

import pytest
import torch
from torch import nn

from examples.models import UNet
from lightning_pipe.runtime.materialize import check_resettable, has_meta, materialize, to_meta
from tests.models import make

CPU = torch.device("cpu")


def test_materialising_gives_the_values_of_eager_construction():
    """U-Net's layers initialise in ``reset_parameters``, in the order they are registered:
    materialised from the same seed, every tensor equals the eagerly built model's."""
    eager, _ = make("unet")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = UNet()
    assert has_meta(model)
    materialize(model, CPU)
    assert not has_meta(model)
    for (name, expected), got in zip(eager.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, expected), name


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_the_same_objects_get_storage_so_ties_and_optimizers_hold():
    with torch.device("meta"):
        model = _Tied()
    weight = model.emb.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    materialize(model, CPU)
    assert model.emb.weight is weight and model.head.weight is weight and not weight.is_meta
    assert isinstance(weight, nn.Parameter) and weight.requires_grad
    model.head(model.emb(torch.tensor([1]))).sum().backward()
    before = weight.detach().clone()
    optimizer.step()  # the optimizer still holds the parameter, now with storage
    assert not torch.equal(weight, before)
    to_meta(weight)
    assert model.head.weight.is_meta and model.head.weight is weight


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_a_module_that_cannot_initialise_its_own_tensors_is_named():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _Scaled())
    with pytest.raises(TypeError, match=r"1 \(_Scaled\) .* no reset_parameters\(\) to initialise \['scale'\]"):
        materialize(model, CPU)
    check_resettable(nn.Sequential(_Scaled()))  # with storage: nothing to initialise
