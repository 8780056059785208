"""The planner's per-stage peaks against the meter's, stage by stage, on real training runs:
four model families, every schedule, with memory to spare (every activation kept) and under
a memory limit that makes the planner recompute, or, given a host link, swap."""

import functools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule

import lightning_pipe.lightning.local as strategy_module
from benchmarks.amoebanet import AmoebaNetD
from benchmarks.models import BERT, MaskedTokenDataset, suite
from examples.models import loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.plan.memory import predict_peaks, stage_ranges
from lightning_pipe.plan.partitioners import lowest_peak_balance
from lightning_pipe.plan.plan import (
    PLANNING_HEADROOM,
    PREDICTION_ERROR,
    InfeasiblePlanError,
    make_plan,
    max_microbatch,
    planning_stages,
)
from lightning_pipe.plan.request import PlanRequest
from tests.helpers import trainer
from tests.models import LossInside, Skipped, make

STAGES, CHUNKS, MICROBATCH, STEPS = 2, 4, 4, 2  # the second step is the steady one
TOLERANCE = 0.10
HOST_BANDWIDTH = 1e12  # fast enough that every swap hides behind compute: the planner swaps


def _family(name):
    """A small model of the family (two blocks or levels), seeded, and its data."""
    if name == "bert":
        torch.manual_seed(0)
        return BERT(dim=32, layers=2, context=16), MaskedTokenDataset(64, context=16)
    return make(name, **({"depth": 2} if name == "unet" else {"layers": 2}))


def _fit(name, strategy):
    model, data = _family(name)
    trainer(strategy, STAGES, max_steps=STEPS).fit(model, loader(data, MICROBATCH * CHUNKS))
    return strategy


@functools.cache
def _unlimited(name, schedule):
    """A planned run with memory to spare: every activation kept."""
    return _fit(name, MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, measure_memory=True))


@functools.cache
def _limited(name, schedule, host_bandwidth):
    """A planned run under a per-stage memory limit that no split fits with every activation
    kept: part of the way from the lowest peak any split reaches with memory optimisation to
    the lowest without, by the strategy's own profile (it plans to the limit, checked). Given a
    host link, closer to the latter, so that swaps, which keep their segment's inputs, suffice
    (and, where the planner's plan there swaps nothing, the nearest share at which it does)."""
    profile = _unlimited(name, schedule).profile
    # optimised as far as it goes
    least = planning_stages(profile, PlanRequest([1] * STAGES, schedule=schedule, chunks=CHUNKS))
    low = max(o.peak.total for o in least.placed(lowest_peak_balance(least)))
    kept = least.kept()  # below the peak of every stage kept whole, before what waits at it
    high = min(max(kept.lowest(r.start, r.stop, k) for k, r in enumerate(stage_ranges(lowest_peak_balance(kept)))),
               max(o.peak.total for o in kept.placed(lowest_peak_balance(kept))))
    assert low < high
    limit = int(low + (0.8 if host_bandwidth else 0.4) * (high - low))
    if host_bandwidth:  # swaps free less than recompute: where they cannot suffice, go higher
        limit = next((int(low + share * (high - low)) for share in (0.8, 0.9, 0.95, 0.6)
                      if _swaps(profile, schedule, int(low + share * (high - low)))), limit)
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, memory_limit=limit,
                                  host_bandwidth=host_bandwidth, measure_memory=True)
    return _fit(name, strategy)


def _swaps(profile, schedule, limit):
    """Whether the planner's plan swaps under ``limit`` (as the strategy plans), however fast
    the strategy's own profile finds the machine: swap is weighed against recompute by time,
    and a loaded CPU measures every node up to several times slower."""
    for speed in (1 / 4, 1, 4):
        nodes = [replace(n, forward_ms=n.forward_ms / speed, backward_ms=n.backward_ms / speed) for n in profile.nodes]
        try:
            plan = make_plan(replace(profile, nodes=nodes),
                             PlanRequest([limit] * STAGES, "dawnpiper", schedule, CHUNKS, HOST_BANDWIDTH))
        except InfeasiblePlanError:
            return False
        if "swap" not in plan.policies:
            return False
    return True


def _assert_within_tolerance(plan, metered):
    errors = [(s.peak.total - m) / max(m, 1) for s, m in zip(plan.stages, metered)]
    print("errors", plan.balance, [f"{e:+.1%}" for e in errors])
    assert max(map(abs, errors)) <= TOLERANCE, (plan.balance, [f"{e:+.1%}" for e in errors])
    # the planning headroom covers the worst under-prediction: a plan that fits its targets fits its limits
    assert all(m <= s.peak.total * (1 + PREDICTION_ERROR) for s, m in zip(plan.stages, metered))


