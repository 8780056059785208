"""The strategy checks a plan near the memory limit by a fake training step of the module."""

import warnings
from functools import cache, partial

import pytest
import torch
import torchmetrics
from lightning.pytorch.plugins.precision import MixedPrecision
from torch._subclasses.fake_tensor import FakeTensor

import lightning_pipe.lightning.local as strategy_module
from examples.models import GPT, TokenDataset, loader
from lightning_pipe import MemoryPipeStrategy
from lightning_pipe.autocast import cuda_autocast
from lightning_pipe.graph.capture import capture
from lightning_pipe.lightning.check import fake_meter, fake_peaks, picks_kernel_by_device
from lightning_pipe.measure.meter import StageOutOfMemoryError
from lightning_pipe.plan.plan import PREDICTION_ERROR
from tests.helpers import trainer
from tests.models import FlashGPT

STAGES, CHUNKS, BATCH = 2, 4, 16


class KeepsLogits(GPT):
    """Keeps each micro-batch's logits until the next batch (an epoch-end metric's inputs):
    bytes of the user's step that the memory model, which sees one micro-batch's loss, does
    not predict."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.kept: list[torch.Tensor] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.kept.clear()

    def training_step(self, batch, batch_idx):
        logits = self(*self.inputs(batch))
        self.kept.append(logits.detach().clone())
        loss = self.criterion(logits, batch)
        self.log("train_loss", loss)
        return loss


def _fit(strategy, steps=2):
    torch.manual_seed(0)
    model = KeepsLogits()
    trainer(strategy, STAGES, max_steps=steps).fit(model, loader(TokenDataset(BATCH * steps), BATCH))
    return strategy


def _limits():
    """Per-stage limits: ample for the first stage; for the last, which holds the kept logits,
    2% over what the plan for ample memory predicts for it, which the logits take it past."""
    ample = _fit(MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", measure_memory=True))
    predicted, metered = ample.plan.stages[-1].peak.total, ample.meter.peaks()[-1]
    limits = [4 * max(ample.meter.peaks()), int(1.02 * predicted)]
    assert metered > limits[-1]  # the step holds more than predicted
    return limits


@pytest.mark.slow
def test_a_plan_that_a_fake_step_finds_over_the_limit_is_made_again_below_it():
    limits = _limits()
    checks = []

    def spied(*args, **kwargs):
        checks.append((args[-1], fake_peaks(*args, **kwargs)))
        assert kwargs["devices"] == [torch.device("cpu")] * STAGES  # (a CUDA stage is checked by what it reserves)
        return checks[-1][1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(strategy_module, "fake_peaks", spied)
        strategy = _fit(MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", memory_limit=limits, measure_memory=True))
    first_plan, first_peaks = checks[0]
    assert first_plan.targets == limits and first_peaks[-1] > limits[-1]  # planned to the limits, it went over
    plan, metered = strategy.plan, strategy.meter.peaks()
    assert plan.targets[-1] < limits[-1]  # planned again below the limit, by the error measured
    assert all(m <= limit for m, limit in zip(metered, limits))  # it trains (the meter enforces the limits)
    # the error the check measured on the last stage, no less, is what the plan left below the limit
    error = first_peaks[-1] / first_plan.stages[-1].peak.total - 1
    assert plan.targets[-1] <= limits[-1] / (1 + error)
    # checked too (a measured error is no flat one), and as trained to the byte, but for one micro-batch's
    # logits on the last stage: no hook empties the list between the fake run's two steps
    checked_plan, peaks = checks[-1]
    logits = (BATCH // CHUNKS) * 16 * 96 * 4  # micro-batch x context x vocabulary x fp32
    assert checked_plan is plan and peaks[:-1] == metered[:-1] and peaks[-1] == metered[-1] + logits


@pytest.mark.slow
def test_without_the_check_the_same_limits_run_out_of_memory(monkeypatch):
    limits = _limits()
    monkeypatch.setattr(strategy_module, "fake_peaks", lambda *args, **kwargs: [s.peak.total for s in args[-1].stages])
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", memory_limit=limits, measure_memory=True,
                                  max_replans=0)  # (no recovery: it would plan again)
    with pytest.raises(StageOutOfMemoryError):
        _fit(strategy)


@pytest.mark.slow
def test_the_check_leaves_the_module_as_it_was():
    strategy = _fit(MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b"), steps=1)
    module = strategy.lightning_module
    module.forward = strategy.engine.run_forward  # as during training (teardown gave the module its own back)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    logged = dict(module.trainer.callback_metrics)
    kept = list(module.kept)
    batch = next(iter(loader(TokenDataset(BATCH), BATCH)))
    optimizer = strategy.optimizers[0]
    state = {id(p): dict(s) for p, s in optimizer.state.items()}
    peaks = fake_peaks(module, strategy.engine.captured, batch, 0, optimizer, strategy.precision_plugin, strategy.plan)
    assert len(peaks) == STAGES and all(p > 0 for p in peaks)
    after = module.state_dict()
    assert not any(isinstance(t, FakeTensor) or t.is_meta for t in after.values())
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert module.kept == kept and dict(module.trainer.callback_metrics) == logged
    assert {id(p): dict(s) for p, s in optimizer.state.items()}.keys() == state.keys()
    assert all(not (isinstance(v, FakeTensor) or v.is_meta) for s in optimizer.state.values() for v in s.values())
    assert vars(module)["forward"] == strategy.engine.run_forward  # the strategy's pipeline still runs the module


@pytest.mark.slow
def test_on_a_cuda_stage_the_check_reports_what_the_caching_allocator_reserves():
    strategy = _fit(MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b"), steps=1)
    module = strategy.lightning_module
    module.forward = strategy.engine.run_forward
    batch = next(iter(loader(TokenDataset(BATCH), BATCH)))
    check = partial(fake_peaks, module, strategy.engine.captured, batch, 0, strategy.optimizers[0],
                    strategy.precision_plugin, strategy.plan)
    meter = fake_meter(module, strategy.engine.captured, batch, 0, strategy.optimizers[0], strategy.precision_plugin,
                       strategy.plan, trace=True)
    metered = meter.peaks()
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # (a device is only a name: no GPU needed)
    assert check() == check(devices=[cpu, cpu]) == metered  # CPU stages: the metered bytes
    # a stage on a GPU: what its caching allocator reserves, at least the blocks it hands out, at least the bytes
    reserved = meter.allocator_peaks([1])
    assert check(devices=[cpu, cuda]) == [metered[0], reserved.reserved]
    assert metered[1] <= reserved.allocated <= reserved.reserved


@pytest.mark.slow
def test_under_cpu_autocast_the_check_meters_what_training_does():
    # bf16-mixed on the CPU casts fake tensors standing on the CPU; meta tensors it leaves in fp32
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", measure_memory=True)
    torch.manual_seed(0)
    model = GPT(optimizer="adam")
    trainer(strategy, STAGES, max_steps=2, precision="bf16-mixed").fit(model, loader(TokenDataset(2 * BATCH), BATCH))
    model.forward = strategy.engine.run_forward
    batch = next(iter(loader(TokenDataset(BATCH), BATCH)))
    peaks = fake_peaks(model, strategy.engine.captured, batch, 0, strategy.optimizers[0], strategy.precision_plugin,
                       strategy.plan)
    assert peaks == strategy.meter.peaks()


class _CudaAutocast(MixedPrecision):
    """bf16-mixed on the CPU casting as CUDA's autocast does: a GPU's training step, metered here."""

    def autocast_context_manager(self):
        return cuda_autocast(torch.bfloat16)


@pytest.mark.slow
def test_for_cuda_stages_the_check_casts_as_cudas_autocast():
    # the check of a plan for CUDA stages under bf16-mixed ran on meta tensors, which autocast
    # leaves in fp32; now on fake CPU tensors under CUDA's policy, as a GPU's step would cast
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", measure_memory=True)
    torch.manual_seed(0)
    model = GPT(optimizer="adam")
    trainer(strategy, STAGES, max_steps=2, plugins=[_CudaAutocast("bf16-mixed", "cpu")]).fit(
        model, loader(TokenDataset(2 * BATCH), BATCH))
    model.forward = strategy.engine.run_forward
    batch = next(iter(loader(TokenDataset(BATCH), BATCH)))

    def check(precision):
        return fake_peaks(model, strategy.engine.captured, batch, 0, strategy.optimizers[0], precision, strategy.plan)

    cuda = check(MixedPrecision("bf16-mixed", "cuda"))
    assert cuda == strategy.meter.peaks()
    # the CPU's policy keeps the layer norms and the attention probabilities in bf16: fewer bytes
    assert all(c > p for c, p in zip(cuda, check(MixedPrecision("bf16-mixed", "cpu"))))


@pytest.mark.slow
def test_on_cpu_stages_the_check_runs_the_attention_kernel_training_runs():
    # scaled_dot_product_attention runs flash on the CPU and the math kernel on meta tensors
    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", measure_memory=True)
    torch.manual_seed(0)
    model = FlashGPT(optimizer="adam")
    trainer(strategy, STAGES, max_steps=2).fit(model, loader(TokenDataset(2 * BATCH), BATCH))
    model.forward = strategy.engine.run_forward
    batch = next(iter(loader(TokenDataset(BATCH), BATCH)))
    check = partial(fake_peaks, model, strategy.engine.captured, batch, 0, strategy.optimizers[0],
                    strategy.precision_plugin, strategy.plan)
    assert check(on_cpu=True) == strategy.meter.peaks()
    assert check(on_cpu=False) != strategy.meter.peaks()
    # the strategy checks on CPU fake tensors where a graph calls such an operator, else on meta (faster)
    assert picks_kernel_by_device(strategy.engine.captured)
    assert not picks_kernel_by_device(capture(GPT()))


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_attention_inside_a_module_kept_whole_picks_its_kernel_by_device():
    """nn.TransformerEncoder is one graph node; the scaled_dot_product_attention inside it kept
    the math kernel's probabilities on meta tensors: the unseen benchmark's check was 15.5% over
    the meter on its first stage, and is exact checked on CPU fake tensors."""
    captured = capture(_Encoder(), ["encoder"])  # (captured layer by layer otherwise)
    assert [n.op for n in captured.graph_module.graph.nodes].count("call_module") == 2
    assert picks_kernel_by_device(captured)
    assert not picks_kernel_by_device(capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())))


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = list(self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4))  # fx cannot
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.slow
def test_attention_in_an_exported_graph_picks_its_kernel_by_device():
    """torch.export's graph calls the ATen overload (``aten.scaled_dot_product_attention.default``),
    which the check did not know by its name: Hugging Face models (exported) were checked on
    meta tensors, whose math kernel keeps the probabilities (GPT-2: fake +1.6% over the meter,
    ViT +4.7%; exact on CPU fake tensors)."""
    captured = capture(_Attention(), example_inputs=((torch.randn(2, 8, 16),), {}))
    assert any(n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)
               for n in captured.graph_module.graph.nodes)
    assert picks_kernel_by_device(captured)


class Lion(torch.optim.Optimizer):
    """A user-defined optimizer: one state buffer, settings only in its defaults."""

    def __init__(self, params, lr: float = 1e-4, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                avg = self.state[p].setdefault("avg", torch.zeros_like(p))
                avg.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(avg.sign(), alpha=-group["lr"])
        return loss


class NeedsWidth(torch.optim.SGD):
    """A user-defined optimizer whose __init__ takes an argument its defaults do not hold."""

    def __init__(self, params, width: int) -> None:
        super().__init__(params, lr=0.01)
        self.width = width


OPTIMIZERS = {  # SGD and Adam are the families' own: the tests above and test_prediction check their plans
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9),
    "lion": lambda ps: Lion(ps),
    "needs-width": lambda ps: NeedsWidth(ps, width=3),
}


class WithOptimizer(GPT):
    """GPT trained by ``make(parameters)``, logging a torchmetrics metric from its step
    (torchmetrics runs ``unique``, which has no meta kernel)."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make
        self.mean_logit = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        logits = self(*self.inputs(batch))
        self.mean_logit(logits.detach().mean())
        self.log("mean_logit", self.mean_logit)
        return self.criterion(logits, batch)

    def configure_optimizers(self):
        return self.make(self.parameters())


