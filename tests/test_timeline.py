import pytest
import torch

from examples.models import ImageDataset, TokenDataset, loader
from lightning_pipe.build import build
from lightning_pipe.capture import capture
from lightning_pipe.meter import MemoryMeter
from lightning_pipe.microbatch import scatter
from lightning_pipe.partition import balance_by_weight
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.profile import profile_graph
from lightning_pipe.timeline import Task, gpipe_order, replay_peaks
from tests.helpers import make

CPU = torch.device("cpu")


def test_gpipe_order_is_clock_forward_then_reverse_backward():
    order = gpipe_order(2, 2)
    assert order == [
        Task("forward", 0, 0), Task("forward", 1, 0), Task("forward", 0, 1), Task("forward", 1, 1),
        Task("backward", 1, 1), Task("backward", 0, 1), Task("backward", 1, 0), Task("backward", 0, 0),
    ]


CASES = {
    "gpt": (dict(dim=64, context=64), lambda: TokenDataset(context=64)),
    "unet": (dict(channels=16), lambda: ImageDataset(resolution=32)),
    "encdec": (dict(dim=64), None),
}


@pytest.mark.parametrize("family", ["gpt", "unet", "encdec"])
@pytest.mark.parametrize("stages", [2, 4])
def test_predicted_peaks_match_metered_gpipe_within_10_percent(family, stages):
    """Profile one micro-batch, predict every stage's peak, then run real GPipe steps under
    the meter (which never sees the prediction) and compare."""
    model_kwargs, dataset = CASES[family]
    model, data = make(family, **model_kwargs)
    batch = next(iter(loader(dataset() if dataset else data, 16)))
    inputs = model.inputs(batch)
    chunks = 4
    captured = capture(model)
    optimizer = torch.optim.Adam(model.parameters())
    profile = profile_graph(captured, scatter(inputs, chunks)[0], optimizer=optimizer, repeats=1, warmup=0)
    balance = balance_by_weight(captured.param_bytes(), stages)
    predicted = replay_peaks(profile, balance, gpipe_order(chunks, stages), grads_in_forward=False)

    program = build(captured, model, balance, [CPU] * stages)
    meter = MemoryMeter(stages)
    for stage in program.stages:
        meter.own(stage.index, stage.owned)
    pipeline = Pipeline(program, model, chunks, CPU, meter)
    with meter, meter.saved_tensors_hooks():
        for _ in range(2):  # the second step runs with optimizer state in place
            meter.reset_peaks()
            optimizer.zero_grad()
            model.criterion(pipeline(*inputs), batch).backward()
            optimizer.step()
            meter.own_optimizer_state(optimizer)
    meter.close()
    ratios = [m.peak / p for m, p in zip(meter.stages, predicted)]
    assert all(0.9 <= r <= 1.1 for r in ratios), ratios


def test_prediction_matches_a_metered_lightning_fit():
    """Through the strategy: Lightning keeps the last step's gradients during the forward."""
    from lightning_pipe import MemoryPipeStrategy
    from tests.helpers import trainer

    model, _ = make("gpt", dim=64, context=64, optimizer="adam")
    data = TokenDataset(context=64)
    batch = next(iter(loader(data, 16)))
    strategy = MemoryPipeStrategy(chunks=4, planner=None, measure_memory=True)  # a fixed split
    trainer(strategy, 3, max_steps=3).fit(model, loader(data, 16))
    balance = [len(s.node_names) for s in strategy.program.stages]
    profile = profile_graph(capture(model), scatter(model.inputs(batch), 4)[0],
                            optimizer=strategy.optimizers[0], repeats=1, warmup=0)
    predicted = replay_peaks(profile, balance, gpipe_order(4, 3))
    ratios = [m.peak / p for m, p in zip(strategy.meter.stages, predicted)]
    assert all(0.9 <= r <= 1.1 for r in ratios), ratios
