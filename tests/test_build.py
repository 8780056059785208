import torch

from examples.models import GPT, UNet
from lightning_pipe.build import build
from lightning_pipe.capture import capture
from lightning_pipe.partition import balance_by_weight

CPU = torch.device("cpu")


def _program(model, stages):
    captured = capture(model)
    return build(captured, model, balance_by_weight(captured.param_bytes(), stages), [CPU] * stages)


def test_stages_share_the_models_parameters():
    model = GPT(layers=2)
    program = _program(model, 3)
    own = {id(p) for p in model.parameters()}
    for stage in program.stages:
        assert {id(p) for p in stage.parameters()} <= own
    covered = {id(p) for s in program.stages for p in s.parameters()}
    covered |= {id(v) for v in program.attribute_values(model).values() if isinstance(v, torch.nn.Parameter)}
    assert covered == own


def test_tied_weight_is_owned_by_first_user_and_borrowed_later():
    model = GPT(layers=2)
    program = _program(model, 2)
    first, last = program.stages
    assert any(p is model.tok_emb.weight for p in first.owned)
    assert last.borrowed == [model.tok_emb.weight]
    assert any("head.weight" in seg.borrowed for seg in last.segments)


def test_values_travel_straight_to_non_adjacent_consumers():
    program = _program(UNet(depth=3), 4)
    producer = {name: s.index for s in program.stages for name in s.outputs}
    jumps = 0
    for stage in program.stages:
        for name in stage.inputs:
            if name in producer:
                jumps += producer[name] < stage.index - 1
        # no stage hands on a value it only received
        assert not set(stage.inputs) & set(stage.outputs)
    assert jumps > 0  # the long skips cross stages without relaying


def test_stages_compose_to_the_original_forward():
    model = UNet()
    program = _program(model, 3)
    x = torch.randn(2, 3, 16, 16)
    env = {**program.bind((x,), {}), **program.attribute_values(model)}
    for stage in program.stages:
        env.update(zip(stage.outputs, stage(*[env[n] for n in stage.inputs])))
    assert torch.allclose(env[program.output], model(x), atol=1e-6)
