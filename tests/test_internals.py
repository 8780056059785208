"""The fence around torch's private APIs (:mod:`lightning_pipe.internals`): each name still
exists and does what the package relies on, against the installed torch. A failure here means
torch changed a private API the package uses: fix the fence before widening the torch range in
pyproject.toml. The last tests scan the package for a private torch, Lightning or torchmetrics
name used outside the two fences."""

import ast
import importlib
import inspect
import types
from functools import cache
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pipe import internals as fence

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"
FENCES = {PACKAGE / "internals.py", PACKAGE / "lightning" / "internals.py"}
EXTERNAL = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics")


# --- the torch fence, name by name ---------------------------------------------------------------

def test_pytree_flattens_and_rebuilds_nested_batches() -> None:
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), 3)}
    leaves, spec = fence.tree_flatten(batch)
    assert isinstance(spec, fence.TreeSpec) and len(leaves) == 3
    assert fence.tree_unflatten(leaves, spec).keys() == batch.keys()
    assert fence.tree_structure(batch) == spec
    doubled = fence.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, batch)
    assert doubled["x"].tolist() == [2.0, 2.0] and doubled["pair"][1] == 3
    paths = [path for path, _ in fence.tree_flatten_with_path(batch)[0]]
    assert isinstance(paths[0][0], fence.MappingKey) and isinstance(paths[1][1], fence.SequenceKey)
    assert fence.GetAttrKey("a").name == "a"


def test_fake_tensors_have_no_data_and_say_when_a_result_needs_it() -> None:
    with fence.FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.ones(3)
        assert isinstance(x, fence.FakeTensor)
        with pytest.raises(fence.DynamicOutputShapeException):
            torch.nonzero(x)
        with pytest.raises(fence.DataDependentOutputException):
            x.sum().item()


def test_dispatch_mode_sees_each_operator_and_its_schema() -> None:
    seen = []

    class Seen(fence.TorchDispatchMode):  # type: ignore[misc]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(fence.op_schema(func))
            return func(*args, **(kwargs or {}))

    x = torch.ones(2)
    with Seen():
        x.add_(1)
        x.view(2, 1)
    in_place, view = seen
    assert in_place.is_mutable and in_place.arguments[0].alias_info.is_write
    assert view.returns[0].alias_info is not None and not view.is_mutable
    assert fence.op_schema(len) is None  # not an operator


def test_batch_norm_base_covers_every_batch_norm() -> None:
    layers = [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2), nn.LazyBatchNorm1d()]
    assert all(isinstance(m, fence.BatchNormBase) for m in layers)
    assert not isinstance(nn.LayerNorm(2), fence.BatchNormBase)
    fence.check_input_dim(nn.BatchNorm2d(2), torch.ones(1, 2, 3, 3))
    with pytest.raises(ValueError, match="4D"):
        fence.check_input_dim(nn.BatchNorm2d(2), torch.ones(1, 2))


def test_backward_is_told_from_forward() -> None:
    seen = {}

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def,override]
            seen["forward"] = fence.current_autograd_node(), fence.current_graph_task_id()
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def,override]
            seen["backward"] = fence.current_autograd_node(), fence.current_graph_task_id()
            return grad

    Spy.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen["forward"] == (None, -1)
    node, task = seen["backward"]
    assert isinstance(node, torch.autograd.graph.Node) and task != -1


def test_outer_saved_tensors_hooks_are_the_innermost_pair() -> None:
    assert fence.outer_saved_tensors_hooks() is None

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert fence.outer_saved_tensors_hooks() == (pack, unpack)


def test_tensor_internals() -> None:
    buffer = torch.zeros(2)
    version = buffer._version
    with torch.no_grad(), fence.preserve_version_counter(buffer):
        buffer.copy_(torch.ones(2))
    assert buffer._version == version and buffer.tolist() == [1.0, 1.0]

    w = nn.Parameter(torch.ones(2, 3))
    assert fence.view_base(w.t()) is w and fence.view_base(torch.ones(1)) is None

    t = torch.ones(1)
    fence.mark_as_parameter(t)
    assert isinstance(t, nn.Parameter)

    x = torch.ones(4)
    assert fence.storage_key(x[:2]) == fence.storage_key(x[2:]) != fence.storage_key(torch.ones(4))


def test_module_tables_are_the_modules_own() -> None:
    bn = nn.BatchNorm1d(2)
    params, buffers = fence.parameter_table(bn), fence.buffer_table(bn)
    assert set(params) == {"weight", "bias"} and {"running_mean", "running_var"} <= set(buffers)
    stand_in = torch.empty(2, device="meta")
    buffers["running_mean"] = stand_in  # written without setattr's checks
    assert bn.running_mean is stand_in
    fence.module_apply(bn, lambda t: t if t.is_meta else t.double())
    assert bn.weight.dtype == torch.float64 and bn.running_mean is stand_in


