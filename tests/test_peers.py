"""The peers' harness: its meter counts real bytes, and each peer really trains the model."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from benchmarks import peers
from benchmarks.peers import LR, ProcessMeter, pipelining_steps, sequential, sequential_data, torchgpipe_steps


def _trained(width: int, depth: int, batch: int, steps: int) -> tuple[nn.Sequential, ProcessMeter]:
    """Plain single-process SGD on the peers' model; the meter sees the last step."""
    model = sequential(width, depth)
    x, y = sequential_data(batch, width).tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    meter = ProcessMeter()
    meter.own(0, model.parameters())
    for i in range(steps):
        with meter:
            if i == steps - 1:
                meter.reset_peaks()
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model, meter


def test_process_meter_counts_live_storages_once():
    with ProcessMeter() as meter:
        a = torch.ones(1000)
        b = a + a  # (a Python scalar would add its own 0-dim tensor, which the allocator counts)
        view = b[10:]  # a view allocates nothing
        del a
    assert meter.peak == 8000
    assert meter.stages[0].total == 4000
    del b, view
    assert meter.stages[0].total == 0


def _forked(rank_fn, world, *args):
    """:func:`benchmarks.peers.spawn`'s ranks, forked: they start with this process's imports
    (torch, Lightning), a few seconds each that a spawned rank spends importing them again
    (``spawn`` itself starts the ranks of test_benchmarks.py's distributed benchmark)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(peers._gloo_rank, args=(world, port, rank_fn, args), nprocs=world, join=True,
                       start_method="fork")


@pytest.mark.slow
def test_pipelining_trains_like_one_process_and_reports_each_rank(monkeypatch):
    monkeypatch.setattr(peers, "spawn", _forked)
    width, depth, batch, steps = 16, 2, 8, 3
    result = pipelining_steps([3, 2], batch, chunks=4, steps=steps, warmup=1, width=width, depth=depth)

    reference, _ = _trained(width, depth, batch, steps)
    expected = reference.state_dict()
    assert sorted(result["state_dict"]) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(result["state_dict"][name], value, rtol=1e-5, atol=1e-7)
    assert len(result["step_ms"]) == steps and all(t > 0 for t in result["step_ms"])
    first_rank_params = sum(p.numel() * 4 for p in reference[:3].parameters())
    assert len(result["peaks"]) == 2 and result["peaks"][0] > first_rank_params


def test_torchgpipe_peak_counts_what_its_worker_threads_allocate():
    pytest.importorskip("torchgpipe")
    width, depth, batch = 64, 4, 256
    result = torchgpipe_steps(batch, chunks=4, stages=2, steps=2, warmup=1, width=width, depth=depth)

    params = sum(p.numel() * 4 for p in sequential(width, depth).parameters())
    stashed = depth * batch * width * 4  # hidden Linears' inputs of all micro-batches, held by GPipe
    # Forward runs in torchgpipe's worker threads: unmetered there, the peak would be ~params + grads.
    assert result["process_peak"] > params + stashed
    assert sum(result["balance"]) == 2 * depth + 1
