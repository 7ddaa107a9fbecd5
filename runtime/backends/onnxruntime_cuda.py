"""ONNX Runtime's CUDA provider: the backend of `target: onnxruntime-cuda` variants, whose graphs are
half precision end to end and predicted at compile time to run every compute node on CUDA
(compiler/cuda_placement.py). Their manifest entry names the providers it is built for.

The session is ONNX Runtime's (backends/onnxruntime.py, OnnxRuntimeBackend) with the CUDA provider
first. Asked for the CPU provider alone, the same graph runs on the CPU, as compile-model validated it
against eager: for checks and A/B on a machine without a GPU, not for speed.

Not run on a GPU by this project yet (docs/gpu.md): the KV cache is bound from host memory, not kept
on the device between steps.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import IncompatibleArtifact
from ..manifest import Manifest, Variant
from .base import HostFit, provider_names

CUDA_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")  # the CPU's: shape arithmetic
MIN_ONNXRUNTIME_GPU = "1.31.1"  # the release whose CUDA kernels the compile checked the graph against


def open_variant(folder: Path, entry: Variant, providers: list[str] | None = None, threads: int | None = None,
                 verified: bool = True) -> Any:
    """The variant's graph on ONNX Runtime with `providers` (default: CUDA, then the CPU for shape arithmetic)."""
    from .onnxruntime import OnnxRuntimeBackend

    refused = refusal(entry, providers)
    if refused:
        raise IncompatibleArtifact(refused)
    return OnnxRuntimeBackend(folder / entry.model, entry.interface, list(providers or CUDA_PROVIDERS), threads)


def refusal(entry: Variant, providers: list[str] | None = None) -> str | None:
    """Why this host may not run the variant with `providers`, before anything loads: CUDA asked for (or
    left to the default) where this onnxruntime has no CUDA provider or no GPU is visible."""
    if providers is not None and "CUDAExecutionProvider" not in provider_names(providers):
        return None  # the CPU provider alone: the graph as compile-model validated it
    why = cuda_missing()
    if why is None:
        return None
    return (f"variant {entry.name!r} is built for ONNX Runtime's CUDA provider, and {why}; run it on a host with "
            "an NVIDIA GPU and kiln[gpu], or pick a CPU variant")


def served_interface(entry: Variant, providers: list[str] | None = None) -> Mapping[str, Any]:
    return entry.interface


def host_fit(name: str, entry: Variant, manifest: Manifest) -> HostFit:
    """Whether this host runs the variant on CUDA: onnxruntime-gpu with its CUDA provider, and a GPU."""
    needs = f"onnxruntime-gpu >= {MIN_ONNXRUNTIME_GPU} (CUDA provider), an NVIDIA GPU"
    try:
        import onnxruntime
    except ImportError:
        return HostFit(name, entry.target, needs, "onnxruntime not installed", False, "install kiln[gpu]")
    why = cuda_missing()
    has = f"onnxruntime {onnxruntime.__version__}, " + (f"{visible_gpus()} GPU(s)" if why is None else why)
    fix = "" if why is None else "install kiln[gpu] on a GPU host"
    return HostFit(name, entry.target, needs, has, why is None, fix)


def cuda_missing() -> str | None:
    """Why ONNX Runtime cannot run on CUDA here (no CUDA provider in this build, no driver, no GPU), or None."""
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        providers = ", ".join(p.removesuffix("ExecutionProvider") for p in onnxruntime.get_available_providers())
        return (f"this onnxruntime has no CUDA provider (it has {providers}: the onnxruntime package, not "
                "onnxruntime-gpu)")
    count = visible_gpus()
    if count is None:
        return "no NVIDIA driver is installed (libcuda.so.1 does not load)"
    if count == 0:
        return "no NVIDIA GPU is visible (check CUDA_VISIBLE_DEVICES)"
    return None


def visible_gpus() -> int | None:
    """How many GPUs the NVIDIA driver shows this process (CUDA_VISIBLE_DEVICES applied), or None without
    a driver. Asks the driver API itself: no torch, no CUDA toolkit."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value