def test_aten_private_operators() -> None:
    assert fence.op_schema(fence.ASSERT_TENSOR_METADATA).name == "aten::_assert_tensor_metadata"
    assert "_scaled_dot_product_flash_attention_for_cpu" in str(fence.CPU_FLASH_ATTENTION)
    assert str(fence.TO_COPY) == "aten._to_copy.default"
    assert fence.CPU_FLASH_ATTENTION_BACKWARD.default is not None
    # measure.attention calls the CUDA kernels by these positional schemas
    arguments = {op: [a.name for a in fence.op_schema(op.default).arguments] for op in
                 (fence.CUDA_FLASH_ATTENTION, fence.CUDA_EFFICIENT_ATTENTION, fence.MATH_ATTENTION)}
    assert arguments[fence.CUDA_FLASH_ATTENTION][:6] == ["query", "key", "value", "dropout_p", "is_causal",
                                                         "return_debug_mask"]
    assert arguments[fence.CUDA_EFFICIENT_ATTENTION][:7] == ["query", "key", "value", "attn_bias",
                                                             "compute_log_sumexp", "dropout_p", "is_causal"]
    assert arguments[fence.MATH_ATTENTION][:7] == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                                                   "dropout_mask"]


def test_memory_events_report_allocations() -> None:
    assert not fence.profiler_enabled()
    fence.start_memory_events()
    try:
        assert fence.profiler_enabled()
        torch.empty(1 << 20)
    finally:
        threads = fence.stop_memory_events()
    events = [e for thread in threads for e in thread]
    start = events[0]
    assert any(e.cpu_memory_usage() >= 4 << 20 for e in events)
    assert all(start.cpu_elapsed_us(e) >= 0 for e in events) and all(e.cuda_memory_usage() == 0 for e in events)


def test_distributed_internals() -> None:
    group = fence.fake_process_group(1, 4)
    assert (group.rank(), group.size()) == (1, 4)
    with pytest.raises((RuntimeError, ValueError)):  # no process group: what the caller catches
        fence.default_store()


def test_pipelining_stages_still_vote_through_the_overridden_methods() -> None:
    from torch.distributed.pipelining import PipelineStage, schedules

    assert issubclass(PipelineStage, fence.PipelineStageBase)
    for name in ("_warmup_forward_vote", "_warmup_backward_result"):
        ours, torchs = inspect.signature(getattr(fence.NoWarmupVotes, name)), inspect.signature(getattr(
            PipelineStage, name))
        assert list(ours.parameters) == list(torchs.parameters), name
        assert f".{name}(" in inspect.getsource(schedules), name  # the schedules still call it
        with fence.FakeTensorMode():  # a fake rank's check reads the vote within a fake mode
            assert getattr(fence.NoWarmupVotes(), name)(True if name.endswith("vote") else None).item() == 1


def test_a_pipelining_stage_still_keeps_its_forwards_and_backwards_where_a_skipped_backward_writes() -> None:
    source = inspect.getsource(fence.PipelineStageBase)  # backward_one_chunk's reads and writes
    assert "self.fwd_cache.pop(bwd_chunk_id)" in source and "self.bwd_cache[bwd_chunk_id]" in source

    stage = types.SimpleNamespace(fwd_cache={0: "activations", 1: "activations"}, bwd_cache={})  # what it touches
    fence.skip_backward(stage, 0, 2)
    assert stage.fwd_cache == {1: "activations"} and stage.bwd_cache == {0: (None, None)}


def test_a_pipelining_stage_still_keeps_a_split_backward_where_a_skipped_weight_step_drops_it() -> None:
    source = inspect.getsource(fence.PipelineStageBase)  # the input step fills, the weight step reads
    assert "self.dw_runner[bwd_chunk_id] = " in source and "self.backward_state[bwd_chunk_id] = (" in source
    assert "if bwd_chunk_id not in self.dw_runner:" in source and "self.backward_state.pop(bwd_chunk_id)" in source

    stage = types.SimpleNamespace(dw_runner={0: "run", 1: "run"}, backward_state={0: "state"})
    fence.skip_weight_backward(stage, 0)
    assert stage.dw_runner == {1: "run"} and stage.backward_state == {}


# --- nothing private outside the fences ---------------------------------------------------------

def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@cache
def _modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it names (``module`` or ``module.attr``), from the module's imports."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """The private names the package defines itself (functions, classes, attributes of its own)."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
    return {name for name in own if _private(name)}


