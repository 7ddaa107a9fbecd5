"""ONNX Runtime backend: run(input_ids, attention_mask, position_ids, cache) -> (logits, cache).

The names come from the manifest's interface, never from guesses. The KV cache holds numpy arrays,
2 per layer (key, value), in the interface's [batch, kv_heads, sequence, head_dim] layout, in one of
the two forms the interface's `kv_sharing` names:
- "none": past has exactly the slots used so far; the graph returns present = past + this step.
- "shared-buffer" (GroupQueryAttention graphs): each array is preallocated to the batch's capacity
  and bound as both past and present, so ONNX Runtime writes this step's keys and values into it
  in place and the cache is never copied.

An interface with `leading_kv_slot` (tensorrt variants) keeps one masked slot at the front of every
cache, so past is never 0 long: TensorRT profiles cannot take zero-length dimensions reliably. The
backend adds the slot (zeros, mask 0) itself; callers never see it. Running the tensorrt graph here
with the slot checks the exact form the engine is driven in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .errors import IncompatibleArtifact


def open_backend(folder: Path, entry: dict[str, Any], providers: list[str] | None = None,
                 threads: int | None = None, verified: bool = True) -> Any:
    """The backend a variant's manifest entry calls for: its TensorRT engine, or its ONNX graph."""
    if "engine" in entry:
        from .tensorrt_backend import TensorRTBackend

        return TensorRTBackend(folder, entry, verified)
    return OnnxRuntimeBackend(folder / entry["model"], entry["interface"], providers, threads)


def expand(names: list[dict[str, Any]], layers: int) -> list[str]:
    out = []
    for entry in names:
        if "{layer}" in entry["name"]:
            out.extend(entry["name"].format(layer=i) for i in range(layers))
        else:
            out.append(entry["name"])
    return out


def _kv_order(names: list[str]) -> list[str]:
    """Templates list all keys then all values; the cache is ordered key, value per layer."""
    keys = [n for n in names if n.endswith(".key")]
    values = [n for n in names if n.endswith(".value")]
    return [n for pair in zip(keys, values, strict=True) for n in pair]


class OnnxRuntimeBackend:
    def __init__(self, model_path: Path, interface: dict[str, Any], providers: list[str] | None = None,
                 threads: int | None = None) -> None:
        import onnxruntime as ort

        providers = providers or ["CPUExecutionProvider"]
        missing = [p for p in providers if p not in ort.get_available_providers()]
        if missing:
            raise IncompatibleArtifact(
                f"execution provider {missing[0]} is not available in this onnxruntime build; "
                f"available: {', '.join(ort.get_available_providers())}"
            )
        options = ort.SessionOptions()
        # Decoding is a chain of small dependent ops: all cores on each op, no inter-op pool.
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # warnings about pruned initializers are noise to a user
        self.session = ort.InferenceSession(str(model_path), options, providers=providers)
        layers = interface["layers"]
        self.past_names = _kv_order(expand(interface["inputs"][3:], layers))
        self.output_names = ["logits", *_kv_order(expand(interface["outputs"][1:], layers))]
        self.kv_heads, self.head_dim = interface["kv_heads"], interface["head_dim"]
        self.vocab_size = interface["vocab_size"]
        self.kv_dtype = np.dtype(interface["inputs"][3]["dtype"])
        self.shared = interface.get("kv_sharing", "none") == "shared-buffer"
        self.leading_slot = bool(interface.get("leading_kv_slot"))

    def new_cache(self, batch: int, capacity: int) -> list[np.ndarray]:
        """An empty cache for `batch` rows; a shared-buffer cache holds up to `capacity` slots."""
        length = capacity if self.shared else int(self.leading_slot)
        arrays = [np.zeros((batch, self.kv_heads, length, self.head_dim), self.kv_dtype) for _ in self.past_names]
        return _BoundCache(arrays) if self.shared else arrays

    def keep_rows(self, cache: list[np.ndarray], rows: list[int]) -> list[np.ndarray]:
        kept = [np.ascontiguousarray(layer[rows]) for layer in cache]
        return _BoundCache(kept) if self.shared else kept

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        if self.shared:
            return self._run_in_place(input_ids, attention_mask, position_ids, cache)
        if self.leading_slot:
            attention_mask = with_leading_slot(attention_mask)
        feed = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feed.update(zip(self.past_names, cache, strict=True))
        logits, *present = self.session.run(self.output_names, feed)
        return logits, present

    def _run_in_place(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                      cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        import onnxruntime as ort

        if attention_mask.shape[1] > cache[0].shape[2]:
            raise ValueError(f"{attention_mask.shape[1]} slots do not fit the KV buffers' {cache[0].shape[2]}")
        if not isinstance(cache, _BoundCache):  # arrays from elsewhere: bind them once, from now on
            cache = _BoundCache(cache)
        if cache.binding is None:  # once per cache: the buffers stay bound for every step
            cache.binding = self.session.io_binding()
            # ortvalue_from_numpy wraps the array's memory: the same bytes are past and present.
            cache.values = [ort.OrtValue.ortvalue_from_numpy(array) for array in cache]
            for past_name, value in zip(self.past_names, cache.values, strict=True):
                cache.binding.bind_ortvalue_input(past_name, value)
        if cache.seq != input_ids.shape[1]:
            # ONNX Runtime reuses the logits buffer it allocated for the last run, so rebind when its
            # shape changes (prefill -> decode with `logits: all`). Logits first: get_outputs()[0].
            cache.binding.clear_binding_outputs()
            cache.binding.bind_output("logits")
            for present_name, value in zip(self.output_names[1:], cache.values, strict=True):
                cache.binding.bind_ortvalue_output(present_name, value)
            cache.seq = input_ids.shape[1]
        for name, array in (("input_ids", input_ids), ("attention_mask", attention_mask),
                            ("position_ids", position_ids)):
            cache.binding.bind_cpu_input(name, np.ascontiguousarray(array, np.int64))
        self.session.run_with_iobinding(cache.binding)
        return cache.binding.get_outputs()[0].numpy().copy(), cache  # a copy: the next run writes the same buffer


def with_leading_slot(attention_mask: np.ndarray) -> np.ndarray:
    """The mask over [leading slot, cache..., new tokens]: the slot is always masked out."""
    return np.concatenate([np.zeros((len(attention_mask), 1), np.int64), attention_mask], axis=1)


class _BoundCache(list):
    """Shared KV buffers plus the IO binding that points ONNX Runtime at them, made on first use."""

    binding: Any = None
    values: list | None = None
    seq: int | None = None  # the sequence length the logits output is bound for
