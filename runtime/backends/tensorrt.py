"""TensorRT backend: run(input_ids, attention_mask, position_ids, cache) -> (logits, cache), with the KV
cache on the GPU between steps.

    manifest engine facts ─> check_host (TensorRT version, compute capability) ─> deserialize ─> context
    each step: pick_profile(shapes) ─> set shapes ─> past = cache buffers, present = spare buffers
               ─> execute_async_v3 ─> logits to host; swap the buffers

The engine's KV inputs carry one leading masked slot (compiler/tensorrt_build.py), so past is 1 at
prefill and a profile never needs a zero-length dimension. Each cache holds two buffers per KV
tensor sized for its capacity: the graph reads past from one and writes present (past + new) into
the other, and they swap, so no step allocates or copies the cache.

Device memory goes through Polygraphy's CUDA wrapper (ctypes over libcudart), never torch. Importing
this module needs neither TensorRT nor a GPU; constructing a backend without them fails with one line.

Not run on hardware by this project: no machine it runs on has TensorRT (see docs/gpu.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..artifact import version_tuple
from ..errors import IncompatibleArtifact, KilnError
from ..manifest import Interface, Manifest, Variant
from .base import ClosesOnExit, HostFit, Limits, expand, rows_of, with_leading_slot, write_right_aligned


class ShapeOutsideProfiles(KilnError):
    """A step's shapes fit none of the engine's optimization profiles."""


def open_variant(folder: Path, entry: Variant, providers: list[str] | None = None,
                 threads: int | None = None, verified: bool = True) -> TensorRTBackend:
    """A variant's TensorRT engine on this host's GPU (providers and threads are ONNX Runtime's: unused)."""
    return TensorRTBackend(folder, entry, verified)


def refusal(entry: Variant, providers: list[str] | None = None) -> str | None:
    """Nothing is refused before loading: the engine's host check needs TensorRT and the GPU (host_fit)."""
    return None


def served_interface(entry: Variant, providers: list[str] | None = None) -> Interface:
    return entry.interface


def host_fit(name: str, entry: Variant, manifest: Manifest) -> HostFit:
    """Whether this host runs the variant's engine: TensorRT's release and the GPU's compute capability."""
    engine = entry.engine
    needs = (f"TensorRT {engine['tensorrt_version']}{'+' if engine.get('version_compatible') else ''}, "
             f"compute capability {engine['compute_capability']}"
             + (" or newer (ampere_plus)" if engine.get("hardware_compatibility") == "ampere_plus" else ""))
    try:
        import tensorrt
    except ImportError:
        return HostFit(name, "tensorrt", needs, "TensorRT not installed", False, "install kiln[tensorrt]")
    try:
        gpu, capability = host_gpu()
        check_host(engine, tensorrt.__version__, capability, gpu)
    except (IncompatibleArtifact, ImportError) as exc:
        return HostFit(name, "tensorrt", needs, f"TensorRT {tensorrt.__version__}", False, str(exc))
    return HostFit(name, "tensorrt", needs, f"TensorRT {tensorrt.__version__}, {gpu} ({capability})", True)


# -- pure checks (tested on any machine) ----------------------------------------------------------

CROSS_MAJOR = {(8, 10), (10, 11)}  # (built with, runs on) for version-compatible engines


def check_host(engine: dict[str, Any], tensorrt_version: str, compute_capability: str, gpu: str = "") -> None:
    """Refuse an engine this host cannot run, naming the engine's value and the host's."""
    built, here = version_tuple(engine["tensorrt_version"]), version_tuple(tensorrt_version)
    if engine.get("version_compatible"):
        # Later releases of the same major run it, and across majors 8 -> 10 and 10 -> 11 (support matrix).
        if here < built or (here[0] != built[0] and (built[0], here[0]) not in CROSS_MAJOR):
            raise IncompatibleArtifact(
                f"engine built with TensorRT {engine['tensorrt_version']} (version-compatible: that release or a "
                f"later one it supports), this host has TensorRT {tensorrt_version}; rebuild it for this release")
    elif here != built:  # compared to the patch release; the build number may differ
        raise IncompatibleArtifact(
            f"engine built with TensorRT {engine['tensorrt_version']}, this host has TensorRT {tensorrt_version}; "
            "rebuild it here or build with engine.version_compatible: true")
    cc_built, cc_here = version_tuple(engine["compute_capability"]), version_tuple(compute_capability)
    level = engine.get("hardware_compatibility", "none")
    fits = cc_here >= (8, 0) if level == "ampere_plus" else cc_here == cc_built
    if not fits:
        wanted = "8.0 or newer (ampere_plus)" if level == "ampere_plus" else engine["compute_capability"]
        this_gpu = f"this GPU ({gpu})" if gpu else "this GPU"
        raise IncompatibleArtifact(
            f"engine built for compute capability {wanted} ({engine.get('gpu', '?')}), {this_gpu} is "
            f"{compute_capability}; rebuild it here or build with engine.hardware_compatibility: ampere_plus")


def pick_profile(profiles: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]]) -> int:
    """The first profile whose ranges hold every input shape; else one line naming what does not fit."""
    misses = []
    for index, profile in enumerate(profiles):
        miss = _first_miss(profile, shapes)
        if miss is None:
            return index
        misses.append(miss)
    raise ShapeOutsideProfiles("no engine profile takes this step: " + "; ".join(misses)
                               + " (rebuild with wider variants.profiles)")


