"""How long profiling takes: a 1,000-node graph on this machine's CPU.

    python -m benchmarks.profile_speed
"""

import time

import torch
from torch import nn

from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.profiler import profile_graph


class Deep(nn.Module):
    """``blocks`` residual blocks of four graph nodes each: linear, relu, scale, add."""

    def __init__(self, blocks: int, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.relu(layer(x)) * 0.5
        return x


def main() -> None:
    torch.manual_seed(0)
    model = Deep(blocks=250)
    captured = capture(model)
    sample = (torch.randn(32, 64),)
    optimizer = torch.optim.Adam(model.parameters())
    start = time.perf_counter()
    profile = profile_graph(captured, sample, optimizer=optimizer)
    seconds = time.perf_counter() - start
    print(f"nodes: {len(profile.nodes)}; profile_graph (1 warm-up + 3 timed runs per node): {seconds:.2f} s")
    print(f"target: under 60 s -> {'met' if seconds < 60 else 'MISSED'}")


if __name__ == "__main__":
    main()
