"""Memory model: predict each stage's peak bytes from a profile, a split and a schedule.

    peak(stage) = static + in_flight * stashed + transient + boundary

static: parameters, gradients and optimizer state the stage owns; stashed: activation bytes
one micro-batch leaves for backward; in_flight: micro-batches whose activations a schedule
holds at once (GPipe: all of them); transient: the largest node workspace; boundary: the
stage's inputs and outputs of one micro-batch that are not already stashed.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.profile import Profile

__all__ = ["StagePeak", "predict_peaks", "stage_ranges"]


@dataclass
class StagePeak:
    """A stage's predicted peak, split by kind (bytes)."""

    static: int
    activations: int
    transient: int
    boundary: int

    @property
    def total(self) -> int:
        return self.static + self.activations + self.transient + self.boundary


def stage_ranges(balance: Sequence[int]) -> list[range]:
    """Node index ranges of the stages of a balance."""
    ranges, start = [], 0
    for count in balance:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def predict_peaks(profile: Profile, balance: Sequence[int], in_flight: Sequence[int]) -> list[StagePeak]:
    """Predicted peak of every stage; ``in_flight[s]`` micro-batches hold activations at once."""
    peaks = []
    for s, nodes in enumerate(stage_ranges(balance)):
        costs = [profile.nodes[i] for i in nodes]
        static = sum(n.param_bytes + n.grad_bytes + n.optimizer_bytes for n in costs)
        stashed = sum(n.saved_bytes for n in costs)
        transient = max(n.transient_bytes for n in costs)
        peaks.append(StagePeak(static, in_flight[s] * stashed, transient, _boundary(profile, nodes)))
    return peaks


def _boundary(profile: Profile, nodes: range) -> int:
    """Bytes of one micro-batch's values leaving the stage that are not stashed anyway."""
    out = 0
    for i in nodes:
        n = profile.nodes[i]
        if any(u >= nodes.stop or u < 0 for u in n.users):
            out += max(0, n.output_bytes - n.saved_bytes)
    return out
