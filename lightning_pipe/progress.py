"""Progress for people: a bar on stderr while a long step (profiling, planning) runs, shown
only on a terminal, so that logs and captured output hold nothing but results."""

from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["progress_bar", "tracker"]


def progress_bar() -> Progress:
    """A transient bar on stderr, disabled where stderr is not a terminal."""
    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, redirect_stdout=False, redirect_stderr=False,
                    disable=not console.is_terminal)


def tracker(bar: Progress, description: str, total: int | None = None) -> Callable[[int, int], None]:
    """A ``(done, total)`` callback moving a new task of ``bar``; ``total`` unknown until the
    first call (``None``): each call's sets it."""
    task = bar.add_task(description, total=total)
    return lambda done, total_: bar.update(task, completed=done, total=total_)
