import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from examples.models import GPT, UNet
from lightning_pipe.graph.capture import capture
from lightning_pipe.measure.profiler import profile_graph
from lightning_pipe.plan.devices import DEVICES
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


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.act, self.l1 = nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 4)

    def forward(self, x):
        h = self.l0(x)
        h.mul_(2.0)  # the linear keeps its input, not its output: free to change
        return self.l1(self.act(h).view(8, 32))


def test_in_place_nodes_are_timed_forward_and_backward():
    """Each node runs on fresh leaf copies of its inputs; an in-place one (ReLU(inplace=True),
    mul_) would write to a leaf that requires grad, which autograd refuses: it writes to a copy."""
    torch.manual_seed(0)
    model = _InPlace()
    p = profile_graph(capture(model), (torch.randn(8, 16),))
    assert [n.name for n in p.nodes] == ["l0", "mul_", "act", "view", "l1"]
    by_name = {n.name: n for n in p.nodes}
    assert by_name["act"].backward_ms > 0 and by_name["mul_"].backward_ms > 0 and by_name["act"].forward_ms > 0


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
                             ("made_bytes", 0.01), ("held_bytes", 0.01), ("backward_bytes", 0.1)]:
        want = sum(getattr(n, field) for n in large.nodes)
        assert sum(getattr(n, field) for n in predicted.nodes) == pytest.approx(want, rel=tolerance), field
    # the forward's workspace beyond what a node leaves: a few scalars here, whatever the batch
    assert sum(n.transient_bytes for n in predicted.nodes) <= 64
    assert [n.param_bytes for n in predicted.nodes] == [n.param_bytes for n in large.nodes]
    assert predicted.input_bytes == large.input_bytes
    with pytest.raises(ValueError, match="microbatch_size must be >= 1"):
        small.scaled(0)


def test_fake_tensors_give_the_same_bytes_without_running():
    model = GPT(dim=32, layers=2)
    captured = capture(model)
    sample = ({"input_ids": torch.randint(96, (4, 16))},)
    optimizer = torch.optim.Adam(model.parameters())  # a fake profile steps it on meta copies of the parameters
    real = profile_graph(captured, sample, repeats=1, optimizer=optimizer)
    fake = profile_graph(captured, sample, fake=True, optimizer=optimizer)
    assert fake.fake and not real.fake
    fields = ("output_bytes", "saved_bytes", "transient_bytes", "backward_bytes", "param_bytes", "optimizer_bytes",
              "step_bytes")
    for r, f in zip(real.nodes, fake.nodes):
        assert [getattr(r, k) for k in fields] == [getattr(f, k) for k in fields]


def test_fake_times_are_each_node_s_roofline_on_the_device():
    """A planner given no times would find every cut balanced and every recompute free."""
    n, a100 = 4096, DEVICES["A100-40GB"]
    model = nn.Sequential(nn.Linear(n, n, bias=False), nn.ReLU())
    x = torch.randn(n, n)
    matmul, relu = profile_graph(capture(model), (x,), fake=True, device=a100).nodes
    # compute-bound: 2n³ FLOPs at FP32's 19.5 TFLOP/s (7.05 ms) outlast 3n² floats at 1,555 GB/s (0.13 ms)
    assert matmul.forward_ms == pytest.approx(1e3 * 2 * n**3 / 19.5e12)
    assert matmul.backward_ms == pytest.approx(matmul.forward_ms)  # the weight's gradient: one product as large
    # memory-bound: ReLU reads n² floats and writes n²; its backward reads the gradient and its output
    assert relu.forward_ms == pytest.approx(1e3 * 2 * n * n * 4 / 1555e9)
    assert relu.backward_ms == pytest.approx(1e3 * 3 * n * n * 4 / 1555e9)

    half = nn.Sequential(nn.Linear(n, n, bias=False), nn.ReLU()).to(torch.bfloat16)
    matmul, relu = profile_graph(capture(half), (x.to(torch.bfloat16),), fake=True, device=a100).nodes
    assert matmul.forward_ms == pytest.approx(1e3 * 2 * n**3 / 312e12)
    assert relu.forward_ms == pytest.approx(1e3 * 2 * n * n * 2 / 1555e9)

    class Attention(nn.Module):  # for an A100: its memory-efficient kernel (fp32)
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, q):
            q = q * self.scale
            return torch.nn.functional.scaled_dot_product_attention(q, q, q).flatten(-2)

    _, attention, flat = profile_graph(capture(Attention()), (torch.randn(1, 2, 1024, 64),), fake=True).nodes
    products = 2 * 2 * 1024 * 1024 * (64 + 64)  # q kᵀ and its product with v: bound by FP32 math at this size
    assert attention.forward_ms == pytest.approx(1e3 * products / 19.5e12)
    # five products (the fused kernel computes q kᵀ again), and the gradients of q, k and v (one
    # tensor here) summed: two additions of 512 KiB
    assert attention.backward_ms == pytest.approx(2.5 * attention.forward_ms + 1e3 * 2 * 3 * 2**19 / 1555e9)
    # the kernel's output lies (batch, seq, heads, dim) in memory, as on the GPU: flattening the
    # heads of its (batch, heads, seq, dim) view copies it (512 KiB read and written); its backward is a view
    assert flat.forward_ms == pytest.approx(1e3 * 2 * 2**19 / 1555e9) and flat.backward_ms == 0.0

    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # float32 products in TF32: off by default
    try:
        matmul = profile_graph(capture(model), (x,), fake=True, device=a100).nodes[0]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert matmul.forward_ms == pytest.approx(1e3 * 2 * n**3 / 156e12)


