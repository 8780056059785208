"""AmoebaNet-D (Real et al., 2019), the CNN of DawnPiper's and GPipe's benchmarks, for 224x224.

A stem (a strided convolution, then two reduction cells), three stacks of normal cells with a
reduction cell between them, and a classifier. Every cell reads the outputs of the two cells
before it, so a value crosses up to two cells: short skips, unlike a U-Net's long ones. Memory
falls cell by cell (the early cells are at high resolution) while compute stays level, which is
why a split balanced by time leaves the first stages full. The genotype is AmoebaNet-D's as
GPipe's implementation (TensorFlow's) has it: pairs of (the state an operation reads, the
operation); each pair of operations is summed into a new state, and the cell's output
concatenates some of its states.
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["AmoebaNetD"]

Operation = Callable[[int, int], nn.Module]  # (channels, stride) -> module


def _relu_conv_bn(cin: int, cout: int, kernel: int | tuple[int, int] = 1, stride: int | tuple[int, int] = 1,
                  padding: int | tuple[int, int] = 0) -> list[nn.Module]:
    return [nn.ReLU(), nn.Conv2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout)]


class _Halve(nn.Module):
    """Halves the resolution with two strided 1x1 convolutions, the second offset by a pixel
    (where a cell's earlier input is at twice the resolution of its other one)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.even = nn.Conv2d(cin, cout // 2, 1, stride=2, bias=False)
        self.odd = nn.Conv2d(cin, cout - cout // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(x)
        shifted = nn.functional.pad(x[:, :, 1:, 1:], (0, 1, 0, 1))
        return self.bn(torch.cat([self.even(x), self.odd(shifted)], dim=1))


def _identity(c: int, stride: int) -> nn.Module:
    return nn.Identity() if stride == 1 else _Halve(c, c)


def _avg_pool_3x3(c: int, stride: int) -> nn.Module:
    return nn.AvgPool2d(3, stride, padding=1, count_include_pad=False)


def _max_pool_3x3(c: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(3, stride, padding=1)


def _max_pool_2x2(c: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(2, stride)


def _conv_1x1(c: int, stride: int) -> nn.Module:
    return nn.Sequential(*_relu_conv_bn(c, c, 1, stride))


def _conv_3x3(c: int, stride: int) -> nn.Module:
    """A bottleneck: 1x1 down to a quarter of the channels, 3x3, 1x1 back up."""
    q = c // 4
    return nn.Sequential(*_relu_conv_bn(c, q), *_relu_conv_bn(q, q, 3, stride, 1), *_relu_conv_bn(q, c))


def _conv_1x7_7x1(c: int, stride: int) -> nn.Module:
    """A bottleneck whose 7x7 is factored into 1x7 then 7x1."""
    q = c // 4
    return nn.Sequential(*_relu_conv_bn(c, q), *_relu_conv_bn(q, q, (1, 7), (1, stride), (0, 3)),
                         *_relu_conv_bn(q, q, (7, 1), (stride, 1), (3, 0)), *_relu_conv_bn(q, c))


NORMAL: list[tuple[int, Operation]] = [
    (1, _conv_1x1), (1, _max_pool_3x3), (1, _identity), (0, _conv_1x7_7x1), (0, _conv_1x1),
    (0, _conv_1x7_7x1), (2, _max_pool_3x3), (2, _identity), (1, _avg_pool_3x3), (5, _conv_1x1),
]
NORMAL_CONCAT = [0, 3, 4, 6]
REDUCTION: list[tuple[int, Operation]] = [
    (0, _max_pool_2x2), (0, _max_pool_3x3), (2, _identity), (1, _conv_3x3), (2, _conv_1x7_7x1),
    (2, _max_pool_3x3), (3, _identity), (1, _max_pool_2x2), (2, _avg_pool_3x3), (3, _conv_1x1),
]
REDUCTION_CONCAT = [4, 5, 6]


class Cell(nn.Module):
    """One cell: its inputs brought to ``channels`` (and the earlier one to the later one's
    resolution), then the genotype's operations; a reduction cell halves the resolution."""

    def __init__(self, earlier: int, previous: int, channels: int, reduction: bool, after_reduction: bool) -> None:
        super().__init__()
        self.previous = nn.Sequential(*_relu_conv_bn(previous, channels))
        self.earlier: nn.Module = nn.Identity()
        if after_reduction:
            self.earlier = _Halve(earlier, channels)
        elif earlier != channels:
            self.earlier = nn.Sequential(*_relu_conv_bn(earlier, channels))
        genotype = REDUCTION if reduction else NORMAL
        self.reads = [state for state, _ in genotype]
        self.concat = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        self.ops = nn.ModuleList(op(channels, 2 if reduction and state < 2 else 1) for state, op in genotype)

    @property
    def out_channels(self) -> int:
        return len(self.concat) * self.previous[1].out_channels

    def forward(self, previous: Tensor, earlier: Tensor) -> Tensor:
        states = [self.previous(previous), self.earlier(earlier)]
        for k in range(0, len(self.ops), 2):
            a, b = self.reads[k], self.reads[k + 1]
            states.append(self.ops[k](states[a]) + self.ops[k + 1](states[b]))
        return torch.cat([states[i] for i in self.concat], dim=1)


class AmoebaNetD(nn.Module):
    """AmoebaNet-D with ``normal`` normal cells per stack and ``filters`` channels at its first
    stack (GPipe's (L, D)); 1000 classes."""

    def __init__(self, normal: int = 6, filters: int = 208, classes: int = 1000) -> None:
        super().__init__()
        channels = filters // 4
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(channels))
        cells: list[Cell] = []
        earlier = previous = channels
        after_reduction = False
        plan = [True, True] + ([False] * normal + [True]) * 2 + [False] * normal
        for reduction in plan:
            channels *= 2 if reduction else 1
            cell = Cell(earlier, previous, channels, reduction, after_reduction)
            cells.append(cell)
            earlier, previous, after_reduction = previous, cell.out_channels, reduction
        self.cells = nn.ModuleList(cells)
        self.head = nn.Linear(previous, classes)

    def forward(self, image: Tensor) -> Tensor:
        previous = earlier = self.stem(image)
        for cell in self.cells:
            previous, earlier = cell(previous, earlier), previous
        return self.head(previous.mean(dim=(2, 3)))
