import torch

from examples.models import GPT, UNet
from lightning_pipe.graph.capture import capture
from lightning_pipe.plan.balance import balance_by_weight
from lightning_pipe.runtime.build import build

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


def _wide_run(policy, chunks=4):
    """Stage 1 of Wide (see test_meter) under ``policy``: output, grads, and stage 1's metered
    activation bytes after the forward."""
    from lightning_pipe.measure.meter import MemoryMeter
    from lightning_pipe.runtime.gpipe import Pipeline
    from tests.models import Wide

    torch.manual_seed(0)
    model = Wide()
    captured = capture(model)
    policies = dict.fromkeys(("l1", "act", "l2"), policy) if policy != "keep" else {}
    program = build(captured, model, [1, 3], [CPU, CPU], policies)
    meter = MemoryMeter(2)
    for stage in program.stages:
        meter.own(stage.index, stage.owned)
    pipe = Pipeline(program, model, chunks, CPU, meter)
    x = torch.randn(32, 16)
    calls = []
    model.l1.register_forward_hook(lambda *_: calls.append(1))
    with meter, meter.saved_tensors_hooks():
        out = pipe(x)
        stashed = meter.stages[1].current["activations"]
        out.square().sum().backward()
    meter.close()
    return out.detach(), [p.grad for p in model.parameters()], stashed, len(calls)


def test_recompute_and_swap_give_identical_results_with_less_stashed():
    out, grads, stashed, calls = _wide_run("keep")
    received = 32 * 16 * 4  # l1 saves its input, made on stage 0: stage 1 keeps it, as on its own device
    assert stashed == 32 * 4096 * 4 + received and calls == 4
    for policy in ("recompute", "swap"):
        o, g, s, c = _wide_run(policy)
        assert torch.equal(o, out) and all(torch.equal(a, b) for a, b in zip(g, grads)), policy
        assert s == received, policy  # only the segment's input stays on stage 1's device for backward
        assert c == (8 if policy == "recompute" else 4), policy  # recompute runs forward again


def test_recompute_replays_dropout_exactly():
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 1))
    captured = capture(model)
    x = torch.randn(16, 8)
    results = []
    for policies in ({}, {n.name: "recompute" for n in captured.nodes}):
        program = build(captured, model, [1, 2], [CPU, CPU], policies)
        model.zero_grad()
        torch.manual_seed(1)
        from lightning_pipe.runtime.gpipe import Pipeline

        Pipeline(program, model, 2, CPU)(x).sum().backward()
        results.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_bad_policies_are_errors():
    import pytest

    model = GPT(layers=1)
    captured = capture(model)
    with pytest.raises(ValueError, match=r"policies name nodes the graph does not have: \['nope'\]"):
        build(captured, model, [len(captured.nodes)], [CPU], {"nope": "swap"})
    with pytest.raises(ValueError, match=r"Unknown memory policies \['offload'\]"):
        build(captured, model, [len(captured.nodes)], [CPU], {"head": "offload"})
