import pytest
import torch

from examples.models import GPT
from lightning_pipe.graph.capture import CaptureError, capture
from tests.models import Untraceable


def test_capture_gives_fine_grained_nodes_in_order():
    captured = capture(GPT(layers=2))
    ops = {n.op for n in captured.nodes}
    assert ops <= {"call_module", "call_function", "call_method"}
    names = [n.name for n in captured.nodes]
    assert names.index("tok_emb") < names.index("blocks_0_attn_qkv") < names.index("head")
    assert len(captured.nodes) > 40  # ops inside attention, not one node per block


def test_untraceable_model_error_names_module_line_and_fix():
    with pytest.raises(CaptureError) as info:
        capture(Untraceable())
    message = str(info.value)
    assert "submodule 'gate' (Gate)" in message
    assert "models.py" in message and "if x.sum() > 0" in message
    assert 'leaf_modules=["gate"]' in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize("leaf", ["gate", "Gate"])
def test_leaf_modules_by_name_or_class_make_it_traceable(leaf):
    model = Untraceable()
    captured = capture(model, [leaf])
    assert [n.target for n in captured.nodes] == ["a", "gate", "b"]
    x = torch.randn(3, 4)
    assert torch.equal(captured.graph_module(x), model(x))


def test_unknown_leaf_module_is_an_error():
    with pytest.raises(CaptureError, match=r"\['gaet'\] match no submodule"):
        capture(Untraceable(), ["gate", "gaet"])


def test_param_bytes_count_a_tied_parameter_once():
    model = GPT(layers=1)
    captured = capture(model)
    total = sum(p.numel() * 4 for p in model.parameters())  # parameters() skips duplicates
    assert sum(captured.param_bytes()) == total
    head = next(k for k, n in enumerate(captured.nodes) if n.name == "head")
    assert captured.param_bytes()[head] == 0  # its weight was counted at tok_emb