@pytest.mark.slow
@pytest.mark.parametrize("memopt", ["off", "recompute", "swap"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
@pytest.mark.parametrize("name", ["gpt", "encdec", "unet", "bert"])
def test_predicted_stage_peaks_are_within_ten_percent_of_the_metered(name, schedule, memopt):
    if memopt == "off":
        strategy = _unlimited(name, schedule)
        assert set(strategy.plan.policies) == {"keep"}
    else:
        strategy = _limited(name, schedule, HOST_BANDWIDTH if memopt == "swap" else None)
        assert memopt in strategy.plan.policies  # the limit makes the planner recompute or swap
    _assert_within_tolerance(strategy.plan, strategy.meter.peaks())


def _benchmark_run(name, planner, limit, microbatch, schedule="gpipe"):
    """A planned run of the quick benchmark's model over 4 stages, metered."""
    bench = suite(full=False)[name]
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, planner=planner, memory_limit=limit,
                                  measure_memory=True)
    batch = microbatch * CHUNKS
    trainer(strategy, 4, max_steps=STEPS).fit(bench.model(), loader(bench.data(batch * STEPS), batch))
    return strategy


def test_a_skip_gradient_waiting_under_gpipe_is_predicted():
    """The benchmark's U-Net over 4 stages under GPipe, capslog's plan at micro-batch 10 under
    a 6.9 MiB limit: a planned run that ran out of memory while the cost model let no gradient
    wait under GPipe. The long skip's gradient, a slice of its cat's gradient, waits at the
    cat's stage while that stage runs two more micro-batches' backward (stage 2 metered
    5.84 MiB against 4.43 MiB predicted)."""
    strategy = _benchmark_run("unet", "capslog", 7_223_661, 10)
    assert "recompute" in strategy.plan.policies
    _assert_within_tolerance(strategy.plan, strategy.meter.peaks())


def test_a_cat_reading_two_earlier_stages_keeps_one_gradient_buffer():
    """The benchmark's U-Net under GPipe, time's plan at micro-batch 7 under the 6.9 MiB limit:
    the last stage's cat reads the stem's output (stage 0) and an upsampled value (stage 2).
    Its backward hands both out as slices of one gradient buffer per micro-batch, which waits
    for stage 0, the earliest; counted once for each producer, the last stage was 12.3% over
    (and its plan recomputed more than it needed)."""
    strategy = _benchmark_run("unet", "time", 7_223_661, 7)
    predicted, metered = strategy.plan.stages[3].peak.total, strategy.meter.peaks()[3]
    assert abs(predicted - metered) <= 0.01 * metered, (predicted, metered)


@pytest.mark.slow
def test_an_encoder_output_read_on_every_stage_is_predicted_under_gpipe():
    """The benchmark's encoder-decoder over 4 stages under GPipe, params' plan at micro-batch 13
    under a 3.17 MiB limit. The encoder output is read on every stage: stage 0 counted it
    twice (in the stash of the recomputed node saving it, and as held for the later stages:
    +15.6%), and its gradient only on its last reader's stage, while autograd makes a new sum
    on each stage reading it, which waits there (stage 2: -6.7%)."""
    strategy = _benchmark_run("t5", "params", 3_325_593, 13)
    assert "recompute" in strategy.plan.policies
    _assert_within_tolerance(strategy.plan, strategy.meter.peaks())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_made_of_linear_layers_are_predicted(schedule):
    """Stages whose peak is a 256 x 256 linear layer's parameter gradients: under GPipe autograd
    sums the four micro-batches' gradients of a weight before the weight takes them, out of
    place (each is a transposed view), so three weight-sized gradients meet (25% under the
    meter when one was counted)."""
    batch, width = 32, 256
    data = torch.utils.data.TensorDataset(torch.randn(batch, width))
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, measure_memory=True)
    trainer(strategy, 4, max_steps=STEPS).fit(Skipped(width, "add"), loader(data, batch // 2))
    _assert_within_tolerance(strategy.plan, strategy.meter.peaks())


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_whose_peak_is_the_optimizer_step_is_predicted(schedule, foreach):
    """Wide linear layers and a small batch: a stage's peak is Adam's step, its parameters,
    gradients and state and the step's temporaries (for-loop: twice one weight; foreach: all
    of the stage's square roots at once). Unpredicted, 1F1B's stages were 17% over."""
    data = torch.utils.data.TensorDataset(torch.randn(16, 512))
    model = Skipped(512, "add")
    model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), foreach=foreach)
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, measure_memory=True)
    trainer(strategy, 2, max_steps=STEPS).fit(model, loader(data, 8))
    _assert_within_tolerance(strategy.plan, strategy.meter.peaks())
    assert all(s.peak.transient >= 2 * 512 * 512 * 4 for s in strategy.plan.stages)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_logits_in_the_output_made_before_the_last_stage_are_predicted(schedule):
    """The loss computed in ``forward`` and returned with the logits, the head on stage 2 and
    the loss on stage 3 (the split the paper-scale BERT plan chose): under GPipe stage 2 keeps
    every micro-batch's logits for the merge (38% under the meter when one was counted)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (64, 16))
    data = loader(torch.utils.data.TensorDataset(ids, ids), 16)
    planned = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule)
    trainer(planned, 4, max_steps=1).fit(LossInside(), data)
    balance = [2, 2, 2, 3]  # embed, body_0 | body_1, body_2 | body_3, head | flatten, flatten_1, cross_entropy
    assert [n.name for n in planned.profile.nodes][4:6] == ["body_3", "head"]
    request = PlanRequest([2**40] * 4, schedule=schedule, chunks=CHUNKS)
    predicted = planning_stages(planned.profile, request).placed(balance)
    metered = MemoryPipeStrategy(chunks=CHUNKS, schedule=schedule, balance=balance, measure_memory=True)
    torch.manual_seed(0)
    trainer(metered, 4, max_steps=STEPS).fit(LossInside(), data)
    errors = [(p.peak.total - m) / m for p, m in zip(predicted, metered.meter.peaks())]
    assert max(map(abs, errors)) <= TOLERANCE, [f"{e:+.1%}" for e in errors]


def test_a_convolutions_gradient_sum_under_gpipe_comes_after_its_workspace_is_freed():
    """The benchmark's U-Net under GPipe, a stage of one convolution (params' split at
    micro-batch 4): the one backward sums the micro-batches' weight gradients into a new tensor
    once the convolution's backward has returned and freed its workspace, so the sum and the
    workspace never coincide (counted together, +10.4%)."""
    bench, balance, microbatch = suite(full=False)["unet"], [9, 8, 1, 13], 4
    batch = microbatch * CHUNKS
    profiled = MemoryPipeStrategy(chunks=CHUNKS, planner="uniform")
    trainer(profiled, 4, max_steps=1).fit(bench.model(), loader(bench.data(batch), batch))
    assert [n.name for n in profiled.profile.nodes][17] == "up_0_0"
    request = PlanRequest([2**40] * 4, schedule="gpipe", chunks=CHUNKS)
    predicted = planning_stages(profiled.profile, request).placed(balance)
    metered = MemoryPipeStrategy(chunks=CHUNKS, planner=None, balance=balance, measure_memory=True)
    trainer(metered, 4, max_steps=STEPS).fit(bench.model(), loader(bench.data(batch * STEPS), batch))
    errors = [(p.peak.total - m) / m for p, m in zip(predicted, metered.meter.peaks())]
    assert abs(errors[2]) <= 0.001 and max(map(abs, errors)) <= TOLERANCE, [f"{e:+.1%}" for e in errors]


@pytest.mark.slow
def test_a_recomputed_regions_forward_run_again_is_predicted(monkeypatch):
    """The benchmark's GPT under 2BW over 3 stages, the first block's attention recomputed up
    to its softmax (a plan dawnpiper made): its forward, run again before the softmax's
    backward, holds at once the stash made again so far and the scores its ``masked_fill``
    makes from those of the ``matmul`` before, more than that backward with the stash back
    whole (the first stage was 5.9% under the meter). It also holds the ``qkv`` projection
    its values are a view of, returned for the ``matmul`` after it; that one saves the
    softmax's output too, and frees it with its own backward, before the region runs again
    (three errors that cancelled: the first stage was exact with all of them). A stage's last
    ``add`` hands on its output's gradient as it is: the storage the next stage made and
    holds (the second stage was 1.9% over when it counted it too)."""

    def recompute_attention(profile, request):
        names = [n.name for n in profile.nodes]
        region = range(names.index("blocks_0_attn_qkv"), names.index("softmax") + 1)
        plan = make_plan(profile, PlanRequest([1 << 40] * 3, "uniform", request.schedule, request.chunks))
        return replace(plan, balance=[39, 38, len(names) - 77],
                       policies=["recompute" if i in region else "keep" for i in range(len(names))])

    monkeypatch.setattr(strategy_module, "make_plan", recompute_attention)
    bench, batch = suite(full=False)["gpt"], 8 * CHUNKS
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule="2bw", measure_memory=True)
    trainer(strategy, 3, max_steps=STEPS).fit(bench.model(), loader(bench.data(batch * STEPS), batch))
    stages = planning_stages(strategy.profile, PlanRequest([1 << 40] * 3, schedule="2bw", chunks=CHUNKS))
    predicted = predict_peaks(strategy.profile, strategy.plan.balance, stages.in_flight, strategy.plan.policies,
                              stages.weight_versions, stages.waits, backward_states=stages.backward_states,
                              schedule="2bw", chunks=CHUNKS)
    metered = strategy.meter.peaks()
    for stage in (0, 1):
        assert abs(predicted[stage].total - metered[stage]) <= 0.001 * metered[stage], (
            [p.total for p in predicted], metered)


class _Amoeba(LightningModule):
    """A small AmoebaNet-D classifying 32x32 images."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = AmoebaNetD(normal=1, filters=32, classes=10)

    def forward(self, image):
        return self.net(image)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.slow
