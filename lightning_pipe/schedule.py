"""Schedules: the order in which (micro-batch, stage) tasks run."""

from collections.abc import Iterator

__all__ = ["clock_cycles"]


def clock_cycles(num_microbatches: int, num_stages: int) -> Iterator[list[tuple[int, int]]]:
    """GPipe's forward clock: at tick ``k`` stage ``j`` runs micro-batch ``k - j``.

    Within a tick the tasks touch different stages, so they could run concurrently; run in
    the listed order they give every device a fixed task order.
    """
    for k in range(num_microbatches + num_stages - 1):
        first = max(0, k - num_microbatches + 1)
        yield [(k - j, j) for j in range(first, min(k + 1, num_stages))]