def test_measured_times_are_shared_out_by_work_so_only_their_total_varies(monkeypatch):
    """Two profiles time every node anew; the planner's node times differ between them by one
    factor, which no comparison of splits, or of recompute against keeping, can see."""
    from lightning_pipe.measure import profiler

    torch.manual_seed(0)
    captured = capture(GPT(layers=2))
    batch = {"input_ids": torch.randint(96, (4, 16))}
    jitter = iter(range(1, 10**6))  # every node and direction measured differently, as noise does
    elapsed_ms = profiler.elapsed_ms  # one repeat: each time measured is one elapsed time
    monkeypatch.setattr(profiler, "elapsed_ms", lambda *a: elapsed_ms(*a) * (1 + next(jitter) % 7 / 10))
    a, b = (profile_graph(captured, (batch,), repeats=1, warmup=0).nodes for _ in range(2))
    ratios = [getattr(y, f) / getattr(x, f) for x, y in zip(a, b) for f in ("forward_ms", "backward_ms")
              if getattr(x, f) > 0]
    assert len(ratios) > len(a)  # forwards and backwards: one factor for all of them
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)
    # a node doing more work gets more of the total: the head's product against the embedding's lookup
    head, lookup = next(n for n in a if n.name == "head"), next(n for n in a if n.name == "tok_emb")
    assert head.forward_ms > 3 * lookup.forward_ms


def test_optimizer_bytes_of_an_optimizer_whose_defaults_its_init_does_not_take():
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters())  # defaults hold decoupled_weight_decay
    l0 = profile_graph(capture(model), (torch.randn(8, 16),), optimizer=optimizer, fake=True).nodes[0]
    assert l0.optimizer_bytes == 2 * l0.param_bytes + 2 * 4


class Sleep(nn.Module):
    def forward(self, x):
        time.sleep(0.005)
        return x


class TwoDevices(nn.Module):
    """A node on the CPU, then one that sleeps, beside a node on the meta device."""

    def __init__(self):
        super().__init__()
        self.on_cpu = nn.Linear(4, 4)
        self.pause = Sleep()
        self.on_meta = nn.Linear(4, 4, device="meta")

    def forward(self, x, y):
        return self.pause(self.on_cpu(x)), self.on_meta(y)


def test_node_times_are_taken_on_the_node_s_device_stream(monkeypatch):
    from lightning_pipe.measure import profiler

    devices = []
    current_stream = profiler.current_stream
    monkeypatch.setattr(profiler, "current_stream", lambda device: (devices.append(device), current_stream(device))[1])
    captured = capture(TwoDevices(), ["Sleep"])
    assert [n.name for n in captured.nodes] == ["on_cpu", "pause", "on_meta"]
    p = profile_graph(captured, (torch.randn(2, 4), torch.randn(2, 4, device="meta")), repeats=3, warmup=1)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert devices == [cpu, cpu, cpu, cpu, meta, meta]  # each node's forward and backward, on its device
    assert sum(n.forward_ms + n.backward_ms for n in p.nodes) >= 4  # the wall clock: the sleep is in the total


@pytest.mark.cuda
def test_node_times_on_a_device_that_is_not_the_current_one():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    model = nn.Linear(2048, 2048, bias=False, device="cuda:1")
    x = torch.randn(2048, 2048, device="cuda:1")
    with torch.cuda.device(0):
        (node,) = profile_graph(capture(model), (x,), repeats=3, warmup=1).nodes
    assert node.forward_ms > 0.01  # events on cuda:0's stream would see none of cuda:1's work


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


class Residual(nn.Module):
    def __init__(self, subtract: bool):
        super().__init__()
        self.subtract = subtract
        self.inner = nn.Linear(8, 8)
        self.outer = nn.Linear(8, 8)

    def forward(self, x):
        h = self.inner(x)
        return self.outer(h - self.outer(h) if self.subtract else h + self.outer(h))