def test_a_value_a_recomputed_region_sends_on_is_predicted_while_the_region_runs_again(monkeypatch):
    """A small AmoebaNet over 2 stages under 1F1B, stage 0 recomputing the stem's normalisation
    up to the first cell's two pools (the region dawnpiper chose on AmoebaNet-D at paper scale,
    3.7% under the meter there). The stem's output, read in the region and by the second cell
    on stage 1, is one of the region's outputs: run again before its backward, the region holds
    it until it stops. Taken as freed at its last reader in the region, stage 0 was 3.5% under."""

    def recompute_stem(profile, request):
        names = [n.name for n in profile.nodes]
        region = range(names.index("net_stem_1"), names.index("net_cells_0_ops_1") + 1)
        plan = make_plan(profile, PlanRequest([1 << 40] * 2, "uniform", request.schedule, request.chunks))
        return replace(plan, balance=[41, len(names) - 41],
                       policies=["recompute" if i in region else "keep" for i in range(len(names))])

    monkeypatch.setattr(strategy_module, "make_plan", recompute_stem)
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3, 32, 32, generator=generator),
                                          torch.randint(0, 10, (32,), generator=generator))
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", measure_memory=True)
    trainer(strategy, 2, max_steps=STEPS).fit(_Amoeba(), loader(data, 16))
    stages = planning_stages(strategy.profile, PlanRequest([1 << 40] * 2, schedule="1f1b", chunks=CHUNKS))
    predicted = predict_peaks(strategy.profile, strategy.plan.balance, stages.in_flight, strategy.plan.policies,
                              stages.weight_versions, stages.waits, backward_states=stages.backward_states,
                              schedule="1f1b", chunks=CHUNKS)
    metered = strategy.meter.peaks()
    assert abs(predicted[0].total - metered[0]) <= 0.002 * metered[0], ([p.total for p in predicted], metered)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "stage"), [("1f1b", 0), ("gpipe", 3)])
