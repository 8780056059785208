"""Real FSDP2 on CPU: per-rank peak bytes of training steps of a block model sharded by
``fully_shard`` over one gloo group, counted from the CPU allocator's events (CPU has no
allocator statistics): what :mod:`lightning_pipe.plan.sharding`'s prediction is checked against.
Spawned by ``tests/plan/test_sharding.py``; each rank writes its peaks to ``out/rank{r}.json``."""

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.internals import start_memory_events, stop_memory_events

WIDTH, HIDDEN, BLOCKS, ROWS = 1024, 4096, 3, 64


class Blocks(nn.Module):
    """Blocks of two linear layers, the loss in ``forward`` (one graph output, a scalar)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH)) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def batch() -> Tensor:
    return torch.randn(ROWS, WIDTH)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), foreach=False)


def rank(index: int, world: int, out: str, port: int) -> None:
    """One rank: per ``reshard_after_forward``, its peak (:func:`peak`), in ``out/rank{index}.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=index, world_size=world)
    peaks = {str(reshard): peak(reshard) for reshard in (True, False)}
    Path(out, f"rank{index}.json").write_text(json.dumps(peaks))
    dist.destroy_process_group()


def peak(reshard: bool) -> int:
    """Shard each block and then the whole model, run two steps, and return the second's peak
    of live bytes (the first makes the optimizer's state)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Blocks()
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    adam = optimizer(model)
    x = batch()
    for _ in range(2):
        live = _live(model, adam) + x.untyped_storage().nbytes()
        start_memory_events()
        model(x).backward()
        adam.step()
        adam.zero_grad(set_to_none=True)
        events = stop_memory_events()
    return live + _peak(events)


def _live(model: nn.Module, adam: torch.optim.Optimizer) -> int:
    """Bytes of the storages the model and optimizer hold between steps (each once)."""
    tensors: list[Tensor] = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    tensors += [s.to_local() if hasattr(s, "to_local") else s
                for state in adam.state.values() for s in state.values() if isinstance(s, Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _peak(threads: list[list[Any]]) -> int:
    """The highest sum of the allocations and frees recorded, in time order (each thread's
    events are; ``cpu_elapsed_us(first)`` counts back from the first event)."""
    first = threads[0][0]
    events = sorted((e for thread in threads for e in thread if e.cpu_memory_usage()),
                    key=lambda e: -e.cpu_elapsed_us(first))
    total = peak = 0
    for change in (e.cpu_memory_usage() for e in events):
        total += change
        peak = max(peak, total)
    return peak
