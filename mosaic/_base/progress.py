"""Progress on a terminal (bytes done, rate, time left); silent when not a TTY or with --json."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from mosaic._base.literal import printable

Advance = Callable[[int], None]


def _noop(_: int) -> None:
    return None


class Reporter:
    """Hands out byte counters for named steps; does nothing when disabled.

    The public API's ``progress=`` takes one: subclass it and override :meth:`step` to receive the counts
    (a notebook's own bars, a CI log); ``step`` returns the function each chunk's count is passed to."""

    def __init__(self, progress: Progress | None = None) -> None:
        self._p = progress

    def step(self, description: str, total: int) -> Advance:
        if self._p is None:
            return _noop
        task = self._p.add_task(printable(description), total=total)
        p = self._p

        def advance(n: int) -> None:
            p.advance(task, n)

        return advance


class _Rate(ProgressColumn):
    """Units per second, for work counted in something other than bytes."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:,.0f} {self.unit}/s" if task.speed else f"? {self.unit}/s")


@contextmanager
def reporter(enabled: bool | None = None, unit: str = "bytes") -> Iterator[Reporter]:
    """A Reporter drawing on stderr when it is a terminal (or when ``enabled`` says so); counts are
    bytes (with transfer rates) unless ``unit`` names another unit (tokens, rows)."""
    on = sys.stderr.isatty() if enabled is None else enabled
    if not on:
        yield Reporter(None)
        return
    counts = (DownloadColumn(), TransferSpeedColumn()) if unit == "bytes" else (MofNCompleteColumn(), _Rate(unit))
    progress = Progress(
        TextColumn("{task.description}", markup=False),  # descriptions hold names: never markup
        BarColumn(),
        *counts,
        TimeRemainingColumn(),
        console=Console(stderr=True, highlight=False, emoji=False),
        transient=False,
    )
    with progress:
        yield Reporter(progress)


SILENT = Reporter(None)