def _first_miss(profile: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> str | None:
    for name, shape in shapes.items():
        low, _, high = profile["shapes"][name]
        for axis, (size, lo, hi) in enumerate(zip(shape, low, high, strict=True)):
            if not lo <= size <= hi:
                return f"{profile['name']}: {name} dim {axis} is {size}, allowed {lo}..{hi}"
    return None


# -- the backend (needs TensorRT, a GPU and Polygraphy) -------------------------------------------

def _import_tensorrt() -> tuple[Any, Any]:
    advice = "install kiln[tensorrt] on a host with an NVIDIA GPU, or run an onnxruntime variant"
    try:
        import tensorrt as trt
        from polygraphy import cuda

        _cudart()
    except ImportError as exc:
        raise IncompatibleArtifact(f"this variant is a TensorRT engine and this host cannot run it "
                                   f"({exc.name or exc} is not installed); {advice}") from None
    except Exception as exc:  # PyPI's placeholder wheels fail at import with their own errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise IncompatibleArtifact(f"this variant is a TensorRT engine and TensorRT does not load here ({first}); "
                                   f"{advice}") from None
    return trt, cuda


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        from cuda import cudart  # cuda-python before 12.6
    return cudart


def host_gpu() -> tuple[str, str]:
    """(GPU name, compute capability) of device 0 through cuda-python, without torch."""
    cudart = _cudart()
    error, props = cudart.cudaGetDeviceProperties(0)
    if error != cudart.cudaError_t.cudaSuccess:
        raise IncompatibleArtifact(f"no usable NVIDIA GPU on this host (cudaGetDeviceProperties: {error})")
    name = props.name.decode(errors="replace").rstrip("\0") if isinstance(props.name, bytes) else str(props.name)
    return name, f"{props.major}.{props.minor}"


