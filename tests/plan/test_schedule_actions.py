import pytest

from lightning_pipe.plan.schedule import Action, actions, gradient_waits, in_flight, weight_versions


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
@pytest.mark.parametrize("m,L", [(1, 1), (3, 4), (4, 4), (8, 3)])
def test_every_stage_runs_each_task_once_forward_before_backward(schedule, m, L):
    lists = actions(schedule, m, L)
    assert len(lists) == L
    for s, order in enumerate(lists):
        assert all(a.stage == s for a in order)
        assert order[-1] == Action("update", -1, s)
        body = order[:-1]
        assert sorted((a.kind, a.microbatch) for a in body) == sorted(
            [("forward", i) for i in range(m)] + [("backward", i) for i in range(m)]
        )
        for i in range(m):
            assert body.index(Action("forward", i, s)) < body.index(Action("backward", i, s))


def test_gpipe_runs_all_forwards_then_backwards_in_reverse():
    order = actions("gpipe", 3, 2)[1]
    assert [(a.kind[0], a.microbatch) for a in order] == [
        ("f", 0), ("f", 1), ("f", 2), ("b", 2), ("b", 1), ("b", 0), ("u", -1)
    ]


def test_1f1b_warmup_then_alternate_then_cooldown():
    lists = actions("1f1b", 4, 3)
    assert [(a.kind[0], a.microbatch) for a in lists[0]] == [
        ("f", 0), ("f", 1), ("f", 2), ("b", 0), ("f", 3), ("b", 1), ("b", 2), ("b", 3), ("u", -1)
    ]
    assert [(a.kind[0], a.microbatch) for a in lists[2]] == [
        ("f", 0), ("b", 0), ("f", 1), ("b", 1), ("f", 2), ("b", 2), ("f", 3), ("b", 3), ("u", -1)
    ]
    assert actions("2bw", 4, 3) == lists


@pytest.mark.parametrize("m,L", [(1, 4), (3, 4), (4, 4), (9, 4), (5, 1)])
def test_in_flight_derived_from_the_orders(m, L):
    assert in_flight("gpipe", m, L) == [m] * L
    assert in_flight("1f1b", m, L) == [min(L - s, m) for s in range(L)]
    assert in_flight("2bw", m, L) == in_flight("1f1b", m, L)


def test_1f1b_holds_fewer_than_gpipe_once_chunks_exceed_stages():
    gpipe, one = in_flight("gpipe", 8, 4), in_flight("1f1b", 8, 4)
    assert all(a < b for a, b in zip(one, gpipe))


def test_weight_versions_and_bad_schedule():
    assert weight_versions("2bw") == 2 and weight_versions("1f1b") == 1 and weight_versions("gpipe") == 1
    with pytest.raises(ValueError, match="unknown schedule"):
        actions("zigzag", 2, 2)  # type: ignore[arg-type]


def test_gradient_waits_follow_the_in_flight_difference():
    # 1F1B: when stage s hands back micro-batch i's gradient, stage p < s still works through
    # the s - p micro-batches it started before i; GPipe hands every gradient straight on.
    for schedule in ("1f1b", "2bw"):
        assert gradient_waits(schedule, 8, 4) == tuple(tuple(max(0, s - p) for s in range(4)) for p in range(4))
    assert gradient_waits("1f1b", 2, 4) == tuple(tuple(min(1, max(0, s - p)) for s in range(4)) for p in range(4))
    assert gradient_waits("gpipe", 8, 4) == ((0,) * 4,) * 4
