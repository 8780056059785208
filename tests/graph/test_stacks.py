import pytest
import torch
from torch import nn

from lightning_pipe.graph.capture import capture


class _Decoder(nn.Module):
    def __init__(self, causal: bool | None = True) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 3, norm=nn.LayerNorm(16))
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(4), persistent=False)
        self.causal = causal

    def forward(self, x):
        return self.decoder(x[:, 4:], x[:, :4], tgt_mask=self.mask, tgt_is_causal=self.causal)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


def _modules(captured):
    return [str(n.target) for n in captured.nodes if n.op == "call_module"]


@pytest.mark.parametrize("model", [_Decoder, _Encoder])
def test_a_transformer_stack_is_captured_layer_by_layer(model):
    """torch.fx keeps torch.nn modules whole: a 4-layer nn.TransformerDecoder under AdamW was one
    node on one of 2 stages, with no plan at 90% of its peak (issue 45); layer by layer, two a
    stage, it trains there. Each layer is a node, and the graph computes what the module does,
    in training and in eval (where each layer takes its own fast path)."""
    torch.manual_seed(0)
    module, x = model(), torch.randn(2, 8, 16)
    captured = capture(module)
    name = "decoder" if model is _Decoder else "encoder"
    assert _modules(captured) == [f"{name}.layers.{i}" for i in range(3)] + (["decoder.norm"] if name == "decoder"
                                                                            else [])
    for train in (True, False):
        module.train(train)
        torch.testing.assert_close(captured.graph_module(x), module(x), rtol=0, atol=0)


def test_a_stack_whose_forward_reads_tensor_values_stays_whole():
    """Without ``tgt_is_causal`` the decoder compares its mask's values with a causal one,
    which tracing cannot; a stack named in ``leaf_modules`` stays whole too."""
    assert _modules(capture(_Decoder(causal=None))) == ["decoder"]
    assert _modules(capture(_Decoder(), ["decoder"])) == ["decoder"]
    assert _modules(capture(_Encoder(), ["TransformerEncoder"])) == ["encoder"]
