import random

from lightning_pipe.plan.memory import CostModel, predict_peaks, stage_ranges
from lightning_pipe.plan.profile import NodeProfile, Profile


def node(i, saved, out=None, params=0, transient=0, users=None, f=1.0, backward=0):
    out = saved if out is None else out
    return NodeProfile(f"n{i}", f, 2 * f, out, saved, transient, params, params, 2 * params, users=users or [i + 1],
                       backward_bytes=backward)


def random_profile(n, seed):
    rnd = random.Random(seed)
    nodes = []
    for i in range(n):
        users = sorted({i + 1, min(n - 1, i + rnd.randint(1, 4))}) if i < n - 1 else [-1]
        if rnd.random() < 0.1:
            users.append(-1)
        nodes.append(node(i, rnd.randint(0, 900), rnd.randint(0, 900), rnd.randint(0, 50), rnd.randint(0, 300), users,
                          backward=rnd.randint(0, 300)))
    return Profile(nodes, "cpu", "float32", 4, input_bytes=100, input_users=[0])


def reference(profile, balance, in_flight):
    """The formula as first written: a direct sum per stage; the workspace is a node's
    forward or backward one, whichever is larger (the stage's stash is alive in both)."""
    out = []
    for s, r in enumerate(stage_ranges(balance)):
        ns = [profile.nodes[i] for i in r]
        static = sum(n.param_bytes + n.grad_bytes + n.optimizer_bytes for n in ns)
        stashed = sum(n.saved_bytes for n in ns)
        boundary = sum(
            max(0, n.output_bytes - n.saved_bytes) for n in ns if any(u >= r.stop or u < 0 for u in n.users)
        )
        workspace = max(max(n.transient_bytes, n.backward_bytes) for n in ns)
        out.append(static + in_flight[s] * stashed + workspace + boundary)
    return out


def test_all_kept_peaks_equal_the_direct_formula():
    for seed in range(5):
        profile = random_profile(23, seed)
        for balance in ([23], [5, 9, 9], [1, 1, 20, 1], [7, 3, 6, 4, 3]):
            flight = list(range(len(balance), 0, -1))
            assert [p.total for p in predict_peaks(profile, balance, flight)] == reference(profile, balance, flight)


def test_range_queries_match_brute_force():
    profile = random_profile(30, 7)
    model = CostModel(profile)
    for lo in range(30):
        for hi in range(lo + 1, 31):
            ns = profile.nodes[lo:hi]
            assert model.transient(lo, hi) == max(max(n.transient_bytes, n.backward_bytes) for n in ns)
            assert model.stashed(lo, hi) == sum(n.saved_bytes for n in ns)
            leaving = [n for n in ns if any(u >= hi or u < 0 for u in n.users)]
            assert model.boundary(lo, hi) == sum(max(0, n.output_bytes - n.saved_bytes) for n in leaving)
            balance = [b for b in (lo, hi - lo, 30 - hi) if b]
            stage = 1 if lo else 0
            expected = reference(profile, balance, [3] * len(balance))[stage]
            assert model.peak(lo, hi, 3).total == expected


def test_2bw_keeps_a_second_copy_of_the_parameters():
    profile = Profile([node(0, 10, params=100), node(1, 10, params=50, users=[-1])], "cpu", "f", 1)
    one = predict_peaks(profile, [2], [1])[0]
    two = predict_peaks(profile, [2], [1], weight_versions=2)[0]
    assert two.static - one.static == 150
    assert (two.activations, two.transient, two.boundary) == (one.activations, one.transient, one.boundary)


def chain():
    # saved bytes 100, 200, 300, 400; node 0's output (50 bytes) is half-stashed by itself.
    nodes = [node(0, 100, out=150), node(1, 200), node(2, 300), node(3, 400, users=[-1])]
    return Profile(nodes, "cpu", "f", 1, input_bytes=70, input_users=[0])


def test_swap_moves_saved_bytes_off_the_device():
    profile = chain()
    keep = predict_peaks(profile, [4], [3])[0]
    swap = predict_peaks(profile, [4], [3], ["keep", "swap", "swap", "keep"])[0]
    assert keep.activations - swap.activations == 3 * (200 + 300)
    assert swap.transient - keep.transient == 500  # a run of swapped nodes is loaded back at once


def test_recompute_region_stashes_only_its_inputs():
    profile = chain()
    keep = predict_peaks(profile, [4], [3])[0]
    rec = predict_peaks(profile, [4], [3], ["keep", "recompute", "recompute", "keep"])[0]
    # region {1, 2} drops 500 bytes and stashes what node 0 did not: 150 - 100 = 50
    assert keep.activations - rec.activations == 3 * (500 - 50)
    assert rec.transient - keep.transient == 500  # the whole region is rebuilt at once
    # a region at the stage start stashes the stage input
    first = predict_peaks(profile, [1, 3], [1, 1], ["keep", "recompute", "keep", "keep"])[1]
    assert first.activations == 300 + 400 + 150
    # two separate regions only ever rebuild one at a time
    split = predict_peaks(profile, [4], [1], ["keep", "recompute", "keep", "recompute"])[0]
    assert split.transient - keep.transient == 400
