"""Visible progress: each stage with its elapsed time, a bar for the long loops. Writes to stderr."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StageLog:
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False, emoji=False)
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[None]:
        # Details are user text (paths, sources): never rich markup or :emoji: codes.
        self.console.print(f"[bold]→ {escape(name)}[/bold] {escape(detail)}".rstrip())
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.console.print(f"[red]✗ {name}[/red] failed after {time.perf_counter() - start:.1f} s")
            raise
        self.seconds[name] = round(time.perf_counter() - start, 2)
        self.console.print(f"[green]✓ {name}[/green] {self.seconds[name]:.1f} s")

    @contextlib.contextmanager
    def bar(self, description: str, total: float) -> Iterator[callable]:
        columns = (TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=True) as progress:
            task = progress.add_task(description, total=total)
            yield lambda amount=1: progress.advance(task, amount)

    @contextlib.contextmanager
    def spinner(self, text: str) -> Iterator[None]:
        """For a long step that reports no progress of its own (the torch exporter)."""
        with self.console.status(f"  {text}", spinner="dots"):
            yield

    def note(self, text: str) -> None:
        self.console.print(f"  {escape(text)}")
