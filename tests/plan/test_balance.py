import itertools
import random

import pytest

from lightning_pipe.plan.balance import balance_by_weight, check_balance


def _brute_force(weights, k):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balance_by_weight_is_optimal_and_non_empty(seed):
    rng = random.Random(seed)
    n = rng.randint(4, 10)
    k = rng.randint(1, min(n, 5))
    weights = [rng.choice([0, 0, 1, 5, 20, 100]) for _ in range(n)]
    balance = balance_by_weight(weights, k)
    assert len(balance) == k and all(b >= 1 for b in balance) and sum(balance) == n
    starts = [sum(balance[:i]) for i in range(k)] + [n]
    worst = max(sum(weights[a:b]) for a, b in itertools.pairwise(starts))
    assert worst == _brute_force(weights, k)


def test_balance_by_weight_all_zero_weights_still_uses_every_stage():
    balance = balance_by_weight([0] * 5, 3)
    assert len(balance) == 3 and sum(balance) == 5 and all(b >= 1 for b in balance)


def test_check_balance_errors_name_the_problem():
    with pytest.raises(ValueError, match="sums to 5 but the traced model has 6 nodes"):
        check_balance([2, 3], 6, 2)
    with pytest.raises(ValueError, match="3 entries but there are 2 stage devices"):
        check_balance([2, 2, 2], 6, 2)
    with pytest.raises(ValueError, match="8 pipeline stages were requested but the traced model has only 6"):
        check_balance([1] * 8, 6, 8)
    # (a V at pp=4 is 8 stages: "at most 6 devices" was no fix)
    with pytest.raises(ValueError, match=r"at most 6 stages: fewer devices, or fewer stages per device \(virtual_st"):
        check_balance([1] * 8, 6, 8)
    with pytest.raises(ValueError, match="every entry must be >= 1"):
        check_balance([0, 6], 6, 2)
    assert check_balance([2, 4], 6, 2) == [2, 4]
