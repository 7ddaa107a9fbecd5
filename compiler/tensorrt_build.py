"""The build stage for tensorrt variants: the checked standard-ONNX graph -> a serialized TensorRT engine
with a prefill and a decode optimization profile.

    graph (fp32 | fp16 with fp32 islands | Q/DQ int8) ─> OnnxParser ─> strongly typed network
        ─> builder config (opt level, workspace, hardware/version compatibility, timing cache)
        ─> + profile "prefill" + profile "decode" ─> engine.plan, profiles.json, build.log

Precision comes from the graph itself (a strongly typed network keeps every tensor's ONNX type), so
no FP16/INT8 builder flags and no calibrator: TensorRT 11 removes both, and the graph already holds
the fp32 islands and the Q/DQ scales the quantize stage chose and the accuracy gates checked.

Zero-length past: the engine's KV inputs always hold one leading masked slot (see runtime/backends/onnxruntime.py),
so past is 1 at prefill and never 0 in any profile; TensorRT's handling of 0-sized profile dimensions
is where builds and runs go wrong.

Nothing here imports TensorRT until an engine is built; without TensorRT or an NVIDIA GPU,
`build_engine` raises EngineUnavailable with the reason and the pipeline records the variant as skipped.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.backends.base import expand
from runtime.errors import KilnError
from runtime.manifest import Interface

from .recipe import EngineSpec, Profiles

ENGINE_FILE = "engine.plan"
PROFILES_FILE = "profiles.json"
LOG_FILE = "build.log"
HARDWARE_COMPATIBILITY = {"none": "NONE", "ampere_plus": "AMPERE_PLUS",
                          "same_compute_capability": "SAME_COMPUTE_CAPABILITY"}


class EngineUnavailable(KilnError):
    """This host cannot build TensorRT engines (no TensorRT, no NVIDIA GPU)."""


class EngineBuildError(KilnError):
    """TensorRT refused the graph or failed to build an engine."""


# -- profiles (pure: tested on any machine) -------------------------------------------------------

def engine_profiles(profiles: Profiles, interface: dict[str, Any]) -> list[dict[str, Any]]:
    """Two profiles as {"name", "shapes": {tensor: [min_shape, opt_shape, max_shape]}}.

    prefill: seq over the prompt range, past = the leading slot only (1).
    decode:  seq = 1, past = the slot + tokens already in the cache, over the context range.
    """
    batch = profiles.batch
    prompt = profiles.prompt
    cached = [max(profiles.context[0] - 1, 1), max(profiles.context[1] - 1, 1), profiles.context[2] - 1]
    past_decode = [1 + c for c in cached]
    return [
        {"name": "prefill", "shapes": _shapes(interface, batch, seq=prompt, past=[1, 1, 1])},
        {"name": "decode", "shapes": _shapes(interface, batch, seq=[1, 1, 1], past=past_decode)},
    ]


def _shapes(interface: dict[str, Any], batch: list[int], seq: list[int], past: list[int]) -> dict[str, list]:
    kv_heads, head_dim = interface["kv_heads"], interface["head_dim"]
    shapes = {
        "input_ids": [[b, s] for b, s in zip(batch, seq, strict=True)],
        "attention_mask": [[b, p + s] for b, p, s in zip(batch, past, seq, strict=True)],
        "position_ids": [[b, s] for b, s in zip(batch, seq, strict=True)],
    }
    typed = Interface.of(interface)
    for name in expand(typed.past, typed.layers):
        shapes[name] = [[b, kv_heads, p, head_dim] for b, p in zip(batch, past, strict=True)]
    return shapes


def engine_interface(interface: dict[str, Any]) -> dict[str, Any]:
    """The graph interface as the engine is driven: with the leading masked KV slot."""
    return {**interface, "leading_kv_slot": True}


# -- the build (needs TensorRT and a GPU) ---------------------------------------------------------

@dataclass(frozen=True)
class Host:
    tensorrt_version: str
    gpu: str
    compute_capability: str  # "8.6"


def build_host() -> Host:
    """This host's TensorRT and GPU, or EngineUnavailable saying which is missing."""
    try:
        import tensorrt as trt
    except ImportError:
        raise EngineUnavailable(
            "TensorRT is not installed on this host (pip install tensorrt on a machine with an NVIDIA GPU "
            "and NVIDIA's package index)") from None
    except Exception as exc:  # the PyPI placeholder wheels fail at import with their own messages
        raise EngineUnavailable(f"TensorRT does not load on this host: {exc}".splitlines()[0]) from None
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailable("no NVIDIA GPU is visible to this host (torch.cuda.is_available() is False)")
    major, minor = torch.cuda.get_device_capability(0)
    return Host(trt.__version__, torch.cuda.get_device_name(0), f"{major}.{minor}")


