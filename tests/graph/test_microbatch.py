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


def test_fewer_samples_than_chunks_is_a_clear_error():
    with pytest.raises(ValueError, match="batch of 3 samples cannot be split into chunks=4.*drop_last=True"):
        scatter((torch.zeros(3, 2),), 4)


def test_disagreeing_batch_sizes_and_missing_tensors_are_errors():
    with pytest.raises(ValueError, match=r"disagree on the batch size.*\[3, 4\]"):
        scatter((torch.zeros(4), torch.zeros(3)), 2)
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        scatter(("text", 3), 2)


def test_gather_rejects_scalars():
    with pytest.raises(ValueError, match="0-dim tensor"):
        gather([torch.tensor(1.0), torch.tensor(2.0)], torch.device("cpu"))
