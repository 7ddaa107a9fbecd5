"""Fusion rule: weight MatMuls that read the same activation -> one MatMul over their weights side
by side, then one Split (q/k/v; gate/up).

Why: at batch 1 a projection costs a kernel call more than it costs its bytes. Measured here
(MatMulNBits, 8-bit, K = 576, one row): 18 us for q (N = 576) and 12 us each for k and v (N = 192),
13.7 us for the three packed (N = 960); onnxruntime-genai's builder writes its graphs packed.

    x ──MatMul(W_q)──> q         x ──MatMul([W_q | W_k | W_v])──Split[n_q, n_k, n_v]──> q, k, v
    x ──MatMul(W_k)──> k   ->
    x ──MatMul(W_v)──> v

It runs on the finished graph of a variant, after quantization, on an onnx ModelProto: plain MatMuls
pack with plain ones, MatMulNBits with MatMulNBits of the same bits, block size and accuracy level
(their codes, scales and zero points are laid out output feature by output feature, so packing is
concatenation), so `quantize.exclude` and each layer's own quantization are decided first. Each
output column is the same dot product as before: the graph computes the same numbers.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

NAME = "pack_matmuls"
NBITS_INPUTS = ("codes", "scales", "zero_points")


def apply(proto: Any) -> int:
    """Pack in place; returns the number of MatMuls removed."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    uses: dict[str, int] = defaultdict(int)
    for node in graph.node:
        for name in node.input:
            uses[name] += 1
    groups: dict[tuple, list[Any]] = defaultdict(list)
    for node in graph.node:
        key = _group_key(node, inits, uses)
        if key is not None:
            groups[key].append(node)
    removed = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        first = members[0]
        widths = [_width(node, inits) for node in members]
        packed = f"{first.name}_packed"
        names = []
        for slot, _ in enumerate(first.input[1:], start=1):
            arrays = [numpy_helper.to_array(inits[node.input[slot]]) for node in members]
            axis = 1 if first.op_type == "MatMul" else 0  # MatMul's weight is [K, N]; MatMulNBits' are N-major
            names.append(f"{packed}_{slot}")
            graph.initializer.append(numpy_helper.from_array(np.concatenate(arrays, axis=axis), names[-1]))
        wide = helper.make_node(first.op_type, [first.input[0], *names], [f"{packed}_out"], name=packed,
                                domain=first.domain)
        wide.attribute.extend(a for a in first.attribute if a.name != "N")
        if first.op_type == "MatMulNBits":
            wide.attribute.append(helper.make_attribute("N", sum(widths)))
        wide.metadata_props.extend(first.metadata_props)
        sizes = f"{packed}_sizes"
        graph.initializer.append(numpy_helper.from_array(np.array(widths, np.int64), sizes))
        split = helper.make_node("Split", [wide.output[0], sizes], [n.output[0] for n in members],
                                 name=f"{packed}_split", axis=-1)
        index = min(list(graph.node).index(n) for n in members)
        for node in members:
            graph.node.remove(node)
            for name in node.input[1:]:
                uses[name] -= 1
                if uses[name] == 0:
                    graph.initializer.remove(inits.pop(name))
        graph.node.insert(index, split)
        graph.node.insert(index, wide)
        removed += len(members) - 1
    return removed


def _group_key(node: Any, inits: dict[str, Any], uses: dict[str, int]) -> tuple | None:
    """What a MatMul must share with another to pack with it, or None when it cannot pack: its
    weights are not initializers, or are read elsewhere too (a tied weight stays where it is)."""
    if node.op_type not in ("MatMul", "MatMulNBits") or len(node.input) < 2:
        return None
    weights = list(node.input[1:])
    if not all(name in inits and uses[name] == 1 for name in weights):
        return None
    if node.op_type == "MatMul":
        return (node.input[0], "MatMul", tuple(inits[weights[0]].dims[:-1]))
    attributes = tuple(sorted((a.name, a.i) for a in node.attribute if a.name != "N"))
    return (node.input[0], "MatMulNBits", len(weights), attributes)


def _width(node: Any, inits: dict[str, Any]) -> int:
    if node.op_type == "MatMul":
        return int(inits[node.input[1]].dims[-1])
    return next(a.i for a in node.attribute if a.name == "N")