def _external_classes() -> list[type]:
    """Classes whose private attributes the package must reach only through a fence."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import Strategy
    from torchmetrics import Metric

    return [nn.Module, torch.Tensor, torch.optim.Optimizer, LightningModule, Trainer, Strategy, Metric]


def test_no_private_import_outside_the_fences() -> None:
    found = []
    for path, tree in _modules().items():
        if path in FENCES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in EXTERNAL:
                if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] in EXTERNAL and any(map(_private, a.name.split(".")))]
    assert not found, "private modules or names imported outside the fences:\n" + "\n".join(found)


def test_no_private_attribute_outside_the_fences() -> None:
    """``x._name`` (or ``getattr(x, "_name")``) outside the fences is the package's own name on
    the package's own object: not reached through a torch or Lightning module (``torch._C``),
    not a name only torch, Lightning or torchmetrics defines, not one their classes have."""
    trees = _modules()
    own = _own_names({p: t for p, t in trees.items() if p not in FENCES})
    theirs = {name for cls in _external_classes() for name in dir(cls) if _private(name)}
    found = []
    for path, tree in trees.items():
        if path in FENCES:
            continue
        imports = _imports(tree)
        for node in ast.walk(tree):
            name, owner = None, None
            if isinstance(node, ast.Attribute) and _private(node.attr):
                name, owner = node.attr, node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value)):
                name, owner = node.args[1].value, node.args[0]
            if name is None:
                continue
            root = owner
            while isinstance(root, ast.Attribute):
                root = root.value
            through_module = isinstance(root, ast.Name) and imports.get(root.id, "").split(".")[0] in EXTERNAL
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls") and not through_module:
                continue  # see test_no_private_override_outside_the_fences
            if through_module or name not in own or name in theirs:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "private torch/Lightning attributes used outside the fences:\n" + "\n".join(found)


def _bases(path: Path, tree: ast.Module, cls: ast.ClassDef, trees: dict[Path, ast.Module]) -> list[type]:
    """The external classes ``cls`` derives from, through the package's own classes."""
    imports = _imports(tree)
    found: list[type] = []
    for base in cls.bases:
        dotted = ast.unparse(base)
        head, _, rest = dotted.partition(".")
        target = imports.get(head, head) + (f".{rest}" if rest else "")
        local = next((c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == dotted), None)
        if local is not None:
            found += _bases(path, tree, local, trees)
        elif target.split(".")[0] == "lightning_pipe":
            module, _, name = target.rpartition(".")
            other = PACKAGE.parent / (module.replace(".", "/") + ".py")
            if other in FENCES:
                continue  # a fence's class may reach privates: that is where they belong
            other_tree = trees[other]
            owner = next(c for c in other_tree.body if isinstance(c, ast.ClassDef) and c.name == name)
            found += _bases(other, other_tree, owner, trees)
        elif target.split(".")[0] in EXTERNAL:
            module, _, name = target.rpartition(".")
            try:
                found.append(getattr(importlib.import_module(module), name))
            except ModuleNotFoundError:  # torch.autograd.graph.saved_tensors_hooks: a module attribute
                parent, _, attr = module.rpartition(".")
                found.append(getattr(getattr(importlib.import_module(parent), attr), name))
    return found


def test_no_private_override_outside_the_fences() -> None:
    """A class of the package deriving from a torch or Lightning class neither overrides nor
    touches (``self._name``) a private member of it: such a member goes in a fence's mix-in."""
    trees = _modules()
    found = []
    for path, tree in trees.items():
        if path in FENCES:
            continue
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            external = _bases(path, tree, cls, trees)
            if not external:
                continue
            names = {n.name: n.lineno for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            names |= {n.attr: n.lineno for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")}
            found += [f"{path.relative_to(PACKAGE)}:{line}: {cls.name}.{name} ({base.__qualname__}'s)"
                      for name, line in names.items() if _private(name)
                      for base in external if hasattr(base, name)]
    assert not found, "private members of torch/Lightning classes used outside the fences:\n" + "\n".join(found)


def test_the_dispatcher_lists_autocasts_kernels_and_a_library_is_taken_back_at_once() -> None:
    assert {"linear", "softmax.int", "layer_norm"} <= set(fence.registered_operators("AutocastCUDA"))
    assert "linear" in fence.registered_operators("AutocastCPU")
    assert "softmax.int" not in fence.registered_operators("AutocastCPU")
    library = torch.library.Library("aten", "IMPL")
    library.impl("softmax.int", lambda *args: None, "AutocastCPU")
    assert "softmax.int" in fence.registered_operators("AutocastCPU")
    fence.remove_library(library)
    assert "softmax.int" not in fence.registered_operators("AutocastCPU")