class TensorRTBackend(ClosesOnExit):
    def __init__(self, folder: Path, entry: Variant, verified: bool) -> None:
        trt, cuda = _import_tensorrt()
        engine_facts = entry.engine
        gpu, capability = host_gpu()
        check_host(engine_facts, trt.__version__, capability, gpu)
        self.trt, self.cuda = trt, cuda
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        # Host code inside an engine (version-compatible engines ship a lean runtime) runs with this
        # process's rights: only for engines that need it, from an artifact whose hashes were checked.
        self.runtime.engine_host_code_allowed = bool(engine_facts.get("version_compatible")) and verified
        self.engine = self.runtime.deserialize_cuda_engine((folder / engine_facts["file"]).read_bytes())
        if self.engine is None and engine_facts.get("version_compatible") and not verified:
            raise IncompatibleArtifact(
                "a version-compatible engine runs its own host code, which is allowed only for a verified "
                "artifact; load it without --no-verify")
        if self.engine is None:
            raise IncompatibleArtifact(
                f"TensorRT {trt.__version__} could not deserialize {engine_facts['file']} (built with TensorRT "
                f"{engine_facts['tensorrt_version']} for compute capability {engine_facts['compute_capability']}; "
                f"this GPU is {capability})")
        self.context = self.engine.create_execution_context()
        self.stream = cuda.Stream()
        interface = entry.interface
        self.profiles = _read_json(folder / Path(engine_facts["file"]).parent / engine_facts["profiles_file"])
        if self.engine.num_optimization_profiles != len(self.profiles):
            raise IncompatibleArtifact(
                f"{engine_facts['file']} has {self.engine.num_optimization_profiles} optimization profiles, its "
                f"profiles file {len(self.profiles)}; the artifact is inconsistent, rebuild it")
        self.past_names = expand(interface.past, interface.layers)
        self.present_names = expand(interface.present, interface.layers)
        self.kv_heads, self.head_dim = interface.kv_heads, interface.head_dim
        self.vocab_size = interface.vocab_size
        self.kv_dtype = np.dtype(interface.kv_dtype)
        by_name = {p["name"]: p["shapes"] for p in self.profiles}
        # Profiles are prefill (past = the leading slot) or decode (one new token): no prompt in pieces.
        self.limits = Limits(max_batch_size=by_name["decode"]["input_ids"][2][0],
                             max_prompt=by_name["prefill"]["input_ids"][2][1],
                             max_context=by_name["decode"]["attention_mask"][2][1] - 1,  # less the leading slot
                             chunked_prefill="none")
        self.profile_index: int | None = None
        self.logits = cuda.DeviceArray(shape=(1,), dtype=device_dtype(np.float32))

    def new_cache(self, batch: int, capacity: int) -> _EngineCache:
        return _EngineCache.zeros(self.cuda, batch, len(self.past_names), self.kv_heads, capacity + 1,
                                  self.head_dim, self.kv_dtype, self.stream)

    def keep_rows(self, cache: _EngineCache, rows: list[int], front: int = 0,
                  capacity: int | None = None) -> _EngineCache:
        """The backend protocol's keep_rows (base.py), through the host: the engine calls it only when
        the batch needs more rows or columns, or drops free rows or padding."""
        kept = rows_of(self._download(cache), rows, 1, cache.length, front, None)
        target = _EngineCache.zeros(self.cuda, len(rows), len(self.past_names), self.kv_heads,
                                    (capacity or cache.capacity) + 1, self.head_dim, self.kv_dtype, self.stream)
        self._upload(kept, target)
        cache.free()
        return target

    def view_rows(self, cache: _EngineCache, first: int, count: int) -> None:
        """Never: a first prompt runs into a cache of its own, joined by write_rows (limits.rows_in_place)."""
        return None

    def slots_of(self, cache: Any, row: int, length: int, start: int, stop: int) -> list[np.ndarray]:
        raise NotImplementedError("the KV cache stays on the GPU (limits.host_slots is False: no prefix cache)")

    def cache_of(self, slots: list[list[np.ndarray]], capacity: int) -> Any:
        raise NotImplementedError("the KV cache stays on the GPU (limits.host_slots is False: no prefix cache)")

    def close(self) -> None:
        """The engine and its context go; caches free their own device buffers."""
        self.context = self.engine = None

    def write_rows(self, cache: _EngineCache, rows: list[int], source: _EngineCache,
                   source_rows: list[int]) -> _EngineCache:
        """The backend protocol's write_rows, through the host (a join: a few rows of a new prefill)."""
        arrays = self._download(cache)
        write_right_aligned(arrays, rows, cache.length, self._download(source), source_rows, source.length, 1)
        self._upload(arrays, cache)
        return cache

    def _download(self, cache: _EngineCache) -> list[np.ndarray]:
        """The cache's tensors on the host, [batch, kv_heads, slots, head_dim] each, the leading slot included."""
        shape = cache.shape(cache.slots)
        arrays = [buffer.view(shape=shape, dtype=device_dtype(self.kv_dtype)).copy_to(
            np.empty(shape, self.kv_dtype), self.stream) for buffer in cache.current]
        self.stream.synchronize()
        return arrays

    def _upload(self, arrays: list[np.ndarray], cache: _EngineCache) -> None:
        """copy_from fills the start of each buffer: the [batch, kv_heads, slots, head_dim] tensor."""
        for array, buffer in zip(arrays, cache.current, strict=True):
            buffer.copy_from(np.ascontiguousarray(array), self.stream)
        self.stream.synchronize()  # the host arrays may go once the copies are done
        cache.slots = arrays[0].shape[2]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: _EngineCache) -> tuple[np.ndarray, _EngineCache]:
        batch, seq = input_ids.shape
        mask = with_leading_slot(attention_mask)
        past = cache.slots
        if past + seq > cache.buffer_slots:
            raise ValueError(f"{past + seq} slots do not fit the KV buffers' {cache.buffer_slots}")
        shapes = {"input_ids": input_ids.shape, "attention_mask": mask.shape, "position_ids": position_ids.shape}
        shapes.update({name: cache.shape(past) for name in self.past_names})
        index = pick_profile(self.profiles, shapes)
        if index != self.profile_index:
            if not self.context.set_optimization_profile_async(index, self.stream.ptr):
                raise RuntimeError(f"TensorRT refused optimization profile {index}")
            self.profile_index = index
        inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}
        staged, hosts = [], []  # this step's small inputs on the device, and their host arrays until the sync
        try:
            for name, array in inputs.items():
                hosts.append(np.ascontiguousarray(array, np.int64))
                staged.append(self.cuda.DeviceArray(shape=array.shape, dtype=device_dtype(np.int64)))
                staged[-1].copy_from(hosts[-1], self.stream)
                self._bind_input(name, array.shape, staged[-1].ptr)
            for name, buffer in zip(self.past_names, cache.current, strict=True):
                self._bind_input(name, cache.shape(past), buffer.ptr)
            for name, buffer in zip(self.present_names, cache.spare, strict=True):
                self.context.set_tensor_address(name, buffer.ptr)
            logits_shape = tuple(self.context.get_tensor_shape("logits"))
            self.logits.resize(logits_shape)
            self.context.set_tensor_address("logits", self.logits.ptr)
            if not self.context.execute_async_v3(self.stream.ptr):
                raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")
            logits = self.logits.copy_to(np.empty(logits_shape, np.float32), self.stream)
            self.stream.synchronize()
        finally:
            for device in staged:
                device.free()
        cache.swap(past + seq)
        return logits, cache

    def _bind_input(self, name: str, shape: tuple[int, ...], pointer: int) -> None:
        if not self.context.set_input_shape(name, shape):
            raise RuntimeError(f"TensorRT refused shape {shape} for {name}")
        self.context.set_tensor_address(name, pointer)