def default_timing_cache(host: Host) -> Path:
    sm = host.compute_capability.replace(".", "")
    return Path.home() / ".cache" / "kiln" / "tensorrt" / f"timing-{host.tensorrt_version}-sm{sm}.cache"


def build_engine(model_path: Path, profiles: list[dict[str, Any]], spec: EngineSpec,
                 timing_cache: Path | None, folder: Path) -> dict[str, Any]:
    """Write engine.plan and build.log into `folder` (the pipeline writes profiles.json beside them, built or
    not); return the manifest's engine facts."""
    host = build_host()
    import tensorrt as trt

    folder.mkdir(parents=True, exist_ok=True)
    logger = _collecting_logger(trt)
    logger.lines.clear()
    builder = trt.Builder(logger)
    # TensorRT 10: strong typing is opt-in; 11: always on (the flag is accepted and ignored).
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model_path)):  # reads external data beside the model file
        errors = [parser.get_error(i).desc() for i in range(parser.num_errors)]
        _write_log(folder, logger)
        raise EngineBuildError(f"TensorRT's ONNX parser refused the graph: {'; '.join(errors[:3])}")
    config = builder.create_builder_config()
    config.builder_optimization_level = spec.optimization_level
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_mib << 20)
    level = getattr(trt.HardwareCompatibilityLevel, HARDWARE_COMPATIBILITY[spec.hardware_compatibility], None)
    if level is None:
        raise EngineBuildError(f"engine.hardware_compatibility: {spec.hardware_compatibility} is not offered by "
                               f"TensorRT {trt.__version__}; use none or ampere_plus")
    config.hardware_compatibility_level = level
    if spec.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    for profile in profiles:
        config.add_optimization_profile(_trt_profile(builder, profile))
    cache_path = timing_cache or default_timing_cache(host)
    cache_bytes = cache_path.read_bytes() if cache_path.is_file() else b""
    config.set_timing_cache(config.create_timing_cache(cache_bytes), False)
    started = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - started
    _write_log(folder, logger)
    if serialized is None:
        raise EngineBuildError(f"TensorRT could not build the engine; see {folder / LOG_FILE}: "
                               f"{logger.last_error() or 'no error logged'}")
    (folder / ENGINE_FILE).write_bytes(bytes(serialized))
    _save_timing_cache(config, cache_path)
    return {
        "file": ENGINE_FILE, "profiles_file": PROFILES_FILE, "log": LOG_FILE,
        "tensorrt_version": host.tensorrt_version, "gpu": host.gpu, "compute_capability": host.compute_capability,
        "hardware_compatibility": spec.hardware_compatibility, "version_compatible": spec.version_compatible,
        "optimization_level": spec.optimization_level, "workspace_mib": spec.workspace_mib,
        "profiles": [p["name"] for p in profiles], "timing_cache": str(cache_path),
        "timing_cache_reused": bool(cache_bytes), "build_seconds": round(seconds, 1),
    }


def _trt_profile(builder: Any, profile: dict[str, Any]) -> Any:
    trt_profile = builder.create_optimization_profile()
    for name, (low, opt, high) in profile["shapes"].items():
        trt_profile.set_shape(name, low, opt, high)
    return trt_profile


def _save_timing_cache(config: Any, path: Path) -> None:
    """Atomically: two builds at once must not leave a torn cache for the third."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(bytes(config.get_timing_cache().serialize()))
    os.replace(partial, path)


def _write_log(folder: Path, logger: Any) -> None:
    (folder / LOG_FILE).write_text("\n".join(logger.lines) + "\n")


_LOGGER: Any = None


def _collecting_logger(trt: Any) -> Any:
    """One trt.ILogger per process that keeps INFO and worse for build.log: TensorRT uses the first
    logger it is given until every builder and runtime is gone, and a Python logger also receives
    VERBOSE (tactic by tactic) unless it filters."""
    global _LOGGER
    if _LOGGER is not None:
        return _LOGGER

    class Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.lines: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity > trt.ILogger.Severity.INFO:  # VERBOSE sorts after INFO
                return
            self.lines.append(f"[{getattr(severity, 'name', severity)}] {msg}")

        def last_error(self) -> str | None:
            errors = [line for line in self.lines if "ERROR" in line.split("]")[0]]
            return errors[-1] if errors else None

    _LOGGER = Logger()
    return _LOGGER
