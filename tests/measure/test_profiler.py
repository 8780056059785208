import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from examples.models import GPT, UNet
from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.profiler import FAKE_BYTES_PER_S, FAKE_FLOPS_PER_S, profile_graph
from lightning_pipe.plan.profile import Profile


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.l1 = nn.Linear(32, 4)

    def forward(self, x):
        return self.l1(self.act(self.l0(x)))


def test_bytes_of_a_small_mlp_are_exact():
    torch.manual_seed(0)
    model = MLP()
    p = profile_graph(capture(model), (torch.randn(8, 16),), optimizer=torch.optim.Adam(model.parameters()))
    l0, act, l1 = p.nodes
    assert [n.name for n in p.nodes] == ["l0", "act", "l1"]
    assert l0.output_bytes == act.output_bytes == 8 * 32 * 4 and l1.output_bytes == 8 * 4 * 4
    # ReLU keeps its result (which l1 also saves): counted once, at the node that made it.
    assert (l0.saved_bytes, act.saved_bytes, l1.saved_bytes) == (0, 8 * 32 * 4, 0)
    assert l0.param_bytes == l0.grad_bytes == (16 * 32 + 32) * 4
    assert l0.optimizer_bytes == 2 * l0.param_bytes + 2 * 4  # exp_avg, exp_avg_sq, a step per tensor
    assert [n.users for n in p.nodes] == [[1], [2], [-1]]
    assert p.input_bytes == 8 * 16 * 4 and p.input_users == [0]
    assert l1.output_grad_bytes == 8 * 4 * 4 and l1.backward_bytes >= l1.grad_bytes
    assert p.microbatch_size == 8 and p.dtype == "torch.float32" and p.device == "cpu"
    assert all(n.forward_ms > 0 for n in p.nodes) and l0.backward_ms > 0


def test_profiling_leaves_the_model_alone():
    model = UNet()
    captured = capture(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3, 16, 16)
    rng = torch.get_rng_state()
    profile_graph(captured, (x,))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(rng, torch.get_rng_state())


def test_json_round_trip(tmp_path):
    model = GPT(layers=1)
    p = profile_graph(capture(model), ({"input_ids": torch.randint(96, (2, 16))},), repeats=1)
    p.save(tmp_path / "profile.json")
    assert Profile.load(tmp_path / "profile.json") == p


def test_profile_at_b_predicts_bytes_at_2b():
    model = GPT(dim=64, context=32, layers=2)
    captured = capture(model)
    ids = torch.randint(96, (8, 32))
    small = profile_graph(captured, ({"input_ids": ids[:4]},), repeats=1)
    large = profile_graph(captured, ({"input_ids": ids},), repeats=1)
    predicted = small.scaled(8)
    assert predicted.microbatch_size == 8
    # Activations scale with the batch; the few batch-independent values (the causal mask,
    # the positional-embedding slice) are scaled too, a small over-estimate.
    for field, tolerance in [("saved_bytes", 0.01), ("output_bytes", 0.01), ("output_grad_bytes", 0.01),
                             ("transient_bytes", 0.1), ("backward_bytes", 0.1)]:
        want = sum(getattr(n, field) for n in large.nodes)
        assert sum(getattr(n, field) for n in predicted.nodes) == pytest.approx(want, rel=tolerance)
    assert [n.param_bytes for n in predicted.nodes] == [n.param_bytes for n in large.nodes]
    assert predicted.input_bytes == large.input_bytes
    with pytest.raises(ValueError, match="microbatch_size must be >= 1"):
        small.scaled(0)


def test_fake_tensors_give_the_same_bytes_without_running():
    model = GPT(dim=32, layers=2)
    captured = capture(model)
    sample = ({"input_ids": torch.randint(96, (4, 16))},)
    real = profile_graph(captured, sample, repeats=1)
    fake = profile_graph(captured, sample, fake=True)
    assert fake.fake and not real.fake
    fields = ("output_bytes", "saved_bytes", "transient_bytes", "backward_bytes", "param_bytes")
    for r, f in zip(real.nodes, fake.nodes):
        assert [getattr(r, k) for k in fields] == [getattr(f, k) for k in fields]


def test_fake_times_are_estimated_from_flops_and_bytes():
    """A planner given no times would find every cut balanced and every recompute free."""
    model = MLP()
    l0, act, _ = profile_graph(capture(model), (torch.randn(8, 16),), fake=True).nodes

    def ms(flops, nbytes):
        return 1e3 * (flops / FAKE_FLOPS_PER_S + 2 * nbytes / FAKE_BYTES_PER_S)

    assert l0.forward_ms == pytest.approx(ms(2 * 8 * 16 * 32, 8 * 32 * 4))  # a product, its output
    assert act.forward_ms == pytest.approx(ms(0, 8 * 32 * 4))
    assert l0.backward_ms == pytest.approx(2 * l0.forward_ms)

    class Attention(nn.Module):  # on the CPU, a kernel torch's FLOP counter has no formula for
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q).flatten(-2)

    attention, flat = profile_graph(capture(Attention()), (torch.randn(2, 4, 16, 8),), fake=True).nodes
    assert attention.forward_ms > ms(2 * 2 * 4 * 16 * 16 * (8 + 8), 0) > 0
    assert flat.forward_ms == 0.0  # a view allocates nothing


def test_optimizer_bytes_of_an_optimizer_whose_defaults_its_init_does_not_take():
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters())  # defaults hold decoupled_weight_decay
    l0 = profile_graph(capture(model), (torch.randn(8, 16),), optimizer=optimizer, fake=True).nodes[0]
    assert l0.optimizer_bytes == 2 * l0.param_bytes + 2 * 4


def test_node_times_are_taken_on_the_node_s_device_stream(monkeypatch):
    from lightning_pipe.measure import profiler

    devices = []
    current_stream = profiler.current_stream
    monkeypatch.setattr(profiler, "current_stream", lambda device: (devices.append(device), current_stream(device))[1])
    ms = profiler._median_ms(lambda: time.sleep(0.005), torch.device("meta"), repeats=3, warmup=1)
    assert devices == [torch.device("meta")] and ms >= 4


@pytest.mark.cuda
def test_node_times_on_a_device_that_is_not_the_current_one():
    from lightning_pipe.measure import profiler

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    x = torch.randn(2048, 2048, device="cuda:1")
    with torch.cuda.device(0):
        ms = profiler._median_ms(lambda: x @ x, torch.device("cuda", 1), repeats=3, warmup=1)
    assert ms > 0.01  # events on cuda:0's stream would see none of cuda:1's work


def test_tied_weights_are_recorded_and_their_copy_charged_to_the_borrowing_stage(tmp_path):
    from lightning_pipe.plan.memory import CostModel

    model = GPT(layers=1)
    captured = capture(model)
    p = profile_graph(captured, ({"input_ids": torch.randint(96, (2, 16))},), repeats=1)
    names = [n.name for n in p.nodes]
    emb, head = names.index("tok_emb"), names.index("head")
    weight = model.tok_emb.weight.numel() * 4
    assert [(s.nbytes, s.users) for s in p.shared] == [(weight, [emb, head])]
    costs, n = CostModel(p), len(p.nodes)
    assert costs.borrowed(head, n) == weight  # a stage with the head but not the embedding keeps a copy
    assert costs.borrowed(0, n) == costs.borrowed(0, head) == 0
    assert costs.static(head, n) == CostModel(replace(p, shared=[])).static(head, n) + weight
    p.save(tmp_path / "profile.json")
    assert Profile.load(tmp_path / "profile.json").shared == p.shared
