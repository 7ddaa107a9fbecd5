"""SmoothQuant folded into the graph before int8 weight blocks (`quantize: {smoothing: ALPHA}`).

MatMulNBits at accuracy level 4 rounds each block of an activation row to int8 as it runs, and a
few channels of a Llama's norm outputs are tens of times larger than the rest: their block's step
is coarse for every other value in it. SmoothQuant (Xiao et al., 2023, "SmoothQuant: Accurate and
Efficient Post-Training Quantization for Large Language Models") divides activation channel j by

    s_j = max|x_j| ** alpha / max|w_j| ** (1 - alpha)

and multiplies weight row j by s_j: the same product in exact arithmetic, with part of the
activations' range moved into the weights, which 8-bit blocks hold with room to spare. The division
is folded where it costs nothing a step:
  - RMSNorm -> weight MatMuls (q/k/v, gate/up): into the norm's scale;
  - up_proj -> Mul -> down_proj (the Mul is linear in up_proj's output): into up_proj's columns.
The LM head is left alone: its weight is the tied embedding, kept exactly on its GGUF grid.
max|x_j| comes from the calibration prompts and their fp32 greedy continuations, read once per
graph and calibration set (the sensitivity search quantizes the same graph dozens of times).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

NORM_SCALE_INPUT = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2,
                    "RMSNormalization": 1}
_RANGES: dict[tuple[str, int, int], dict[str, np.ndarray]] = {}  # (graph file, its mtime, calibration)


def smooth(proto: Any, source: Any, calibration: Sequence[list[int]], alpha: float, work: Path) -> dict[str, Any]:
    """Fold the smoothing into `proto`'s weights in place; what was smoothed, for the report."""
    from onnx import numpy_helper

    from .quantize import lm_head, weight_matmuls

    graph = proto.graph
    matmuls = set(weight_matmuls(proto))
    head = lm_head(proto)
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    producer = {out: node for node in graph.node for out in node.output}

    norms = {}  # norm output -> (the norm, its scale's input index, the MatMuls reading it)
    for node in graph.node:
        index = NORM_SCALE_INPUT.get(node.op_type)
        users = readers.get(node.output[0], []) if index is not None else []
        if (users and all(u.name in matmuls and u.name != head and u.input[0] == node.output[0] for u in users)
                and node.input[index] in inits):
            norms[node.output[0]] = (node, index, users)
    mlps = {}  # down_proj's input -> (up_proj, down_proj)
    for node in graph.node:
        mul = producer.get(node.input[0]) if node.name in matmuls and node.name != head else None
        if mul is None or mul.op_type != "Mul" or len(readers[mul.output[0]]) != 1:
            continue
        up = next((p for p in map(producer.get, mul.input) if p is not None and p.name in matmuls
                   and len(readers[p.output[0]]) == 1), None)
        if up is not None:
            mlps[node.input[0]] = (up, node)
    if not norms and not mlps:
        return {"alpha": alpha, "smoothed": 0}

    ranges = _ranges(proto, source, calibration, {*norms, *mlps}, work)
    weight = lambda node: numpy_helper.to_array(inits[node.input[1]])  # noqa: E731

    def store(name: str, array: np.ndarray) -> None:
        inits[name].CopyFrom(numpy_helper.from_array(array.astype(np.float32), name))

    def factors(activation: str, rows: np.ndarray) -> np.ndarray:
        return (np.maximum(ranges[activation], 1e-5) ** alpha / np.maximum(rows, 1e-5) ** (1 - alpha)
                ).astype(np.float32)

    for activation, (norm, index, users) in norms.items():
        weights = [weight(u) for u in users]
        s = factors(activation, np.max([np.abs(w).max(1) for w in weights], 0))
        scale = numpy_helper.to_array(inits[norm.input[index]])
        shared = norm.input[index]
        if len(readers[shared]) > 1:  # equal scales stored once (all ones, say): this norm gets its own
            norm.input[index] = f"{shared}_smoothed_{len(inits)}"
            inits[norm.input[index]] = graph.initializer.add()
            readers[shared].remove(norm)
            if not readers[shared]:
                graph.initializer.remove(inits.pop(shared))
        store(norm.input[index], scale / s)
        for user, w in zip(users, weights, strict=True):
            store(user.input[1], w * s[:, None])
    for activation, (up, down) in mlps.items():
        down_weight = weight(down)
        s = factors(activation, np.abs(down_weight).max(1))
        store(up.input[1], weight(up) / s[None, :])
        store(down.input[1], down_weight * s[:, None])
    return {"alpha": alpha, "smoothed": sum(len(u) for *_, u in norms.values()) + len(mlps),
            "folded_into": {"norm scales": len(norms), "up_proj columns": len(mlps)}}


def _ranges(proto: Any, source: Any, calibration: Sequence[list[int]], names: set[str], work: Path
            ) -> dict[str, np.ndarray]:
    """max |x_j| per channel of each named activation over the calibration sequences."""
    from .gptq import activations, calibration_sequences

    path = Path(source.model_path).resolve()
    key = (str(path), path.stat().st_mtime_ns, hash(tuple(map(tuple, calibration))))
    if key not in _RANGES or not names <= _RANGES[key].keys():
        sequences = calibration_sequences(source.model_path, source.interface, calibration, pad_id=0)
        found: dict[str, np.ndarray] = {}
        for values in activations(proto, names, source.interface, sequences, work):
            for name, value in values.items():
                found[name] = np.maximum(found.get(name, 0), np.abs(value.reshape(-1, value.shape[-1])).max(0))
        shutil.rmtree(work, ignore_errors=True)  # as _gptq does: no empty work folder left in the variant's
        _RANGES[key] = found
    return _RANGES[key]
