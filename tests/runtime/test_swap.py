import torch

from lightning_pipe.measure.meter import MemoryMeter
from lightning_pipe.runtime import swap


def test_views_of_one_storage_share_one_host_copy_and_come_back_equal():
    base = torch.randn(6, 8, requires_grad=True)
    expected = torch.autograd.grad(((base * 2)[:3] * (base * 2)[3:]).sum(), base)[0]
    hooks = swap.to_host(inputs=(base,))
    with hooks:
        x = base * 2  # made inside the region
        out = (x[:3] * x[3:]).sum()  # mul saves two views of x's one storage
    assert len(hooks.swapped) == 1 and hooks.swapped[0].nbytes == 6 * 8 * 4
    assert torch.equal(torch.autograd.grad(out, base)[0], expected)


def test_saved_tensors_go_to_host_and_gradients_are_unchanged():
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(32, 32))
    expected = torch.autograd.grad((torch.tanh(x @ w) * 2).sum(), [x, w])
    hooks = swap.to_host()
    with hooks:
        out = torch.tanh(x @ w) * 2
    kinds = [type(s) for s in hooks.swapped]
    assert kinds and all(k is swap.Swapped for k in kinds)  # x and tanh's result; not w (a parameter)
    swap.prefetch(out, hooks.swapped)
    got = torch.autograd.grad(out.sum(), [x, w])
    assert all(s.loaded is not None for s in hooks.swapped)  # prefetched when backward began
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_host_buffers_are_not_charged_and_are_reused():
    meter = MemoryMeter(1)
    x = torch.randn(64, 64)
    with meter, meter.running(0):
        s = swap.Swapped(x)
        host = s.host
        assert meter.stages[0].total == 0  # the host copy is not device memory
        del s
        again = swap.Swapped(x)
    assert again.host is host