@pytest.mark.parametrize("subtract", [False, True])
def test_an_add_hands_its_output_gradient_to_both_values_it_reads(subtract):
    # add's backward gives both inputs its output's gradient tensor; sub negates one
    p = profile_graph(capture(Residual(subtract)), (torch.randn(4, 8),), repeats=1)
    names = [n.name for n in p.nodes]
    join = p.nodes[names.index("sub" if subtract else "add")]
    inner, outer = names.index("inner"), names.index("outer")
    assert join.forwarded_grads == ([inner] if subtract else sorted([inner, outer]))


class _Skip(nn.Module):
    """A value read by a pooling and again by a ``cat`` further on (a U-Net's skip)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x) * 2
        u = nn.functional.interpolate(nn.functional.avg_pool2d(y, 2), scale_factor=2)
        return torch.cat([u, y], 1)


def test_a_backward_frees_what_it_saved_before_its_gradient_is_summed():
    # avg_pool2d saves its input y; the cat's gradient for y arrives first, so autograd sums
    # the pooling's gradient into a new buffer, once the pooling's backward has freed y: in
    # training its backward holds one gradient of y at a time (the profiler's own references
    # to the forward's values made it two; the U-Net's stage 0 was over-predicted by 7-10%)
    x = torch.randn(4, 2, 8, 8)
    p = profile_graph(capture(_Skip()), (x,))
    pool = next(n for n in p.nodes if n.name == "avg_pool2d")
    y_bytes = 4 * 4 * 8 * 8 * 4
    assert pool.saved_bytes == y_bytes
    assert pool.backward_bytes == y_bytes


@pytest.mark.parametrize("foreach", [False, True])
def test_an_optimizer_steps_temporaries_are_measured_per_parameter_or_per_group(foreach):
    """For-loop Adam holds, for one parameter at a time, its second moment's square root and
    that divided by the bias correction; foreach Adam holds the square roots of every
    parameter it steps at once (the default on GPUs)."""
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), foreach=foreach)
    p = profile_graph(capture(model), (torch.randn(8, 16),), optimizer=optimizer, fake=True)
    l0, act, l1 = p.nodes
    assert p.step_grouped == foreach and act.step_bytes == 0
    for node, (weight, bias) in ((l0, (16 * 32 * 4, 32 * 4)), (l1, (32 * 4 * 4, 4 * 4))):
        assert node.step_bytes == (weight + bias if foreach else 2 * weight)


def test_autocasts_copies_of_parameters_are_kept_not_scaled_with_the_micro_batch():
    # under bf16 autocast a linear layer saves its weight's bf16 copy per micro-batch, whatever its size
    from examples.models import GPT

    model = GPT(layers=1, dim=64)
    captured = capture(model.train())

    def profiled(size):
        ids = torch.zeros(size, 16, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            return profile_graph(captured, ({"input_ids": ids},), repeats=1, warmup=0, fake=True)

    small, large = profiled(1), profiled(16)
    qkv = next(n for n in small.nodes if n.name == "blocks_0_attn_qkv")
    assert qkv.cast_bytes == 64 * 192 * 2  # the weight's bf16 copy (the bias's is not kept)
    scaled = small.scaled(16)
    predicted, measured = (sum(n.saved_bytes for n in p.nodes) for p in (scaled, large))
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)  # scaling the copies too: +198%


class _Encoder(nn.Module):
    """A linear, then a whole ``nn.TransformerEncoder`` of two layers: one graph node when
    captured with ``leaf_modules=["encoder"]``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.l0 = nn.Linear(width, width)
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(self.l0(x))


def test_a_node_of_several_layers_holds_one_functions_fresh_gradients_at_once():
    """A backward adding to ``.grad`` frees each function's fresh parameter gradients before
    the next runs: a node holding two encoder layers holds the largest one's (the attention's
    input projection's weight: on the transposed batch-first input it is a matmul and an add,
    whose bias gradient is added to ``.grad`` first), not all of its gradients (over-predicted
    by up to 19% on ``nn.TransformerDecoder``); a linear node (one ``addmm``) holds its
    weight's and bias's together."""
    width = 16
    model = _Encoder(width)
    l0, encoder = profile_graph(capture(model, ["encoder"]), (torch.randn(4, 8, width),), repeats=1, warmup=0).nodes
    assert encoder.name == "encoder" and encoder.grad_bytes == 2 * sum(
        p.numel() * 4 for p in model.encoder.layers[0].parameters())
    assert encoder.fresh_grad_bytes == 3 * width * width * 4
    assert l0.fresh_grad_bytes == l0.grad_bytes == (width * width + width) * 4
