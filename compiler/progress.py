"""Visible progress: each stage with its elapsed time and peak memory, a bar for the long loops.
Writes to stderr."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StageLog:
    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console(stderr=True, highlight=False, emoji=False, quiet=quiet)
        self.seconds: dict[str, float] = {}
        self.peak_rss: dict[str, int] = {}  # bytes, the highest resident set seen during each stage
        self.step_seconds: dict[str, float] = {}  # the same for steps inside a stage, as "stage / step"
        self.step_peak_rss: dict[str, int] = {}
        self._stage: str | None = None

    @contextlib.contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[None]:
        # Details are user text (paths, sources): never rich markup or :emoji: codes.
        self.console.print(f"[bold]→ {escape(name)}[/bold] {escape(detail)}".rstrip())
        start = time.perf_counter()
        sampler = PeakRss()
        self._stage = name
        try:
            with sampler:
                yield
        except BaseException:
            self.console.print(f"[red]✗ {name}[/red] failed after {time.perf_counter() - start:.1f} s")
            raise
        finally:
            self._stage = None
        self.seconds[name] = round(time.perf_counter() - start, 2)
        self.peak_rss[name] = sampler.peak
        release_freed_memory()
        self.console.print(f"[green]✓ {name}[/green] {self.seconds[name]:.1f} s, peak memory "
                           f"{sampler.peak / 2**30:.2f} GiB")

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """A part of the current stage, timed and measured like one (recorded as `stage / step`), so a
        stage's peak can be traced to the step that set it."""
        key = f"{self._stage} / {name}" if self._stage else name
        start = time.perf_counter()
        with PeakRss() as sampler:
            yield
        self.step_seconds[key] = round(time.perf_counter() - start, 2)
        self.step_peak_rss[key] = sampler.peak
        self.console.print(f"  {escape(name)}: {self.step_seconds[key]:.1f} s, peak memory "
                           f"{sampler.peak / 2**30:.2f} GiB")

    def records(self) -> dict[str, dict[str, float]]:
        """The stages' and steps' seconds and peaks, for merge in another process's log."""
        return {"seconds": self.seconds, "peak_rss": self.peak_rss, "step_seconds": self.step_seconds,
                "step_peak_rss": self.step_peak_rss}

    def merge(self, records: dict[str, dict[str, float]], beside: int = 0) -> None:
        """Another process's stages (records()), as if run here; `beside`: the bytes this process held
        meanwhile, added to their peaks, so a peak is what the host held."""
        self.seconds.update(records["seconds"])
        self.step_seconds.update(records["step_seconds"])
        self.peak_rss.update({k: v + beside for k, v in records["peak_rss"].items()})
        self.step_peak_rss.update({k: v + beside for k, v in records["step_peak_rss"].items()})

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


class PeakRss:
    """The highest resident set size of this process while the block runs: sampled every few ms by a
    thread (ru_maxrss only ever gives the whole process's peak so far), and ru_maxrss itself where the
    block sets a new all-time peak between two samples."""

    INTERVAL = 0.005

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="peak-rss")

    def __enter__(self) -> PeakRss:
        self._max_before = _max_rss()
        self.peak = current_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())
        if _max_rss() > self._max_before:  # a new all-time peak was set inside the block
            self.peak = max(self.peak, _max_rss())

    def _sample(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            self.peak = max(self.peak, current_rss())


def current_rss() -> int:
    """Resident bytes now (Linux /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_freed_memory() -> None:
    """Hand what a stage freed back to the system before the next stage allocates its own: Python's
    cycles first, then glibc's free lists, which otherwise keep a freed graph's hundreds of MB resident
    (malloc_trim; a no-op where the C library has none)."""
    gc.collect()
    trim = c_library_function("malloc_trim")
    if trim is not None:
        trim(0)


@functools.cache
def c_library_function(function: str) -> Any:
    """A function of the C library, looked up once (find_library runs ldconfig in a subprocess), or
    None where there is no such library or function."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None