def test_the_unets_first_and_last_stages_are_predicted_to_the_byte(schedule, stage):
    """The benchmark's U-Net over 4 stages, dawnpiper's plan at its largest micro-batch under a
    6.3 MiB limit (15 and 11 where convolutions' scratch is small; 11 and 9 under AVX-512's).
    1F1B, stage 0 (+13.0%): a recomputed region reading the graph input was given a copy of
    it, but a micro-batch is a view of the batch, which the last stage holds (the planner now
    finds a split there that recomputes nothing; its stage 0 is still checked). GPipe, stage 3
    (+9.6%): its backward was given the returned loss (``F.mse_loss`` returns it in the storage
    of every unreduced value), which Lightning drops before the backward."""
    profile = _benchmark_run("unet", "uniform", 2**40, 1).profile
    limit = int(7_223_661 * PLANNING_HEADROOM)  # the planning target of the benchmark row these came from
    microbatch = max_microbatch(profile, PlanRequest([limit] * 4, "dawnpiper", schedule, CHUNKS))
    strategy = _benchmark_run("unet", "dawnpiper", limit, microbatch, schedule)
    predicted, metered = strategy.plan.stages[stage].peak.total, strategy.meter.peaks()[stage]
    assert abs(predicted - metered) <= 0.001 * metered
    _assert_within_tolerance(strategy.plan, strategy.meter.peaks())


class _Encoder(LightningModule):
    """Embedding, a whole ``nn.TransformerEncoder`` (one graph node of two layers
    under ``leaf_modules=["encoder"]``), head."""

    def __init__(self, width=32, vocab=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))

    def training_step(self, batch, batch_idx):
        logits = self(batch[0])
        return F.cross_entropy(logits.flatten(0, 1), batch[0].flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_node_of_whole_transformer_layers_is_predicted_within_three_percent(schedule):
    """A node holding two encoder layers makes and adds one function's parameter gradients at
    a time in its backward; charged all at once, the stage was over-predicted (here +7.2%
    under 1F1B; +13% on the unseen benchmark's encoder). Measured now: gpipe within 0.1%,
    1f1b -1.1% (what the node's own backward holds besides them is not measured apart)."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (16, 16)))
    strategy = MemoryPipeStrategy(chunks=4, schedule=schedule, measure_memory=True, leaf_modules=["encoder"])
    trainer(strategy, 2, max_steps=2).fit(_Encoder(), loader(data, 16))
    for stage, metered in zip(strategy.plan.stages, strategy.meter.peaks()):
        assert stage.peak.total == pytest.approx(metered, rel=0.03), (strategy.plan.balance, schedule)
