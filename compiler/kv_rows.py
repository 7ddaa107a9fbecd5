"""The two small graphs that move KV-cache rows where the cache lives (a CUDA variant's GPU), so that rows
that join, leave or follow their beam parent never go through host memory. The runtime runs them with
the variant's providers (runtime/backends/onnxruntime_cuda.py); the runtime cannot build graphs itself
(it does not import onnx), so each CUDA variant ships them beside its model:

    kv_gather.onnx   out[r] = cache[rows[r], :, :keep], zeros after, `capacity` slots; rows[r] = -1: a
                     row of zeros                         (keep_rows: forks, drops, compaction, growth)
    kv_scatter.onnx  cache[rows[i], :, :count] = source[source_rows[i], :, :count], the rest of each
                     row as it was                        (write_rows: joins, beams taking a parent's row)

Each takes one KV tensor [batch, kv_heads, slots, head_dim] at a time, in the cache's dtype.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

GATHER_FILE = "kv_gather.onnx"
SCATTER_FILE = "kv_scatter.onnx"
OPSET = 18


def write_kv_row_graphs(folder: Path, dtype: str) -> list[str]:
    """Both graphs for caches of `dtype` ("float16", "bfloat16", "float32") into `folder`; their file names."""
    import onnx

    (folder / GATHER_FILE).write_bytes(_gather(dtype).SerializeToString())
    (folder / SCATTER_FILE).write_bytes(_scatter(dtype).SerializeToString())
    for name in (GATHER_FILE, SCATTER_FILE):
        onnx.checker.check_model(str(folder / name))
    return [GATHER_FILE, SCATTER_FILE]


def _element(dtype: str) -> int:
    """The ONNX element type of a cache dtype's name: numpy's, or bfloat16, which numpy lacks."""
    from onnx import TensorProto, helper

    return TensorProto.BFLOAT16 if dtype == "bfloat16" else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _cache(name: str, element: int, batch: str, slots: str):
    from onnx import helper

    return helper.make_tensor_value_info(name, element, [batch, "kv_heads", slots, "head_dim"])


def _gather(dtype: str):
    from onnx import TensorProto, helper

    element = _element(dtype)
    index = lambda name: helper.make_tensor_value_info(name, TensorProto.INT64, ["rows"])  # noqa: E731
    scalar = lambda name: helper.make_tensor_value_info(name, TensorProto.INT64, [1])  # noqa: E731
    constants = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
                 helper.make_tensor("two", TensorProto.INT64, [1], [2]),
                 helper.make_tensor("nothing", element, [], [0]),
                 helper.make_tensor("zeros6", TensorProto.INT64, [6], [0] * 6)]
    nodes = [
        helper.make_node("GreaterOrEqual", ["rows", "zero"], ["valid"]),
        helper.make_node("Max", ["rows", "zero"], ["taken"]),
        helper.make_node("Gather", ["cache", "taken"], ["gathered"], axis=0),
        helper.make_node("Unsqueeze", ["valid", "inner_axes"], ["valid4"]),
        helper.make_node("Where", ["valid4", "gathered", "nothing"], ["rows_kept"]),
        helper.make_node("Slice", ["rows_kept", "zero", "keep", "two"], ["slots_kept"]),
        helper.make_node("Shape", ["slots_kept"], ["kept_shape"], start=2, end=3),
        helper.make_node("Sub", ["capacity", "kept_shape"], ["room"]),
        helper.make_node("Concat", ["zeros6", "room", "zero"], ["pads"], axis=0),
    ]
    if element == TensorProto.BFLOAT16:  # CUDA's Pad takes no bf16: padded in fp32, which holds bf16 exactly
        nodes += [helper.make_node("Cast", ["slots_kept"], ["slots_wide"], to=TensorProto.FLOAT),
                  helper.make_node("Pad", ["slots_wide", "pads"], ["padded"]),
                  helper.make_node("Cast", ["padded"], ["out"], to=TensorProto.BFLOAT16)]
    else:
        nodes.append(helper.make_node("Pad", ["slots_kept", "pads"], ["out"]))
    constants.append(helper.make_tensor("inner_axes", TensorProto.INT64, [3], [1, 2, 3]))
    graph = helper.make_graph(nodes, "kv_gather", [_cache("cache", element, "batch", "slots"), index("rows"),
                                                   scalar("keep"), scalar("capacity")],
                              [_cache("out", element, "rows", "capacity")], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8,
                             producer_name="kiln")


def _scatter(dtype: str):
    from onnx import TensorProto, helper

    element = _element(dtype)
    index = lambda name: helper.make_tensor_value_info(name, TensorProto.INT64, ["rows"])  # noqa: E731
    constants = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
                 helper.make_tensor("two", TensorProto.INT64, [1], [2]),
                 helper.make_tensor("last", TensorProto.INT64, [1], [1]),
                 helper.make_tensor("end", TensorProto.INT64, [1], [2**62])]
    nodes = [
        helper.make_node("Gather", ["source", "source_rows"], ["sources"], axis=0),
        helper.make_node("Slice", ["sources", "zero", "count", "two"], ["head"]),
        helper.make_node("Gather", ["cache", "rows"], ["targets"], axis=0),
        helper.make_node("Slice", ["targets", "count", "end", "two"], ["tail"]),
        helper.make_node("Concat", ["head", "tail"], ["rows_new"], axis=2),
        helper.make_node("Unsqueeze", ["rows", "last"], ["indices"]),
        helper.make_node("ScatterND", ["cache", "indices", "rows_new"], ["out"]),
    ]
    graph = helper.make_graph(nodes, "kv_scatter", [_cache("cache", element, "batch", "slots"), index("rows"),
                                                    _cache("source", element, "sources", "source_slots"),
                                                    index("source_rows"),
                                                    helper.make_tensor_value_info("count", TensorProto.INT64, [1])],
                              [_cache("out", element, "batch", "slots")], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8,
                             producer_name="kiln")
