"""ONNX Runtime's CUDA provider: the backend of `target: onnxruntime-cuda` variants, whose graphs are
half precision end to end and predicted at compile time to run every compute node on CUDA
(compiler/cuda_placement.py). Their manifest entry names the providers it is built for.

On CUDA, the KV cache stays on the GPU (OnnxRuntimeCudaBackend): each tensor is an OrtValue in the
GPU's memory, bound once as past and present and updated in place by GroupQueryAttention. A step
sends up only the token ids, positions and mask, and brings back only the logits. Rows that join,
leave or follow their beam parent move on the device too, through the two small graphs each CUDA
variant ships (kv_gather.onnx, kv_scatter.onnx: compiler/kv_rows.py), run on the same provider.

Asked for the CPU provider alone, the same graph runs on the CPU with Kiln's ONNX Runtime backend
(backends/onnxruntime.py), as compile-model validated it against eager: for checks and A/B on a
machine without a GPU, not for speed.

Not run on a GPU by this project yet (docs/gpu.md); the device-resident backend is tested with its
OrtValues in host memory (device "cpu"), against the CPU backend.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact import version_tuple
from ..errors import IncompatibleArtifact
from ..manifest import Interface, Manifest, Variant
from .base import STORED_AS, ClosesOnExit, HostFit, Limits, expand, host_dtype, ortvalue, provider_names
from .onnxruntime import front_mask, require_providers, row_lengths, run_in_place

CUDA_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")  # the CPU's: shape arithmetic
MIN_ONNXRUNTIME_GPU = "1.31.1"  # the release whose CUDA kernels the compile checked the graph against


def open_variant(folder: Path, entry: Variant, providers: list[Any] | None = None, threads: int | None = None,
                 verified: bool = True) -> Any:
    """The variant's graph with its KV cache on the GPU where `providers` (default: CUDA, then the CPU for
    shape arithmetic) ask for CUDA; on the CPU's backend where they do not."""
    from .onnxruntime import OnnxRuntimeBackend

    refused = refusal(entry, providers)
    if refused:
        raise IncompatibleArtifact(refused)
    providers = list(providers or CUDA_PROVIDERS)
    if "CUDAExecutionProvider" not in provider_names(providers):
        return OnnxRuntimeBackend(folder / entry.model, entry.interface, providers, threads)
    if len(entry.kv_row_graphs) != 2:
        raise IncompatibleArtifact(f"variant {entry.name!r} has no graphs to move its cache's rows on the GPU "
                                   "(kv_row_graphs); recompile it")
    gather, scatter = (folder / path for path in entry.kv_row_graphs)
    return OnnxRuntimeCudaBackend(folder / entry.model, entry.interface, gather, scatter, providers, "cuda",
                                  _device_id(providers))


def _device_id(providers: list[Any]) -> int:
    """The GPU the providers ask ONNX Runtime's CUDA provider for (device_id in its options; else 0)."""
    cuda = next((p for p in providers if provider_names([p]) == ["CUDAExecutionProvider"]), "CUDAExecutionProvider")
    return int(cuda[1].get("device_id", 0)) if not isinstance(cuda, str) else 0


def refusal(entry: Variant, providers: list[str] | None = None) -> str | None:
    """Why this host may not run the variant with `providers`, before anything loads: CUDA asked for (or
    left to the default) where this onnxruntime has no CUDA provider or no GPU is visible."""
    if providers is not None and "CUDAExecutionProvider" not in provider_names(providers):
        if entry.interface.kv_dtype == "bfloat16":
            return (f"variant {entry.name!r} is bfloat16, which ONNX Runtime's CPU provider has no kernels for (its "
                    "attention, MatMuls, Where); run it with --device cuda, or an fp16 variant with --device cpu")
        return None  # the CPU provider alone: the graph as compile-model validated it
    why = cuda_missing()
    asked = _device_id(providers or CUDA_PROVIDERS)
    shown = visible_gpus() if why is None else None
    if why is None and asked >= (shown or 0):
        why = f"GPU {asked} was asked for and this host shows {shown} (cuda:0 is the first)"
    if why is None:
        return None
    return (f"variant {entry.name!r} is built for ONNX Runtime's CUDA provider, and {why}; run it on a host with "
            "an NVIDIA GPU and kiln[gpu], or pick a CPU variant")