def _checked_fit(make, limits=None, model=WithOptimizer):
    """Two steps of ``WithOptimizer(make)``: every fake check's peaks, the strategy and what it warned."""
    checks = []

    def spied(*args, **kwargs):
        peaks = fake_peaks(*args, **kwargs)
        checks.append(peaks)
        return peaks

    strategy = MemoryPipeStrategy(chunks=CHUNKS, schedule="1f1b", memory_limit=limits, measure_memory=True)
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch.setattr(strategy_module, "fake_peaks", spied)
        trainer(strategy, STAGES, max_steps=2).fit(model(make), loader(TokenDataset(2 * BATCH), BATCH))
    return checks, strategy, [str(w.message) for w in caught if "cannot check its plan" in str(w.message)]


@cache
def _limits_at_the_predictions(name: str) -> list[int]:
    """Per stage, a limit just above the prediction of the plan made without one (outside the
    flat headroom, so the plan made to them is checked)."""
    _, ample, _ = _checked_fit(OPTIMIZERS[name])
    return [int(s.peak.total / 0.97) for s in ample.plan.stages]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_and_a_metric_in_the_step_are_checked(name):
    limits = _limits_at_the_predictions(name)
    checks, strategy, unchecked = _checked_fit(OPTIMIZERS[name], limits)
    assert not unchecked and checks  # checked, not planned by the flat margin
    # the check ran this optimizer's step: its state to the byte, but for the metric's few bytes of state
    assert checks[-1] == pytest.approx(strategy.meter.peaks(), abs=256)


