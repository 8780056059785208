"""The torch.export front end: graphs fx cannot trace, in the form build and the runtimes use."""

from typing import NamedTuple

import pytest
import torch
from torch import nn

from lightning_pipe.graph.capture import CaptureError, NeedsExampleInputs, capture
from lightning_pipe.graph.export import bind_arguments, localize
from lightning_pipe.plan.balance import balance_by_weight
from lightning_pipe.runtime.build import build
from lightning_pipe.runtime.gpipe import Pipeline
from tests.models import Untraceable

CPU = torch.device("cpu")


class Heads(nn.Module):
    """Splits features into heads with ``(*shape, heads, -1)``, which fx cannot unpack."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        shape = x.shape[:-1]
        h = self.proj(x).view(*shape, self.heads, -1)
        return torch.relu(h).flatten(-2)


class Out(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None


class TiedLM(nn.Module):
    """Embedding, an untraceable block, a head tied to the embedding; a dict batch in, a
    named tuple with an optional loss out."""

    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(Heads(dim), Heads(dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, batch, labels=None):
        logits = self.head(self.blocks(self.embed(batch["ids"])) * self.scale)
        loss = None if labels is None else nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return Out(logits, loss)


def _batch(n=4, t=6):
    ids = torch.randint(16, (n, t), generator=torch.Generator().manual_seed(0))
    return {"ids": ids}, ids


def _export(model, *args, **kwargs):
    with pytest.raises(NeedsExampleInputs):
        capture(model)
    captured = capture(model, example_inputs=(args, kwargs))
    assert captured.front_end == "torch.export"
    return captured


def test_export_captures_what_fx_cannot_with_the_models_own_tensors():
    model = TiedLM()
    batch, labels = _batch()
    captured = _export(model, batch, labels=labels)
    gm = captured.graph_module
    reads = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    assert reads <= {name for name, _ in model.named_parameters(remove_duplicate=False)} | {"scale"}
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}  # no copies
    assert [n.op for n in gm.graph.nodes if n.op == "placeholder"] == ["placeholder"] * 2
    assert any("blocks_1_proj" in n.name for n in captured.nodes)  # named by module and operation
    out = gm(batch, labels=labels)
    expected = model(batch, labels=labels)
    assert isinstance(out, Out)
    assert torch.equal(out.logits, expected.logits) and torch.equal(out.loss, expected.loss)


def test_tied_weight_is_one_parameter_counted_once_and_borrowed_by_a_later_stage():
    model = TiedLM()
    batch, labels = _batch()
    captured = _export(model, batch, labels=labels)
    assert sum(captured.param_bytes()) == sum(p.numel() * 4 for p in model.parameters())
    program = build(captured, model, balance_by_weight(captured.param_bytes(), 2), [CPU, CPU])
    first, last = program.stages
    assert any(t is model.embed.weight for t in first.owned)
    assert not any(t is model.embed.weight for t in last.owned)
    out = Pipeline(program, model, 2, CPU)(batch, labels=labels)
    out.loss.backward()
    grad = model.embed.weight.grad.clone()
    model.zero_grad()
    model(batch, labels=labels).loss.backward()
    assert torch.allclose(grad, model.embed.weight.grad, atol=1e-6)  # both uses, in one gradient


@pytest.mark.slow
def test_graph_holds_for_other_batch_sizes_only_for_its_specialization():
    model = TiedLM()
    batch, labels = _batch()
    captured = _export(model, batch, labels=labels)
    spec = captured.specialization
    smaller = {"ids": batch["ids"][:2]}
    assert captured.admits(bind_arguments(model, (smaller,), {"labels": labels[:2]}))
    assert not captured.admits(bind_arguments(model, (batch,), {}))  # labels None: another graph
    longer = {"ids": torch.zeros(4, 9, dtype=torch.long)}
    assert not captured.admits(bind_arguments(model, (longer,), {"labels": longer["ids"]}))
    every = capture(model, example_inputs=((batch,), {"labels": labels}), every_size=True)
    assert every.admits(bind_arguments(model, (longer,), {"labels": longer["ids"]}))
    assert spec is not None and every.specialization is not None and spec.spec == every.specialization.spec
    out = every.graph_module(longer, labels=longer["ids"])
    assert torch.equal(out.logits, model(longer).logits)


class BatchNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = Heads(4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x):
        return self.norm(self.heads(x)) + torch.tensor([1.0, 2.0, 3.0, 4.0]) * self.offset


def test_buffer_updates_are_written_back_and_constants_reach_their_stage():
    model = BatchNormed()
    x = torch.randn(8, 4)
    captured = _export(model, x)
    reference = BatchNormed()
    reference.load_state_dict(model.state_dict())
    program = build(captured, model, [len(captured.nodes) - 2, 2], [CPU, CPU])
    env = {**program.bind((x,), {}), **program.attribute_values(model)}
    for stage in program.stages:
        env.update(zip(stage.outputs, stage(*[env[n] for n in stage.inputs])))
    assert torch.allclose(env[program.output], reference(x), atol=1e-6)
    assert torch.allclose(model.norm.running_mean, reference.norm.running_mean)
    assert model.norm.num_batches_tracked.item() == 1


def test_eval_mode_is_a_graph_of_its_own():
    model = BatchNormed()
    x = torch.randn(8, 4)
    train = _export(model, x)
    model.eval()
    evaluation = _export(model, x)
    assert train.graph_module.code != evaluation.graph_module.code
    localize(evaluation.graph_module, CPU)
    assert torch.allclose(evaluation.graph_module(x), model(x))


def test_devices_taken_from_inputs_are_left_open_and_localized():
    class Positions(nn.Module):
        def forward(self, x):
            *_, t = x.shape
            return x + torch.arange(t, device=x.device)

    captured = _export(Positions(), torch.zeros(2, 3))
    devices = [n.kwargs.get("device") for n in captured.nodes if "device" in n.kwargs]
    assert devices and all(d.type == "meta" for d in devices)
    localize(captured.graph_module, CPU)
    assert torch.equal(captured.graph_module(torch.zeros(2, 3)), torch.arange(3.0).expand(2, 3))


def test_a_move_to_a_device_keeps_the_dtype_it_is_run_with():
    # export writes x.to(device) as aten.to(dtype=<x's dtype when captured>, device=...): run on
    # bfloat16 parameters (data_parallel="fsdp" under bf16-mixed), Hugging Face GPT-2's position
    # embeddings went on in float32, and its first layer norm failed on float32 input with
    # bfloat16 weights; an explicit cast stays
    class Moved(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(3, 4)

        def forward(self, x):
            *_, t = x.shape
            return self.pos(torch.arange(t, device=x.device)).to(x.device), self.pos.weight.to(torch.float32)

    captured = _export(Moved(), torch.zeros(2, 3))
    localize(captured.graph_module, CPU)
    captured.graph_module.to(torch.bfloat16)
    moved, cast = captured.graph_module(torch.zeros(2, 3))
    assert (moved.dtype, cast.dtype) == (torch.bfloat16, torch.float32)


def test_no_front_end_error_names_both_the_module_line_and_fixes():
    with pytest.raises(CaptureError) as info:
        capture(Untraceable(), example_inputs=((torch.randn(2, 4),), {}))
    message = str(info.value)
    assert message.startswith("Neither torch.fx nor torch.export could capture Untraceable.forward")
    assert "torch.fx could not trace" in message and "torch.export could not capture" in message
    assert message.count("submodule 'gate' (Gate)") == 2 and message.count("if x.sum() > 0") == 2
    assert 'leaf_modules=["gate"]' in message and "torch.where" in message
    assert info.value.__suppress_context__


def test_a_batch_size_fixed_by_the_code_is_an_error():
    class Fixed(nn.Module):
        def forward(self, x):
            _, *rest = x.shape  # fx cannot unpack a traced shape
            return x.reshape(4, *rest).sum(-1)

    with pytest.raises(CaptureError, match=r"fixed the batch size of Fixed.forward's input x to 4"):
        capture(Fixed(), example_inputs=((torch.zeros(4, 3),), {}))


def test_a_batch_of_one_gives_a_graph_for_every_batch_size():
    """torch.export fixes a size it sees as 1: a batch of one is exported as two stand-ins."""
    model = TiedLM()
    batch, labels = _batch(n=1)
    captured = _export(model, batch, labels=labels)
    assert [leaf.sizes for leaf in captured.specialization.leaves] == [(None, 6), (None, 6)]
    for n in (1, 3):
        batch, labels = _batch(n=n)
        assert captured.admits(bind_arguments(model, (batch,), {"labels": labels}))
        out, expected = captured.graph_module(batch, labels=labels), model(batch, labels=labels)
        assert torch.equal(out.logits, expected.logits) and torch.equal(out.loss, expected.loss)


def test_fx_captures_a_batch_of_one_for_every_batch_size_as_before():
    captured = capture(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), example_inputs=((torch.randn(1, 8),), {}))
    assert captured.front_end == "torch.fx" and captured.specialization is None


class Pinned(nn.Module):
    """Reshapes to a constant batch size, the code's own."""

    def __init__(self, size):
        super().__init__()
        self.size = size

    def forward(self, x):
        _, *rest = x.shape  # fx cannot unpack a traced shape
        return x.reshape(self.size, *rest).sum(-1)


def test_code_that_pins_the_batch_size_fails_at_a_batch_of_one():
    with pytest.raises(CaptureError, match=r"Pinned.forward captures at batch size 1 but not at 2: the code makes"):
        capture(Pinned(1), example_inputs=((torch.zeros(1, 3),), {}))
    with pytest.raises(CaptureError, match=r"fixed the batch size of Pinned.forward's input x to 2"):
        capture(Pinned(2), example_inputs=((torch.zeros(1, 3),), {}))


def test_keyword_arguments_are_placeholders_of_forward():
    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = Heads(4)

        def forward(self, **inputs):
            return {"y": self.heads(inputs["x"]) * inputs["w"]}

    model = Kw()
    x, w = torch.randn(3, 4), torch.randn(3, 1)
    captured = _export(model, x=x, w=w)
    assert [n.target for n in captured.graph_module.graph.nodes if n.op == "placeholder"] == ["**inputs"]
    program = build(captured, model, balance_by_weight(captured.param_bytes(), 2), [CPU, CPU])
    out = Pipeline(program, model, 3, CPU)(x=x, w=w)
    assert torch.allclose(out["y"], model(x=x, w=w)["y"])
