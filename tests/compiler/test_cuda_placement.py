"""compiler/cuda_placement.py: the nodes a graph would leave on the CPU under ONNX Runtime's CUDA
provider, predicted from onnxruntime-gpu's own kernel registry, on graphs that must pass and must fail."""

from __future__ import annotations

import json

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from compiler.cuda_placement import ONNXRUNTIME_GPU, TABLE, predict

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def attention_graph(dtype=TensorProto.FLOAT16, mask_op="ReduceSum"):
    """A decode step's GroupQueryAttention with the mask arithmetic Kiln's export writes: the rows'
    lengths from the mask's values (compute), the total length from its shape (shape arithmetic)."""
    hidden, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    inputs = [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])]
    for name, width in (("query", hidden), ("key", kv), ("value", kv)):
        inputs.append(helper.make_tensor_value_info(name, dtype, ["batch", "seq", width]))
    for name in ("past_key", "past_value"):
        inputs.append(helper.make_tensor_value_info(name, dtype, ["batch", KV_HEADS, "capacity", HEAD_DIM]))
    nodes = [
        helper.make_node(mask_op, ["attention_mask", "axis"], ["lengths"], name="row_lengths", keepdims=0)
        if mask_op == "ReduceSum" else helper.make_node(mask_op, ["attention_mask"], ["lengths"], name="row_lengths",
                                                        axis=1, keepdims=0),
        helper.make_node("Sub", ["lengths", "one"], ["last"], name="last_position"),
        helper.make_node("Cast", ["last"], ["seqlens_k"], name="seqlens_k", to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"], name="mask_shape"),
        helper.make_node("Gather", ["mask_shape", "one"], ["total"], name="total_length", axis=0),
        helper.make_node("Cast", ["total"], ["total_sequence_length"], name="total_as_int32", to=TensorProto.INT32),
        helper.make_node("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value", "seqlens_k",
                                                 "total_sequence_length"], ["output", "present_key", "present_value"],
                         name="layers.0.attention", domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS),
    ]
    initializers = [numpy_helper.from_array(np.array([1], np.int64), "axis"),
                    numpy_helper.from_array(np.array(1, np.int64), "one")]
    outputs = [helper.make_tensor_value_info("output", dtype, ["batch", "seq", hidden])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def test_half_precision_attention_runs_on_cuda_and_shape_arithmetic_is_counted_apart():
    placement = predict(attention_graph(TensorProto.FLOAT16))
    assert placement.all_on_cuda, placement.on_cpu
    assert placement.shape_arithmetic == 3  # Shape, Gather of the total length, its Cast
    assert placement.compute_nodes == 4  # the row lengths, their Sub and Cast, the attention
    assert "every compute node of 4 has a CUDA kernel" in placement.summary()


def test_fp32_attention_is_named_with_the_types_cuda_takes():
    """The probe's finding on an H200: GroupQueryAttention in fp32 ran on the CPU."""
    placement = predict(attention_graph(TensorProto.FLOAT))
    assert [n["node"] for n in placement.on_cpu] == ["layers.0.attention"]
    why = placement.on_cpu[0]["why"]
    assert why.startswith("no CUDA kernel for com.microsoft::GroupQueryAttention over T=float (CUDA takes ")
    assert "float16" in why and "bfloat16" in why
    assert placement.on_cpu[0]["types"]["T"] == "float"
    summary = placement.summary()
    assert "\n" not in summary and summary.startswith("1 of 4 compute nodes have no CUDA kernel")


def test_an_op_cuda_has_no_kernel_for_at_all_is_named():
    # ReduceL1 over int64 values: the CPU has it, CUDA's ReduceL1 takes floating types only
    placement = predict(attention_graph(TensorProto.FLOAT16, mask_op="ReduceL1"))
    assert [n["node"] for n in placement.on_cpu] == ["row_lengths"]
    assert "ReduceL1 over T=int64" in placement.on_cpu[0]["why"]


def test_the_table_is_the_pinned_onnxruntime_gpu():
    table = json.loads(TABLE.read_text())
    assert table["onnxruntime_gpu"] == ONNXRUNTIME_GPU
    gqa = table["kernels"]["com.microsoft"]["GroupQueryAttention"]
    assert {row[2]["T"][0] for row in gqa} == {"float16", "bfloat16"}  # no fp32 attention on CUDA
    extra = (TABLE.parents[2] / "pyproject.toml").read_text()
    assert f"onnxruntime-gpu=={ONNXRUNTIME_GPU}" in extra
