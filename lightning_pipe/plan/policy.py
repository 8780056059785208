"""Memory policies: where a node's saved bytes live between its forward and its backward.

``keep`` (on the device), ``swap`` (in host memory, brought back for the backward) or
``recompute`` (dropped, rebuilt by running the forward again). The one definition the
planner, the runtime and the CLI share.
"""

from collections.abc import Iterator, Mapping
from typing import Literal, TypeAlias, get_args

import numpy as np

__all__ = ["POLICIES", "CodedPolicies", "Policy", "chosen_codes", "policy_codes"]

Policy = Literal["keep", "recompute", "swap"]
#: Every policy, in code order: a node's code is its policy's index (0 keep, 1 recompute, 2 swap).
POLICIES: tuple[Policy, ...] = get_args(Policy)
_CODE = {p: code for code, p in enumerate(POLICIES)}

Codes: TypeAlias = "np.ndarray[tuple[int], np.dtype[np.int8]]"  # per node, its policy's code


class CodedPolicies(Mapping[int, Policy]):
    """Non-``keep`` policies by node, held as every node's code: a search pricing one change
    at a time to hundreds of choices makes each variant by one array copy, not by a
    dictionary of them all."""

    def __init__(self, codes: Codes) -> None:
        self.codes = codes

    @classmethod
    def of(cls, policies: Mapping[int, Policy], n: int) -> "CodedPolicies":
        return policies if isinstance(policies, CodedPolicies) else cls(policy_codes(policies, n))

    def without(self, i: int) -> "CodedPolicies":
        """These policies with node ``i`` kept."""
        codes = self.codes.copy()
        codes[i] = 0
        return CodedPolicies(codes)

    def __getitem__(self, i: int) -> Policy:
        if not 0 <= i < self.codes.size or not self.codes[i]:
            raise KeyError(i)
        return POLICIES[int(self.codes[i])]

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self.codes).tolist())

    def __len__(self) -> int:
        return int(np.count_nonzero(self.codes))


def policy_codes(policies: Mapping[int, Policy], n: int) -> Codes:
    """Per node of ``n``, its policy's code (``policies`` maps the non-``keep`` ones)."""
    if isinstance(policies, CodedPolicies):
        return policies.codes
    codes = np.zeros(n, dtype=np.int8)
    if policies:
        nodes, chosen = chosen_codes(policies)
        codes[nodes] = chosen
    return codes


def chosen_codes(policies: Mapping[int, Policy]) -> "tuple[np.ndarray[tuple[int], np.dtype[np.int64]], Codes]":
    """The nodes ``policies`` maps and their policies' codes, as arrays."""
    nodes = np.fromiter(policies, dtype=np.int64, count=len(policies))
    return nodes, np.fromiter((_CODE[p] for p in policies.values()), dtype=np.int8, count=len(policies))
