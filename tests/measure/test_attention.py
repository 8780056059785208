import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_pipe.graph.capture import capture
from lightning_pipe.internals import FakeTensorMode
from lightning_pipe.measure.attention import cuda_attention, cuda_attention_kernel
from lightning_pipe.measure.profiler import device_spec, profile_graph
from lightning_pipe.plan.devices import DEVICES
from lightning_pipe.runtime.fake import fake_training, meta_copy

BATCH, HEADS, SEQ, HEAD = 2, 2, 256, 8
SQUARE = BATCH * HEADS * SEQ * SEQ * 4  # one fp32 batch x heads x seq x seq tensor


class _Attention(nn.Module):
    """Self-attention with dropout 0.1, as BERT's and GPT-2's configs train."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * HEAD, 3 * HEADS * HEAD)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], SEQ, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)


def test_a_cuda_device_picks_flash_for_half_precision_without_a_mask_else_memory_efficient():
    def kernel(dtype=torch.float32, head=64, mask=None, gqa=False):
        q = torch.empty(2, 4, 16, head, dtype=dtype, device="meta")
        return cuda_attention_kernel(q, q, q, mask, gqa)

    assert kernel() == "efficient"  # fp32: flash needs fp16 or bf16
    assert kernel(torch.bfloat16) == kernel(torch.float16) == "flash"
    assert kernel(torch.bfloat16, mask=torch.empty(2, 1, 16, 16, device="meta")) == "efficient"
    assert kernel(head=12) == kernel(head=512) == kernel(gqa=True) == "math"  # padded, too large; not modelled


def test_a_fake_run_for_a_cuda_target_keeps_no_attention_sized_tensor():
    """On meta tensors attention with dropout ran the math kernel, which keeps the
    probabilities, the dropout mask and the dropped probabilities (3 fp32 batch x heads x seq x
    seq tensors) where a GPU's fused kernel keeps none: paper-scale BERT and GPT-2 were charged
    them. For a CUDA target the profile and the fake training step run the kernel it picks."""
    torch.manual_seed(0)
    model = _Attention()
    captured = capture(model)
    x = torch.randn(BATCH, SEQ, HEADS * HEAD, device="meta")

    def saved(device):
        return sum(n.saved_bytes for n in profile_graph(captured, (x,), fake=True, device=device).nodes)

    on_gpu, on_meta = saved(DEVICES["A100-40GB"]), saved(device_spec(torch.device("cpu")))
    assert on_gpu < SQUARE / 4 and on_meta >= 3 * SQUARE, (on_gpu, on_meta)

    def peak(cuda, policy="keep"):
        replica, graph = meta_copy(model, captured)
        meter = fake_training(replica, graph, x, lambda forward, batch: forward(batch).sum(),
                              torch.optim.SGD(replica.parameters(), lr=0.1), [len(graph.nodes)],
                              {n.name: policy for n in graph.nodes}, cuda=cuda)
        return meter.peaks()[0]

    assert peak(False) - peak(True) >= 3 * SQUARE
    # a recompute in the backward (on autograd's thread) runs the kernel the forward ran
    assert peak(True, "recompute") < peak(False, "recompute") - 2 * SQUARE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_kernels_run_on_cpu_fake_tensors_and_under_autocast(dtype):
    """bf16-mixed checks run on fake CPU tensors under autocast: the inputs reach the kernel cast,
    so a bf16 step runs flash (bf16 output) and its backward runs. Outside, the CPU's own kernel."""
    with FakeTensorMode(allow_non_fake_inputs=True), cuda_attention():
        q = torch.empty(BATCH, HEADS, SEQ, HEAD, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
            out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        out.float().sum().backward()
    assert out.dtype == dtype and q.grad is not None and q.grad.shape == q.shape
    assert "Efficient" in type(out.grad_fn).__name__ or "Flash" in type(out.grad_fn).__name__
    x = torch.randn(BATCH, HEADS, SEQ, HEAD, requires_grad=True)
    assert "Efficient" not in type(F.scaled_dot_product_attention(x, x, x).grad_fn).__name__
