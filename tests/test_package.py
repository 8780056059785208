"""The public surface: what ``lightning_pipe`` exports, and the documented arguments."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_pipe
from lightning_pipe import CaptureError, InfeasiblePlanError, MemoryPipeStrategy, Plan, StageOutOfMemoryError

ROOT = Path(__file__).parents[1]


def test_the_errors_and_plan_types_are_exported_from_the_package():
    assert {"MemoryPipeStrategy", "CaptureError", "InfeasiblePlanError", "StageOutOfMemoryError", "Plan"} <= set(
        lightning_pipe.__all__
    )
    assert issubclass(InfeasiblePlanError, ValueError) and issubclass(StageOutOfMemoryError, RuntimeError)
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
    code = ("import sys, time; t = time.perf_counter(); import lightning_pipe.plan.plan; "
            "print(time.perf_counter() - t, *(m in sys.modules for m in "
            "('lightning', 'torch', 'lightning_pipe.lightning.strategy')))")
    seconds, *loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True, cwd=ROOT).stdout.split()
    assert loaded == ["False", "False", "False"]
    assert float(seconds) < 1.0


def test_importing_the_strategy_registers_its_name_and_positional_arguments_are_refused():
    code = ("import lightning_pipe; from lightning.pytorch.strategies import StrategyRegistry; "
            "before = 'memory_pipe' in StrategyRegistry; lightning_pipe.MemoryPipeStrategy; "
            "print(before, 'memory_pipe' in StrategyRegistry)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "True"]
    with pytest.raises(TypeError, match="positional"):
        MemoryPipeStrategy(4)  # type: ignore[misc]
    with pytest.raises(AttributeError, match="no attribute 'Strategy'"):
        lightning_pipe.Strategy  # noqa: B018
