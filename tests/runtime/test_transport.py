import pytest
import torch

from lightning_pipe.runtime.transport import move


def test_move_keeps_structure_and_identity_on_same_device():
    x = torch.ones(2, requires_grad=True)
    moved = move({"x": x, "n": 3}, torch.device("cpu"))
    assert moved["x"] is x and moved["n"] == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_move_across_devices_carries_gradients_back():
    x = torch.randn(4, 3, requires_grad=True)
    y = move(x, torch.device("cuda", 0))
    assert y.device.type == "cuda"
    z = move(y * 3, torch.device("cpu"))
    z.sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 3.0))