def served_interface(entry: Variant, providers: list[str] | None = None) -> Interface:
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
    if version_tuple(onnxruntime.__version__) < version_tuple(MIN_ONNXRUNTIME_GPU):
        return (f"this onnxruntime-gpu, {onnxruntime.__version__}, is older than the {MIN_ONNXRUNTIME_GPU} whose "
                "kernels the graph was checked against")
    try:
        count = visible_gpus()
    except IncompatibleArtifact as exc:
        return str(exc)
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
    status = driver.cuInit(0)
    if status not in (0, 100):  # 100: CUDA_ERROR_NO_DEVICE
        raise IncompatibleArtifact(f"the NVIDIA driver does not start (cuInit error {status}: a driver and "
                                   "CUDA version mismatch, or a GPU in a bad state; nvidia-smi shows which)")
    if status != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value



class DeviceKvCache(list):
    """A batch's KV cache where the session runs: an OrtValue per KV tensor, [rows, kv_heads, capacity,
    head_dim], each row stored from slot 0, the first `length` slots in use (the mask's width)."""

    def __init__(self, values: list[Any], length: int, batch: int) -> None:
        super().__init__(values)
        self.length, self.batch = length, batch
        self.binding: Any = None  # bound once: the same buffers are past and present at every step
        self.seq: int | None = None  # the sequence length the logits output is bound for
        self.logits: np.ndarray | None = None
        self.host: list[np.ndarray] | None = None

    @property
    def capacity(self) -> int:
        return self[0].shape()[2]


