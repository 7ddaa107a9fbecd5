"""ONNX Runtime backend: run(input_ids, attention_mask, position_ids, past) -> (logits, present).

The names come from the manifest's interface, never from guesses. The KV cache is a list of numpy
arrays, 2 per layer (key, value), in the interface's [batch, kv_heads, sequence, head_dim] layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .errors import IncompatibleArtifact


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
        self.session = ort.InferenceSession(str(model_path), options, providers=providers)
        layers = interface["layers"]
        self.past_names = _kv_order(expand(interface["inputs"][3:], layers))
        self.output_names = ["logits", *_kv_order(expand(interface["outputs"][1:], layers))]
        self.kv_heads, self.head_dim = interface["kv_heads"], interface["head_dim"]
        self.vocab_size = interface["vocab_size"]

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32) for _ in self.past_names]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feed = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feed.update(zip(self.past_names, past, strict=True))
        logits, *present = self.session.run(self.output_names, feed)
        return logits, present
