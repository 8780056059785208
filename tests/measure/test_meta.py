import torch

from lightning_pipe.measure.meta import meta_call, on_meta

# An operator whose meta kernel counts its runs: whether meta_call ran it or made its result
LIBRARY = torch.library.Library("lightning_pipe_test_meta", "DEF")
LIBRARY.define("scaled(Tensor x, float s) -> Tensor")
KERNEL_RUNS = []
LIBRARY.impl("scaled", lambda x, s: (KERNEL_RUNS.append(s), torch.empty_like(x))[1], "Meta")
SCALED = torch.ops.lightning_pipe_test_meta.scaled.default


def leaves(values):
    return [leaf for v in values for leaf in (leaves(v) if isinstance(v, (list, tuple)) else [v])]


def call(func, *args, **kwargs):
    return meta_call(func, args, kwargs, leaves((*args, *kwargs.values())))


def same_layout(a, b):
    return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


def test_a_repeated_signature_is_made_from_its_layouts_as_the_kernel_makes_it():
    x = torch.empty(2, 3, 5, 7, device="meta").to(memory_format=torch.channels_last)
    first = call(torch.ops.aten.mul.Tensor, x, x)
    again = call(torch.ops.aten.mul.Tensor, x, x)
    assert same_layout(again, torch.ops.aten.mul.Tensor(x, x)) and same_layout(again, first)
    assert again.stride() == x.stride()  # the layout the kernel chose, not a contiguous one
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata
    KERNEL_RUNS.clear()
    made = [call(SCALED, x, 2.0) for _ in range(3)]
    assert KERNEL_RUNS == [2.0]  # the kernel ran once: its results were made again from their layouts
    assert all(same_layout(m, made[0]) for m in made) and made[0].stride() == x.stride()
    assert len({m.untyped_storage()._cdata for m in made}) == 3  # each a new storage
    assert call(SCALED, x, 3.0).stride() == x.stride() and KERNEL_RUNS == [2.0, 3.0]  # another signature: run
    outs = call(torch.ops.aten.native_layer_norm.default, x, [7], None, None, 1e-5)
    again = call(torch.ops.aten.native_layer_norm.default, x, [7], None, None, 1e-5)
    assert isinstance(again, tuple) and all(map(same_layout, outs, again))


def test_arguments_equal_in_python_but_of_other_types_are_other_signatures():
    # 1 == 1.0 == True, and the result of an int tensor times each has another dtype
    n = torch.empty(4, dtype=torch.int64, device="meta")
    assert call(torch.ops.aten.mul.Scalar, n, 2).dtype == torch.int64
    assert call(torch.ops.aten.mul.Scalar, n, 2.0).dtype == torch.float32
    assert call(torch.ops.aten.sum.dim_IntList, n.view(2, 2), [0], True).shape == (1, 2)
    assert call(torch.ops.aten.sum.dim_IntList, n.view(2, 2), [0, 1]).shape == ()


def test_results_sharing_an_arguments_storage_are_the_kernels_own_every_time():
    # _unsafe_view declares no alias, yet returns its input's storage: remade, it would be a
    # new allocation the meter charges
    x = torch.empty(6, 4, device="meta")
    for _ in range(2):
        out = call(torch.ops.aten._unsafe_view.default, x, [4, 6])
        assert out.untyped_storage()._cdata == x.untyped_storage()._cdata
    for _ in range(2):
        out = call(torch.ops.aten.add_.Tensor, x, x)
        assert out is x


def test_only_operators_on_meta_tensors_alone_are_remade():
    assert on_meta([torch.empty(1, device="meta"), 2])
    assert not on_meta([torch.empty(1, device="meta"), torch.empty(1)])
    assert not on_meta([1, 2.0])