class ReadsItsLoss(WithOptimizer):
    """Reads a value (``.item()``), which no fake tensor holds: its step cannot be checked."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e6:
            raise RuntimeError("diverged")
        return loss


class DrawsOnTheCPU(WithOptimizer):
    """Masks tokens at random with a mask it makes on the CPU (``torch.rand(shape)``), not on
    the batch's device: it trains on the CPU, but meets the check's meta batch."""

    def training_step(self, batch, batch_idx):
        keep = torch.rand(batch["input_ids"].shape) > 0.15
        masked = {**batch, "input_ids": torch.where(keep, batch["input_ids"], torch.zeros_like(batch["input_ids"]))}
        return super().training_step(masked, batch_idx)


@pytest.mark.slow
def test_a_step_that_makes_tensors_on_a_fixed_device_is_named_once_and_planned_by_the_flat_margin():
    limits = _limits_at_the_predictions("adamw")
    checks, strategy, unchecked = _checked_fit(OPTIMIZERS["adamw"], limits, model=DrawsOnTheCPU)
    assert not checks and len(unchecked) == 1
    assert "training_step makes tensors on a fixed device" in unchecked[0]
    assert all(s.peak.total * (1 + PREDICTION_ERROR) <= limit for s, limit in zip(strategy.plan.stages, limits))


@pytest.mark.slow
def test_a_step_that_reads_a_value_is_named_once_and_planned_by_the_flat_margin():
    limits = _limits_at_the_predictions("adamw")
    checks, strategy, unchecked = _checked_fit(OPTIMIZERS["adamw"], limits, model=ReadsItsLoss)
    assert not checks and len(unchecked) == 1
    assert "training_step reads a tensor's value" in unchecked[0]
    assert "10% under-prediction" in unchecked[0] and "limit / 1.1" in unchecked[0]
    # planned by the flat margin: every stage's prediction that far below its limit
    assert all(s.peak.total * (1 + PREDICTION_ERROR) <= limit for s, limit in zip(strategy.plan.stages, limits))
