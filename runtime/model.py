"""One way to open a model, used by the Generator, `kiln serve`, `kiln batch` (local and Ray workers),
compare-model's artifact side and `kiln plan`:

    select_variant(artifact, variant)   the artifact opened (hashes verified unless told not to) and the
                                        variant this host runs; refused in one line, nothing loaded yet
       -> Selection.open(threads=...)   the memory check (with max_batch_size), the backend, the tokenizer
       -> Model                         artifact, entry, backend, tokenizer; closes its backend on exit

open_model(...) is both at once. The two steps are apart for `kiln serve`, which refuses a bad variant
before it listens and loads the backend on a thread after.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .artifact import Artifact
from .backends.base import Backend, ClosesOnExit
from .backends.registry import open_backend, runnable_variant
from .manifest import Variant
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Selection:
    """A variant of an opened artifact, chosen for this host and not loaded yet."""

    artifact: Artifact
    entry: Variant
    verified: bool = True  # whether the artifact's hashes were checked (a TensorRT engine's host code needs it)
    providers: list[str] | None = None

    @property
    def name(self) -> str:
        return self.entry.name

    def open(self, threads: int | None = None, max_batch_size: int | None = None,
             max_prefill_tokens: int = 512) -> Model:
        """The backend and tokenizer. With max_batch_size, a batch that size at the model's context that
        this host's memory cannot hold is refused first (IncompatibleArtifact), instead of dying later."""
        if max_batch_size is not None:
            from .memory import require_fit

            require_fit(self.artifact.manifest, self.entry, max_batch_size, self.providers, max_prefill_tokens)
        backend = open_backend(self.artifact.folder, self.entry, self.providers, threads, verified=self.verified)
        return Model(self.artifact, self.entry, backend, Tokenizer(self.artifact.tokenizer_dir))


@dataclass
class Model(ClosesOnExit):
    """An artifact's variant, loaded: what the engine and the front-ends run."""

    artifact: Artifact
    entry: Variant
    backend: Backend
    tokenizer: Tokenizer

    def close(self) -> None:
        self.backend.close()


def select_variant(artifact: str | Path | Artifact, variant: str | None = None,
                   providers: list[str] | None = None, verify: bool = True) -> Selection:
    """The artifact (a folder, or one already opened) and its variant `variant`, or without a name the
    first built one this host runs; refused in one line where this host cannot run it."""
    opened = artifact if isinstance(artifact, Artifact) else Artifact.open(artifact, verify=verify)
    return Selection(opened, runnable_variant(opened, variant, providers), verify, providers)


def open_model(artifact: str | Path | Artifact, variant: str | None = None, providers: list[str] | None = None,
               threads: int | None = None, verify: bool = True, max_batch_size: int | None = None,
               max_prefill_tokens: int = 512) -> Model:
    """select_variant, then Selection.open: the whole load in one call."""
    return select_variant(artifact, variant, providers, verify).open(threads, max_batch_size, max_prefill_tokens)