class _EngineCache:
    """Per KV tensor two device buffers of [batch, kv_heads, buffer_slots, head_dim]: `current` holds the
    cache (as a [batch, kv_heads, slots, head_dim] tensor at its start), `spare` receives present.
    `length` and `capacity` are the backend protocol's: slots less the leading one."""

    def __init__(self, current: list, spare: list, batch: int, kv_heads: int, buffer_slots: int,
                 head_dim: int) -> None:
        self.current, self.spare = current, spare
        self.batch, self.kv_heads, self.buffer_slots, self.head_dim = batch, kv_heads, buffer_slots, head_dim
        self.slots = 1  # the leading masked slot

    @property
    def length(self) -> int:
        return self.slots - 1

    @property
    def capacity(self) -> int:
        return self.buffer_slots - 1

    @classmethod
    def zeros(cls, cuda: Any, batch: int, count: int, kv_heads: int, capacity: int, head_dim: int, dtype: Any,
              stream: Any) -> _EngineCache:
        full = (batch, kv_heads, capacity, head_dim)
        buffers = [[cuda.DeviceArray(shape=full, dtype=device_dtype(dtype)) for _ in range(count)] for _ in range(2)]
        slot = np.zeros((batch, kv_heads, 1, head_dim), dtype)
        for buffer in buffers[0]:  # copy_from fills the start of the buffer: the [b, h, 1, d] slot tensor
            buffer.copy_from(slot, stream)
        stream.synchronize()
        return cls(buffers[0], buffers[1], batch, kv_heads, capacity, head_dim)

    def shape(self, length: int) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, length, self.head_dim)

    def swap(self, slots: int) -> None:
        self.current, self.spare = self.spare, self.current
        self.slots = slots

    def free(self) -> None:
        """Once, from keep_rows or when the cache is dropped (a stream abandoned, an error mid-batch)."""
        for buffer in (*self.current, *self.spare):
            buffer.free()
        self.current, self.spare = [], []

    def __del__(self) -> None:
        self.free()


def device_dtype(dtype: Any) -> Any:
    """Polygraphy's own DataType where it has one (numpy dtypes are deprecated there since 0.50)."""
    try:
        from polygraphy.datatype import DataType
    except ImportError:
        return np.dtype(dtype)
    return DataType.from_dtype(np.dtype(dtype))


def _read_json(path: Path) -> Any:
    import json

    return json.loads(path.read_text())