class OnnxRuntimeCudaBackend(ClosesOnExit):
    """A CUDA variant's graph with its KV cache kept on `device` (module doc). The graph's interface is
    the fused one: shared buffers, each row's length read from its mask (row_lengths: mask)."""

    def __init__(self, model_path: Path, interface: Interface | Mapping[str, Any], gather: Path, scatter: Path,
                 providers: list[Any], device: str = "cuda", device_id: int = 0) -> None:
        import onnxruntime as ort

        interface = Interface.of(interface)
        if not interface.shared_buffers or interface.row_lengths != "mask":
            raise IncompatibleArtifact("the variant's graph does not update a shared KV buffer in place; recompile it")
        require_providers(providers)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(model_path), options, providers=providers)
        self.gather = ort.InferenceSession(str(gather), options, providers=providers)
        self.scatter = ort.InferenceSession(str(scatter), options, providers=providers)
        self.device, self.device_id = device, device_id
        self.past_names = expand(interface.past, interface.layers)
        self.present_names = expand(interface.present, interface.layers)
        self.kv_heads, self.head_dim = interface.kv_heads, interface.head_dim
        self.vocab_size = interface.vocab_size
        self.kv_type = interface.kv_dtype
        self.kv_dtype = host_dtype(interface.kv_dtype)
        self.logits_dtype = np.dtype(interface.logits_dtype)
        self.logits_last = interface.logits == "last"
        # GroupQueryAttention takes a prompt in pieces for one row at a time; a first prompt cannot run into
        # rows of a running batch (no views of device memory): it runs in a cache of its own and joins.
        self.limits = Limits(chunked_prefill="one-row", rows_in_place=False)

    def new_cache(self, batch: int, capacity: int) -> DeviceKvCache:
        import onnxruntime as ort

        if self.kv_type in STORED_AS:  # no numpy type to copy up: a one-slot host seed, gathered into empty rows
            seed = ortvalue(np.zeros((1, self.kv_heads, 1, self.head_dim), self.kv_dtype), self.kv_type)
            return DeviceKvCache([self._gather(seed, [-1] * batch, 0, capacity) for _ in self.past_names], 0, batch)
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        zeros = [np.zeros(shape, self.kv_dtype) for _ in self.past_names]  # copied to a GPU; wrapped in host memory
        cache = DeviceKvCache([ort.OrtValue.ortvalue_from_numpy(z, self.device, self.device_id) for z in zeros], 0,
                              batch)
        cache.host = zeros if self.device == "cpu" else None  # what a host OrtValue's memory is: kept alive
        return cache

    def keep_rows(self, cache: DeviceKvCache, rows: Sequence[int], front: int = 0,
                  capacity: int | None = None) -> DeviceKvCache:
        """The base protocol's keep_rows, on the device (kv_gather). Rows start at slot 0, so slots added or
        dropped in front change only the length callers see."""
        capacity = capacity or cache.capacity
        length = cache.length + front
        if capacity == cache.capacity and list(rows) == list(range(cache.batch)):
            cache.length = length
            return cache
        keep = min(length, cache.length)
        return DeviceKvCache([self._gather(value, rows, keep, capacity) for value in cache], length, len(rows))

    def write_rows(self, cache: DeviceKvCache, rows: Sequence[int], source: DeviceKvCache,
                   source_rows: Sequence[int]) -> DeviceKvCache:
        """Rows of `source` into `rows` of `cache`, on the device (kv_scatter): new buffers, the old let go."""
        if source.length > cache.capacity:
            raise ValueError(f"rows of {source.length} slots do not fit buffers of {cache.capacity}")
        values = [self._scatter(value, rows, copied, source_rows, source.length)
                  for value, copied in zip(cache, source, strict=True)]
        return DeviceKvCache(values, cache.length, cache.batch)

    def view_rows(self, cache: DeviceKvCache, first: int, count: int) -> None:
        return None  # limits.rows_in_place is False

    def slots_of(self, cache: Any, row: int, length: int, start: int, stop: int) -> list[np.ndarray]:
        raise NotImplementedError("the KV cache stays on the GPU (limits.host_slots is False: no prefix cache)")

    def cache_of(self, slots: list[list[np.ndarray]], capacity: int) -> Any:
        raise NotImplementedError("the KV cache stays on the GPU (limits.host_slots is False: no prefix cache)")

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: DeviceKvCache) -> tuple[np.ndarray, DeviceKvCache]:
        """A step on rows stored from slot 0: the callers' right-aligned mask becomes each row's length. Rows
        whose new tokens differ in number (prompts of different lengths, a chunk) run one at a time."""
        seq = input_ids.shape[1]
        lengths, new = row_lengths(attention_mask, seq, cache.capacity)
        if seq == 1 or (np.all(new == seq) and np.all(lengths == seq)):
            logits = self._run_in_place(input_ids, front_mask(lengths), position_ids, cache)
        else:
            logits = np.zeros((len(input_ids), 1 if self.logits_last else seq, self.vocab_size), np.float32)
            for row in np.flatnonzero(new):
                count, length = int(new[row]), int(lengths[row])
                alone = DeviceKvCache([self._gather(value, [row], length - count, cache.capacity) for value in cache],
                                      length - count, 1)
                out = self._run_in_place(input_ids[row:row + 1, seq - count:], np.ones((1, length), np.int64),
                                         position_ids[row:row + 1, seq - count:], alone)
                cache = self.write_rows(cache, [row], alone, [0])
                logits[row, logits.shape[1] - out.shape[1]:] = out[0]
        cache.length = attention_mask.shape[1]
        return logits, cache

    def close(self) -> None:
        self.session = self.gather = self.scatter = None

    def _run_in_place(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                      cache: DeviceKvCache) -> np.ndarray:
        return run_in_place(self.session, cache, cache, self.past_names, self.present_names,
                            (input_ids, attention_mask, position_ids), self.logits_last, self.vocab_size,
                            self.logits_dtype)

    def _gather(self, value: Any, rows: Sequence[int], keep: int, capacity: int) -> Any:
        return self._moved(self.gather, {"cache": value}, {"rows": rows, "keep": [keep], "capacity": [capacity]})

    def _scatter(self, value: Any, rows: Sequence[int], source: Any, source_rows: Sequence[int], count: int) -> Any:
        return self._moved(self.scatter, {"cache": value, "source": source},
                           {"rows": rows, "source_rows": source_rows, "count": [count]})

    def _moved(self, session: Any, tensors: dict[str, Any], indices: dict[str, Sequence[int]]) -> Any:
        """One run of a row-move graph: KV tensors bound where they are, indices from the host, the output
        left on the device."""
        binding = session.io_binding()
        for name, value in tensors.items():
            binding.bind_ortvalue_input(name, value)
        for name, values in indices.items():
            binding.bind_cpu_input(name, np.asarray(list(values), np.int64))
        binding.bind_output("out", self.device, self.device_id)
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0]
