"""The kinds of backend, one row each, and the questions every caller asks of a variant through them.

A variant's manifest entry names its kind by the file it runs: an `engine` (TensorRT) or a `model`
(an ONNX graph, run by ONNX Runtime). Loading, `kiln verify` and `kiln install`'s host check,
compare-model, memory planning and interop ask this module, never the entry's keys or its target
string. A new backend is one module beside this one (open_variant, refusal, served_interface,
host_fit, and a class that follows base.Backend) and one row in KINDS.

The recipe's `target` says which graph the compiler builds (Target below); the kind says what runs
it. They differ where a TensorRT variant is compiled on a host without a GPU: its standard-ops graph
has no engine yet and runs, for its checks, on ONNX Runtime.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import IncompatibleArtifact
from ..manifest import Manifest, Variant
from .base import CPU_PROVIDERS, Backend, HostFit

if TYPE_CHECKING:
    from ..artifact import Artifact


class Target(StrEnum):
    """What a recipe variant is compiled for (compiler/recipe.py's `target`)."""

    ONNXRUNTIME = "onnxruntime"  # ONNX Runtime on the CPU (and Kiln's CPU kernels)
    ONNXRUNTIME_CUDA = "onnxruntime-cuda"  # ONNX Runtime's CUDA provider (onnxruntime-gpu)
    TENSORRT = "tensorrt"


# The targets whose graphs ONNX Runtime runs, fused with its contrib ops (GroupQueryAttention, RMSNorm).
ONNXRUNTIME_TARGETS = frozenset({Target.ONNXRUNTIME, Target.ONNXRUNTIME_CUDA})


@dataclass(frozen=True)
class BackendKind:
    name: str
    manifest_key: str  # the key of a variant's manifest entry that names this kind's file
    module: str  # the module with open_variant, refusal, served_interface and host_fit
    memory: str  # where its weights and KV cache live: "host" (planned here) or "device" (a GPU's)
    runs_on: str  # a few words for reports
    # Whether other tools (Optimum, onnxruntime-genai) can be handed the variant's graph.
    opens_in_other_tools: bool

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


# In the order they are tried: an entry with an engine runs it, even though it has a model.onnx too.
KINDS = (
    BackendKind("tensorrt", "engine", "runtime.backends.tensorrt", "device", "TensorRT engine", False),
    BackendKind("onnxruntime-cuda", "providers", "runtime.backends.onnxruntime_cuda", "device", "ONNX Runtime CUDA",
                False),
    BackendKind("onnxruntime", "model", "runtime.backends.onnxruntime", "host", "ONNX Runtime CPU", True),
)


def kind_of(entry: Variant) -> BackendKind:
    """The kind of backend that runs a variant's manifest entry."""
    kind = next((kind for kind in KINDS if getattr(entry, kind.manifest_key) is not None), None)
    if kind is None:
        keys = " or ".join(repr(kind.manifest_key) for kind in KINDS)
        raise IncompatibleArtifact(f"variant {entry.name!r} names no file to run ({keys}); "
                                   "recompile the artifact")
    return kind


def open_backend(folder: Path, entry: Variant, providers: list[str] | None = None,
                 threads: int | None = None, verified: bool = True) -> Backend:
    """The backend a variant's manifest entry calls for on this host (its TensorRT engine, its graph for
    Kiln's CPU kernels where they run here, or its ONNX graph). Close it, or use it in a `with`."""
    return kind_of(entry).load().open_variant(folder, entry, providers, threads, verified)


def refusal(entry: Variant, providers: list[str] | None = None) -> str | None:
    """Why this host may not run the variant, where that is known before anything loads; else None."""
    return kind_of(entry).load().refusal(entry, providers)


def runnable_variant(artifact: Artifact, name: str | None = None, providers: list[str] | None = None) -> Variant:
    """artifact.variant(name) where this host runs it, refused in one line before anything is loaded where
    it does not (a variant for Kiln's CPU kernels alone, and they do not run here); without a name, the
    first built variant this host runs."""
    if name is None:
        name = next((n for n, e in artifact.manifest.built().items() if not refusal(e, providers)), None)
    entry = artifact.variant(name)
    refused = refusal(entry, providers)
    if refused:
        raise IncompatibleArtifact(refused)
    return entry


def served_interface(entry: Variant, providers: list[str] | None = None) -> Mapping[str, Any]:
    """The interface of the graph open_backend runs for the entry on this host (the memory plan's too)."""
    return kind_of(entry).load().served_interface(entry, providers)


def host_fit(name: str, entry: Variant, manifest: Manifest) -> HostFit:
    """Whether this host runs a variant: built, and its kind's own check (runtime versions, the GPU)."""
    if not entry.built:
        return HostFit(name, entry.target, "-", "-", False, f"{entry.status}: {entry.why_not_built()}")
    return kind_of(entry).load().host_fit(name, entry, manifest)


def memory_on_host(entry: Variant, providers: list[str] | None = None) -> bool:
    """Whether the variant's weights and KV cache would be this host's memory (not a GPU's) when run with
    `providers`: what memory planning plans."""
    return kind_of(entry).memory == "host" and (providers or CPU_PROVIDERS)[0] == CPU_PROVIDERS[0]


def runs_on(entry: Variant) -> str:
    return kind_of(entry).runs_on


def opens_in_other_tools(entry: Variant) -> bool:
    """Whether the variant's graph is one Optimum and onnxruntime-genai open: an ONNX Runtime graph of an
    onnxruntime target (a TensorRT variant's graph is built for TensorRT's parser)."""
    return kind_of(entry).opens_in_other_tools and entry.target == Target.ONNXRUNTIME
