"""Fusion rule: weight MatMuls that read the same activation -> one MatMul over their weights side
by side, then one Split (q/k/v; gate/up).

Why: at batch 1 a projection costs a kernel call more than it costs its bytes. Measured here
(MatMulNBits, 8-bit, K = 576, one row): 18 us for q (N = 576) and 12 us each for k and v (N = 192),
13.7 us for the three packed (N = 960); onnxruntime-genai's builder writes its graphs packed.

    x ──MatMul(W_q)──> q         x ──MatMul([W_q | W_k | W_v])──Split[n_q, n_k, n_v]──> q, k, v
    x ──MatMul(W_k)──> k   ->
    x ──MatMul(W_v)──> v

It runs on the finished graph of a variant, after quantization, on an onnx_ir model: plain MatMuls
pack with plain ones, MatMulNBits with MatMulNBits of the same bits, block size and accuracy level
(their codes, scales and zero points are laid out output feature by output feature, so packing is
concatenation), so `quantize.exclude` and each layer's own quantization are decided first. Each
output column is the same dot product as before: the graph computes the same numbers. The packed
weights are lazy: each is concatenated only when the graph is saved, one at a time, so packing a
graph whose weights are mapped from disk holds one packed weight in memory, not all of them.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import numpy as np

NAME = "pack_matmuls"


def apply(model: Any) -> int:
    """Pack in place; returns the number of MatMuls removed."""
    import onnx_ir as ir

    graph = model.graph
    groups: dict[tuple, list[Any]] = defaultdict(list)
    for node in graph:
        key = _group_key(node)
        if key is not None:
            groups[key].append(node)
    removed = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        first = members[0]
        widths = [_width(node) for node in members]
        packed = f"{first.name}_packed"
        axis = 1 if first.op_type == "MatMul" else 0  # MatMul's weight is [K, N]; MatMulNBits' are N-major
        weights = []
        for slot in range(1, len(first.inputs)):
            parts = [node.inputs[slot].const_value for node in members]
            shape = list(parts[0].shape)
            shape[axis] = sum(part.shape[axis] for part in parts)
            name = f"{packed}_{slot}"
            tensor = ir.LazyTensor(functools.partial(_concatenated, parts, axis, name), dtype=parts[0].dtype,
                                   shape=ir.Shape(shape), name=name)
            weights.append(ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype),
                                    const_value=tensor))
            graph.register_initializer(weights[-1])
        attributes = [a for a in first.attributes.values() if a.name != "N"]
        if first.op_type == "MatMulNBits":
            attributes.append(ir.AttrInt64("N", sum(widths)))
        wide = ir.Node(first.domain, first.op_type, [first.inputs[0], *weights], attributes, name=packed,
                       metadata_props=dict(first.metadata_props))
        wide.outputs[0].name = f"{packed}_out"
        sizes = ir.Value(name=f"{packed}_sizes", const_value=ir.tensor(np.array(widths, np.int64),
                                                                        name=f"{packed}_sizes"))
        graph.register_initializer(sizes)
        split = ir.Node("", "Split", [wide.outputs[0], sizes], [ir.AttrInt64("axis", -1)],
                        num_outputs=len(members), name=f"{packed}_split")
        graph.insert_before(first, [wide, split])
        for node, output in zip(members, split.outputs, strict=True):
            old = node.outputs[0]
            output.name, output.shape, output.type = old.name, old.shape, old.type
            old.name = f"{old.name}_unpacked"
            old.replace_all_uses_with(output, replace_graph_outputs=True)
        olds = [node.inputs[1:] for node in members]
        graph.remove(members, safe=True)
        for value in (v for inputs in olds for v in inputs):
            if not value.uses() and value.name in graph.initializers:
                del graph.initializers[value.name]
        removed += len(members) - 1
    return removed


def _concatenated(parts: list[Any], axis: int, name: str) -> Any:
    import onnx_ir as ir

    return ir.tensor(np.concatenate([part.numpy() for part in parts], axis=axis), name=name)


def _group_key(node: Any) -> tuple | None:
    """What a MatMul must share with another to pack with it, or None when it cannot pack: its
    weights are not initializers, or are read elsewhere too (a tied weight stays where it is)."""
    if node.op_type not in ("MatMul", "MatMulNBits") or len(node.inputs) < 2:
        return None
    weights = list(node.inputs[1:])
    if not all(v is not None and v.is_initializer() and v.const_value is not None and len(v.uses()) == 1
               and not v.is_graph_output() for v in weights):
        return None
    if node.op_type == "MatMul":
        return (id(node.inputs[0]), "MatMul", tuple(weights[0].const_value.shape[:-1]))
    attributes = tuple(sorted((a.name, a.value) for a in node.attributes.values() if a.name != "N"))
    return (id(node.inputs[0]), "MatMulNBits", len(weights), attributes)


def _width(node: Any) -> int:
    if node.op_type == "MatMul":
        return int(node.inputs[1].const_value.shape[-1])
    return node.attributes["N"].value
