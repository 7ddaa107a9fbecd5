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
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import IncompatibleArtifact
from ..manifest import Interface, Manifest, Variant
from .base import Backend, HostFit, provider_names

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
    devices: frozenset[str]  # the --device kinds that run it ("cpu", "cuda"); auto runs every kind
    # Whether other tools (Optimum, onnxruntime-genai) can be handed the variant's graph.
    opens_in_other_tools: bool

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


# In the order they are tried: an entry with an engine runs it, even though it has a model.onnx too.
KINDS = (
    BackendKind("tensorrt", "engine", "runtime.backends.tensorrt", "device", "TensorRT engine", frozenset({"cuda"}),
                False),
    # A CUDA variant's graph also runs under the CPU provider, as compile-model validated it (--device cpu).
    BackendKind("onnxruntime-cuda", "providers", "runtime.backends.onnxruntime_cuda", "device", "ONNX Runtime CUDA",
                frozenset({"cuda", "cpu"}), False),
    BackendKind("onnxruntime", "model", "runtime.backends.onnxruntime", "host", "ONNX Runtime CPU", frozenset({"cpu"}),
                True),
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


def runnable_variant(artifact: Artifact, name: str | None = None, providers: list[Any] | None = None) -> Variant:
    """artifact.variant(name) where this host runs it on the device `providers` name (runtime/device.py),
    refused in one line before anything is loaded where it does not (a CPU variant asked for on CUDA, a
    CUDA variant where this host has no GPU, a variant for Kiln's CPU kernels alone where they do not
    run); without a name, the first built variant this host runs there, one built for that device
    first (for auto: one built for a GPU, where this host has one)."""
    device = device_of(providers)
    if name is None:
        runnable = [(n, e) for n, e in artifact.manifest.built().items()
                    if (device == "auto" or device in kind_of(e).devices) and not refusal(e, providers)]
        native = [n for n, e in runnable if _built_for(n, e, device, artifact.manifest)]
        name = next(iter(native), None) or next((n for n, _ in runnable), None)
    entry = artifact.variant(name)
    refused = device_refusal(entry, device) or refusal(entry, providers)
    if refused:
        raise IncompatibleArtifact(refused)
    return entry


def _built_for(name: str, entry: Variant, device: str, manifest: Manifest) -> bool:
    """Whether the device is the one the variant is built for: a CPU variant on cpu, a GPU variant on cuda
    (and on auto, where this host runs it there)."""
    on_gpu = kind_of(entry).memory == "device"
    if device == "auto":
        return on_gpu and host_fit(name, entry, manifest).fits
    return on_gpu == (device == "cuda")


def device_of(providers: list[Any] | None) -> str:
    """The --device kind `providers` ask for: auto (none given), cuda (ONNX Runtime's CUDA provider) or cpu."""
    if providers is None:
        return "auto"
    return "cuda" if "CUDAExecutionProvider" in provider_names(providers) else "cpu"


def device_refusal(entry: Variant, device: str) -> str | None:
    kind = kind_of(entry)
    if device == "auto" or device in kind.devices:
        return None
    if device == "cuda":
        return (f"variant {entry.name!r} is built for the CPU (target {entry.target}), not for CUDA: run it with "
                "--device cpu, or compile a variant with target: onnxruntime-cuda")
    return (f"variant {entry.name!r} runs on a GPU ({kind.runs_on}), not on the CPU: run it with --device cuda "
            "on a GPU host, or pick a CPU variant")


def served_interface(entry: Variant, providers: list[str] | None = None) -> Interface:
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
    device = device_of(providers)
    return kind_of(entry).memory == "host" if device == "auto" else device == "cpu"


def runs_on(entry: Variant) -> str:
    return kind_of(entry).runs_on


def opens_in_other_tools(entry: Variant) -> bool:
    """Whether the variant's graph is one Optimum and onnxruntime-genai open: an ONNX Runtime graph of an
    onnxruntime target (a TensorRT variant's graph is built for TensorRT's parser)."""
    return kind_of(entry).opens_in_other_tools and entry.target == Target.ONNXRUNTIME
