"""The public surface: what ``lightning_pipe`` exports, and the documented arguments."""

import inspect
import re
from pathlib import Path

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
