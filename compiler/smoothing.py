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
  - up_proj -> Mul -> down_proj (the Mul is linear in up_proj's output): into up_proj's columns;
  - v_proj -> GroupQueryAttention -> o_proj (attention is linear in the values): into v_proj's
    columns, one factor per channel of a kv head, shared by the query heads that read it.
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
    """Fold the smoothing into `proto`'s weights in place; what was smoothed, for the report. `proto` may be
    loaded without its weights: the ones smoothing changes are read from `source`'s folder and stored in
    it, the rest stay where they are."""
    from onnx import numpy_helper

    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    norms, mlps, attentions, readers = _sites(proto)
    if not norms and not mlps and not attentions:
        return {"alpha": alpha, "smoothed": 0}

    ranges = activation_ranges(source, calibration, work, {*norms, *mlps, *attentions})
    folder = str(Path(source.model_path).parent)  # where a graph loaded without its weights finds them
    weight = lambda node: numpy_helper.to_array(inits[node.input[1]], folder)  # noqa: E731

    def store(name: str, array: np.ndarray) -> None:
        inits[name].CopyFrom(numpy_helper.from_array(array.astype(np.float32), name))

    def factors(activation_range: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return (np.maximum(activation_range, 1e-5) ** alpha / np.maximum(rows, 1e-5) ** (1 - alpha)
                ).astype(np.float32)

    for activation, (norm, index, users) in norms.items():
        weights = [weight(u) for u in users]
        s = factors(ranges[activation], np.max([np.abs(w).max(1) for w in weights], 0))
        scale = numpy_helper.to_array(inits[norm.input[index]], folder)
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
        s = factors(ranges[activation], np.abs(down_weight).max(1))
        store(up.input[1], weight(up) / s[None, :])
        store(down.input[1], down_weight * s[:, None])
    for activation, (v_proj, o_proj, heads, kv_heads) in attentions.items():
        v_weight, o_weight = weight(v_proj).copy(), weight(o_proj)
        width = o_weight.shape[0] // heads
        first = v_weight.shape[1] - kv_heads * width  # v's first column (0 unless packed with q and k)
        channel = np.arange(o_weight.shape[0])  # o_proj's input channel -> the v channel it carries
        source_of = (channel // width) // (heads // kv_heads) * width + channel % width
        shared_range, shared_rows = np.zeros(kv_heads * width), np.zeros(kv_heads * width)
        np.maximum.at(shared_range, source_of, ranges[activation])
        np.maximum.at(shared_rows, source_of, np.abs(o_weight).max(1))
        s = factors(shared_range, shared_rows)
        v_weight[:, first:] /= s[None, :]
        store(v_proj.input[1], v_weight)
        store(o_proj.input[1], o_weight * s[source_of][:, None])
    return {"alpha": alpha, "smoothed": sum(len(u) for *_, u in norms.values()) + len(mlps) + len(attentions),
            "folded_into": {"norm scales": len(norms), "up_proj columns": len(mlps),
                            "v_proj columns": len(attentions)}}


def _sites(proto: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, list[Any]]]:
    """Where a division folds for free, each keyed by the activation it smooths: norms, MLPs and
    attentions as `smooth` reads them, and each tensor's readers. Reads names and attributes only: a
    graph loaded without its weights will do."""
    from .weights import lm_head, weight_matmuls

    graph = proto.graph
    matmuls = set(weight_matmuls(proto))
    head = lm_head(proto)
    inits = {i.name for i in graph.initializer}
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
    attentions = {}  # o_proj's input -> (v_proj, o_proj, query heads, kv heads)
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        packed = len(node.input) < 3 or not node.input[2]  # q/k/v from one MatMul, v its last columns
        v_proj = producer.get(node.input[0 if packed else 2])
        out = node.output[0]
        reshape = readers.get(out, [])
        if len(reshape) == 1 and reshape[0].op_type == "Reshape":  # a 2-D graph flattens the heads first
            out = reshape[0].output[0]
        o_projs = readers.get(out, [])
        if (v_proj is None or v_proj.name not in matmuls or len(readers[v_proj.output[0]]) != 1
                or len(o_projs) != 1 or o_projs[0].name not in matmuls or o_projs[0].input[0] != out):
            continue
        attrs = {a.name: a.i for a in node.attribute}
        attentions[out] = (v_proj, o_projs[0], attrs["num_heads"], attrs["kv_num_heads"])
    return norms, mlps, attentions, readers


def activation_ranges(source: Any, calibration: Sequence[list[int]], work: Path, names: set[str]
                      ) -> dict[str, np.ndarray]:
    """max |x_j| per channel of each named activation over the calibration prompts and their greedy
    continuations, read from the source graph's file with its weights where they lie (no copy of them
    in memory) and kept for the next call on the same file."""
    from .gptq import activations, calibration_sequences

    path = Path(source.model_path).resolve()
    key = (str(path), path.stat().st_mtime_ns, hash(tuple(map(tuple, calibration))))
    if key not in _RANGES or not names <= _RANGES[key].keys():
        sequences = calibration_sequences(source.model_path, source.interface, calibration, pad_id=0)
        found: dict[str, np.ndarray] = {}
        for values in activations(path, names, source.interface, sequences, work):
            for name, value in values.items():
                found[name] = np.maximum(found.get(name, 0), np.abs(value.reshape(-1, value.shape[-1])).max(0))
        shutil.rmtree(work, ignore_errors=True)  # as _gptq does: no empty work folder left in the variant's
        _RANGES[key] = {**_RANGES.get(key, {}), **found}
    return _RANGES[key]
