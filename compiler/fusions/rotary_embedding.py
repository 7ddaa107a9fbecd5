"""Fusion rule: rotate-half rotary embedding -> com.microsoft RotaryEmbedding with cos/sin caches.

Why not onnxscript's rules: its rotary rule matches, but its cos_sin_cache rule does not match the
cos/sin computation transformers 5 exports, and without it the intermediate function is inlined
back. Here the cos/sin caches are computed by running the graph's own cos/sin subgraph for every
position (so rope scaling, whatever its kind, is whatever the export computed), then each
application is replaced:

    position_ids ─...─> cos, sin [b, s, d] ─Unsqueeze─┐                        (computed once)
    x [b, n, s, d] ─────────────────────────────────Mul(cos)──────────────┐
    x ─Slice d/2:─Neg─┐                                                   Add ─> rotated
    x ─Slice :d/2─────Concat (rotate_half)──────────Mul(sin)──────────────┘
becomes
    x, position_ids, cos_cache [positions, d/2], sin_cache ─RotaryEmbedding─> rotated

7 nodes per application, two applications (query, key) per layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NAME = "rotary_embedding"


def apply(model: Any, shapes: Any) -> int:
    import onnx_ir as ir

    graph = model.graph
    cos_nodes = [n for n in graph if n.op_type == "Cos"]
    sin_nodes = [n for n in graph if n.op_type == "Sin"]
    if len(cos_nodes) != 1 or len(sin_nodes) != 1:
        return 0
    cos_u, sin_u = (_only_unsqueeze(n.outputs[0]) for n in (cos_nodes[0], sin_nodes[0]))
    if cos_u is None or sin_u is None:
        return 0
    sites = [s for s in (_site(mul, cos_u, sin_u) for mul in list(cos_u.consumers())) if s is not None]
    if not sites:
        return 0
    caches = _caches(model, cos_nodes[0].outputs[0], sin_nodes[0].outputs[0], shapes.max_positions)
    if caches is None:
        return 0
    positions = next(v for v in graph.inputs if v.name == "position_ids")
    cos_cache = _initializer(graph, "rotary.cos_cache", caches[0])
    sin_cache = _initializer(graph, "rotary.sin_cache", caches[1])
    for x, add in sites:
        tape = ir.tape.Tape()
        rotated = tape.op("RotaryEmbedding", [x, positions, cos_cache, sin_cache], {"interleaved": 0},
                          domain="com.microsoft")
        rotated.dtype, rotated.shape = add.outputs[0].dtype, add.outputs[0].shape
        graph.insert_after(add, tape.nodes)
        ir.convenience.replace_all_uses_with(add.outputs[0], rotated)
    model.opset_imports.setdefault("com.microsoft", 1)
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    return len(sites)


def _only_unsqueeze(value: Any) -> Any:
    consumers = list(value.consumers())
    if len(consumers) == 1 and consumers[0].op_type == "Unsqueeze":
        return consumers[0].outputs[0]
    return None


def _site(mul: Any, cos_u: Any, sin_u: Any) -> tuple[Any, Any] | None:
    """(x, the Add that ends x's rotation) if `mul` is x * cos in the pattern above."""
    if mul.op_type != "Mul":
        return None
    x = mul.inputs[0] if mul.inputs[1] is cos_u else mul.inputs[1]
    adds = list(mul.outputs[0].consumers())
    if len(adds) != 1 or adds[0].op_type != "Add":
        return None
    add = adds[0]
    other = add.inputs[1] if add.inputs[0] is mul.outputs[0] else add.inputs[0]
    sin_mul = other.producer()
    if sin_mul is None or sin_mul.op_type != "Mul" or sin_u not in sin_mul.inputs:
        return None
    half = sin_mul.inputs[0] if sin_mul.inputs[1] is sin_u else sin_mul.inputs[1]
    return (x, add) if _is_rotate_half(half, x) else None


def _is_rotate_half(value: Any, x: Any) -> bool:
    concat = value.producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2:
        return False
    negated, first = concat.inputs
    neg = negated.producer()
    if neg is None or neg.op_type != "Neg":
        return False
    slices = [neg.inputs[0].producer(), first.producer()]
    return all(s is not None and s.op_type == "Slice" and s.inputs[0] is x for s in slices)


def _caches(model: Any, cos: Any, sin: Any, positions: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Run the graph's own position_ids -> cos, sin subgraph for positions 0..positions-1."""
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    proto = ir.to_proto(model)
    sub = onnx.utils.Extractor(proto).extract_model(["position_ids"], [cos.name, sin.name])
    session = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    cos_all, sin_all = session.run(None, {"position_ids": np.arange(positions, dtype=np.int64)[None]})
    half = cos_all.shape[-1] // 2
    # RotaryEmbedding's caches hold one half: transformers' rotate-half layout repeats it.
    if not (np.array_equal(cos_all[..., :half], cos_all[..., half:]) and
            np.array_equal(sin_all[..., :half], sin_all[..., half:])):
        return None
    return (np.ascontiguousarray(cos_all[0, :, :half], np.float32),
            np.ascontiguousarray(sin_all[0, :, :half], np.float32))


def _initializer(graph: Any, name: str, array: np.ndarray) -> Any:
    import onnx_ir as ir

    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.FLOAT),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value
