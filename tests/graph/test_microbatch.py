import pytest
import torch

from lightning_pipe.graph.microbatch import gather, scatter


def test_scatter_splits_tensor_leaves_and_shares_the_rest():
    inputs = {"x": torch.arange(10).view(10, 1), "scale": torch.tensor(2.0), "mode": "train", "ys": [torch.ones(10)]}
    parts = scatter(inputs, 4)
    assert len(parts) == 4
    assert [p["x"].shape[0] for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p["x"] for p in parts]), inputs["x"])
    assert all(p["mode"] == "train" and p["scale"] is inputs["scale"] for p in parts)
    assert all(p["ys"][0].shape[0] == p["x"].shape[0] for p in parts)


def test_gather_concatenates_and_keeps_non_tensors():
    outs = [{"y": torch.full((2, 3), float(i)), "name": "a"} for i in range(3)]
    merged = gather(outs, torch.device("cpu"))
    assert merged["y"].shape == (6, 3) and merged["name"] == "a"
    assert merged["y"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]


def test_fewer_samples_than_chunks_gives_one_sample_per_microbatch():
    x = torch.arange(6).view(3, 2)
    parts = scatter((x, "mode"), 4)
    assert [p[0].tolist() for p in parts] == [[[0, 1]], [[2, 3]], [[4, 5]]]
    assert all(p[1] == "mode" for p in parts)
    assert [p[0].shape for p in scatter((torch.zeros(0, 2),), 4)] == [(0, 2)]


def test_disagreeing_batch_sizes_and_missing_tensors_are_errors():
    with pytest.raises(ValueError, match=r"disagree on the batch size.*\[3, 4\]"):
        scatter((torch.zeros(4), torch.zeros(3)), 2)
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        scatter(("text", 3), 2)


def test_gather_weights_a_0_dim_loss_by_microbatch_size():
    outs = [{"loss": torch.tensor(float(i)), "logits": torch.zeros(n, 2)} for i, n in enumerate([3, 3, 2])]
    merged = gather(outs, torch.device("cpu"))
    assert merged["loss"].item() == pytest.approx((0 * 3 + 1 * 3 + 2 * 2) / 8)
    assert merged["logits"].shape == (8, 2)
    sized = gather([torch.tensor(1.0), torch.tensor(4.0)], torch.device("cpu"), sizes=[3, 1])
    assert sized.item() == pytest.approx(1.75)
    with pytest.raises(ValueError, match="0-dim tensor and nothing with a batch dimension"):
        gather([torch.tensor(1.0), torch.tensor(2.0)], torch.device("cpu"))


def test_gather_keeps_the_output_type_and_the_loss_gradient():
    from collections import namedtuple

    Out = namedtuple("Out", ["loss", "logits"])
    x = torch.ones(4, 2, requires_grad=True)
    parts = [Out(p.pow(2).mean(), p) for p in scatter(x, 2)]
    merged = gather(parts, torch.device("cpu"))
    assert isinstance(merged, Out)
    merged.loss.backward()
    assert torch.allclose(x.grad, 2 * torch.ones(4, 2) / 8)  # the whole batch's mean
