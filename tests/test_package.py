"""The public surface: what ``lightning_pipe`` exports, and the documented arguments."""

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_pipe
from lightning_pipe import (
    CaptureError,
    InfeasiblePlanError,
    MemoryPipeStrategy,
    Plan,
    RecoveryError,
    StageOutOfMemoryError,
)

ROOT = Path(__file__).parents[1]


def test_the_errors_and_plan_types_are_exported_from_the_package():
    assert {"MemoryPipeStrategy", "CaptureError", "InfeasiblePlanError", "StageOutOfMemoryError", "RecoveryError",
            "Plan", "PlanRequest"} <= set(lightning_pipe.__all__)
    assert issubclass(InfeasiblePlanError, ValueError) and issubclass(StageOutOfMemoryError, RuntimeError)
    assert issubclass(RecoveryError, RuntimeError)
    assert issubclass(CaptureError, Exception) and callable(Plan.from_json)
    assert (ROOT / "lightning_pipe" / "py.typed").exists()


def test_docs_options_lists_every_argument_of_the_constructor():
    table = (ROOT / "docs" / "options.md").read_text().split("\n## ")[0]  # before the first subsection
    documented = re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE)
    # the Trainer fills these three in, as for Lightning's own strategies (said below the table)
    own = [n for n in inspect.signature(MemoryPipeStrategy).parameters
           if n not in ("accelerator", "parallel_devices", "precision_plugin")]
    assert sorted(documented) == sorted(own)
    parameters = inspect.signature(MemoryPipeStrategy).parameters.values()
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)


def test_the_planner_imports_without_lightning_torch_or_the_strategy():
    # CPU time, not wall time: the import's own cost, whatever else the machine runs
    code = ("import sys, time; t = time.process_time(); import lightning_pipe.plan.plan; "
            "print(time.process_time() - t, *(m in sys.modules for m in "
            "('lightning', 'torch', 'lightning_pipe.lightning.strategy')))")
    seconds, *loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True, cwd=ROOT).stdout.split()
    assert loaded == ["False", "False", "False"]
    assert float(seconds) < 1.0


# One fresh process for what only a fresh process shows (each start imports torch and Lightning,
# most of such a test's time): what importing lightning_pipe registers, loads and leaves alone.
FRESH_IMPORTS = """
import sys
import lightning
from lightning.pytorch.strategies import StrategyRegistry
before = set(sys.modules)
import lightning_pipe
registered = ['memory_pipe' in StrategyRegistry]
lightning_pipe.MemoryPipeStrategy
registered.append('memory_pipe' in StrategyRegistry)
import lightning_pipe.cli
new = [m for m in set(sys.modules) - before if m.split('.')[0] == 'transformers']
assert not new, new
from lightning_pipe.plan import report
import matplotlib
after_import = matplotlib.get_backend()
from tests.lightning.test_reporting import _plan
report.save(_plan([2**20], [2**30]), sys.argv[1])
pyplot = sys.modules.get("matplotlib.pyplot")
print(*registered, after_import, matplotlib.get_backend(), len(pyplot.get_fignums()) if pyplot else 0)
"""


@pytest.mark.slow
def test_importing_lightning_pipe_registers_the_strategy_adds_no_transformers_and_leaves_matplotlib_alone(tmp_path):
    """In a fresh process: importing the strategy registers its name (importing the package
    does not yet); lightning_pipe, its strategy and its CLI add no module of transformers to
    what Lightning loaded (Lightning itself imports transformers where it is installed, for
    torchmetrics' BERTScore); and importing lightning_pipe and saving a plan picks no
    matplotlib backend for the process (a notebook's inline one) nor leaves figures for the
    user's ``plt.show()``. (No module of lightning_pipe names transformers: test_hf_models.py.)"""
    out = subprocess.run([sys.executable, "-c", FRESH_IMPORTS, str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, env={**os.environ, "MPLBACKEND": "svg"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "svg", "svg", "0"]
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_positional_arguments_and_unknown_names_are_refused():
    with pytest.raises(TypeError, match="positional"):
        MemoryPipeStrategy(4)  # type: ignore[misc]
    with pytest.raises(AttributeError, match="no attribute 'Strategy'"):
        lightning_pipe.Strategy  # noqa: B018



def private_uses(path: Path) -> list[str]:
    """``file:line: what`` for each private name of ``lightning_pipe`` a test file reaches: an
    import of ``_name`` or of a module ``_mod``, or ``module._name`` on a module it imported
    from the package (names with one leading underscore; ``__version__`` and the like are public)."""
    private = re.compile(r"^_(?!_)")
    found: list[tuple[int, str]] = []
    modules: set[str] = set()  # the names the file binds to the package's modules

    def in_package(module: str | None) -> bool:
        return module is not None and (module == "lightning_pipe" or module.startswith("lightning_pipe."))

    def is_module(dotted: str) -> bool:
        base = ROOT.joinpath(*dotted.split("."))
        return base.with_suffix(".py").exists() or (base / "__init__.py").exists()

    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if in_package(alias.name):
                    if any(private.match(part) for part in alias.name.split(".")):
                        found.append((node.lineno, f"import {alias.name}"))
                    modules.add(alias.asname or "lightning_pipe")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and in_package(node.module):
            module = str(node.module)
            if any(private.match(part) for part in module.split(".")):
                found.append((node.lineno, f"from {module} import ..."))
            for alias in node.names:
                if private.match(alias.name):
                    found.append((node.lineno, f"from {module} import {alias.name}"))
                elif is_module(f"{module}.{alias.name}"):
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private.match(node.attr):
            owner = node.value
            while isinstance(owner, ast.Attribute):
                owner = owner.value
            if isinstance(owner, ast.Name) and owner.id in modules:
                found.append((node.lineno, ast.unparse(node)))
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{shown}:{line}: {what}" for line, what in sorted(found)]


def test_tests_reach_the_package_through_public_names_only():
    found = [use for path in sorted((ROOT / "tests").rglob("*.py")) for use in private_uses(path)]
    assert not found, "tests use private names of lightning_pipe; test through a public function, or make the " \
                      "concept public:\n" + "\n".join(found)


def test_a_private_use_is_named_with_its_file_and_line(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        "import lightning_pipe.measure._hidden\n"
        "from lightning_pipe.measure.meta import _RESULTS, meta_call\n"
        "from lightning_pipe import __version__\n"
        "from lightning_pipe.measure import profiler as p\n"
        "p._time_node, p.elapsed_ms, profiler._not_the_package\n"
        "lightning_pipe.measure._x\n"
        "from lightning_pipe.plan._private import name\n"
    )
    assert private_uses(planted) == [
        f"{planted}:1: import lightning_pipe.measure._hidden",
        f"{planted}:2: from lightning_pipe.measure.meta import _RESULTS",
        f"{planted}:5: p._time_node",
        f"{planted}:6: lightning_pipe.measure._x",
        f"{planted}:7: from lightning_pipe.plan._private import ...",
    ]
