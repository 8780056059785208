"""Partition: how many consecutive graph nodes each stage gets (a ``balance``).

A balance is the hand-over format between whoever decides the split (the user, the
even-by-parameters default here, a planner) and :mod:`lightning_pipe.runtime.build`.
"""

import bisect
import itertools
from collections.abc import Sequence

__all__ = ["balance_by_weight", "check_balance", "check_stage_count"]


def check_balance(balance: Sequence[int], num_nodes: int, num_stages: int) -> list[int]:
    """Validate a user or planner balance against the graph and the stage devices."""
    balance = list(balance)
    check_stage_count(num_nodes, num_stages)
    if len(balance) != num_stages:
        raise ValueError(
            f"balance has {len(balance)} entries but there are {num_stages} stage devices. "
            f"Give one node count per device."
        )
    if any(b < 1 for b in balance):
        raise ValueError(f"balance {balance} has a stage with no nodes; every entry must be >= 1.")
    if sum(balance) != num_nodes:
        raise ValueError(
            f"balance {balance} sums to {sum(balance)} but the traced model has {num_nodes} "
            f"nodes. Make the entries sum to {num_nodes}, or leave balance=None for an even "
            f"split by parameter bytes."
        )
    return balance


def check_stage_count(num_nodes: int, num_stages: int) -> None:
    """Every stage needs at least one node. The stages are the devices' times the stages each
    holds (``virtual_stages``; two under ``"zbv"`` and ``"dualpipev"``): the fix names both."""
    if num_stages > num_nodes:
        raise ValueError(
            f"{num_stages} pipeline stages were requested but the traced model has only "
            f"{num_nodes} nodes to split. Use at most {num_nodes} stages: fewer devices, or fewer "
            f"stages per device (virtual_stages; schedule='zbv' and 'dualpipev' hold two), or split "
            f"leaf modules into finer ones (fewer `leaf_modules`)."
        )


def balance_by_weight(weights: Sequence[int], num_stages: int) -> list[int]:
    """Contiguous split of ``weights`` into ``num_stages`` non-empty parts minimising the
    heaviest part (binary search on the bound, greedy fill)."""
    check_stage_count(len(weights), num_stages)
    prefix = list(itertools.accumulate(weights, initial=0))

    def parts(bound: int, most: int = len(weights)) -> list[int]:
        """Greedy fill: each part takes nodes while its load stays within ``bound`` (at least
        one), each found by bisection on the prefix sums; stops past ``most`` parts."""
        sizes: list[int] = []
        start = 0
        while start < len(weights) and len(sizes) <= most:
            stop = max(start + 1, bisect.bisect_right(prefix, prefix[start] + bound) - 1)
            sizes.append(stop - start)
            start = stop
        return sizes

    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(parts(mid, num_stages)) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    sizes = parts(lo)
    # Fewer parts than stages: split the largest parts; a split never raises the maximum.
    while len(sizes) < num_stages:
        i = max(range(len(sizes)), key=lambda k: sizes[k])
        half = sizes[i] // 2
        sizes[i : i + 1] = [sizes[i] - half, half]
    return sizes
