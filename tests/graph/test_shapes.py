import pytest
import torch

from lightning_pipe.graph.shapes import batch_shapes, grown, largest, show, tile


def test_shapes_are_named_by_path_in_the_batch():
    batch = ({"input_ids": torch.zeros(4, 16, dtype=torch.long), "mask": torch.zeros(4, 16)}, torch.zeros(4), 3)
    assert batch_shapes(batch) == {"0.input_ids": (4, 16), "0.mask": (4, 16), "1": (4,)}
    assert batch_shapes(torch.zeros(2, 3)) == {"batch": (2, 3)}


def test_grown_names_only_tensors_larger_in_some_dimension():
    planned = {"x": (8, 16), "y": (8,)}
    assert grown(planned, {"x": (4, 16), "y": (4,)}) == {}  # a short last batch
    assert grown(planned, {"x": (4, 24), "y": (4,)}) == {"x": (4, 24)}  # a longer sequence
    assert grown(planned, {"x": (8, 16), "y": (8, 2)}) == {"y": (8, 2)}  # another rank
    assert grown(planned, {"x": (8, 16), "y": (8,), "z": (1,)}) == {"z": (1,)}  # a new tensor


def test_largest_takes_every_dimension_s_maximum():
    assert largest({"x": (8, 16)}, {"x": (4, 24), "y": (2,)}) == {"x": (8, 24), "y": (2,)}


def test_tile_repeats_the_batch_s_own_values():
    ids = torch.arange(6).reshape(2, 3)
    out = tile({"input_ids": ids, "labels": ids + 1, "n": 7}, {"input_ids": (3, 5)})
    assert out["input_ids"].tolist() == [[0, 1, 2, 0, 1], [3, 4, 5, 3, 4], [0, 1, 2, 0, 1]]
    assert out["labels"] is not None and out["labels"].shape == (2, 3) and out["n"] == 7
    assert tile(ids, {"batch": (1, 2)}).tolist() == [[0, 1]]  # smaller: cut


def test_tile_errors_name_the_problem():
    batch = {"input_ids": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=r"names \['ids'\], which the training batch does not have; its tensors are"):
        tile(batch, {"ids": (4, 3)})
    with pytest.raises(ValueError, match=r"gives 'input_ids' the shape \[4\], but the batch's has 2 dims"):
        tile(batch, {"input_ids": (4,)})


def test_show_is_a_plan_shapes_argument():
    assert show({"input_ids": (8, 24), "0": (2,)}) == "{'input_ids': [8, 24], '0': [2]}"
