"""The rotary rule on small graphs: rotate-half rotation by the graph's own cos/sin of position_ids
fuses into RotaryEmbedding (and computes the same under ONNX Runtime, left-padded positions
included); a rotation the op cannot express does not."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.fusions import rotary_embedding

HEADS, HEAD_DIM, POSITIONS = 2, 8, 16


def _rotary(second_half: float = 1.0, negated_first: bool = True, slices_of: str = "x") -> onnx.ModelProto:
    """y = x * cos + rotate_half(x) * sin, cos/sin of position_ids as transformers computes them.
    `second_half` scales the second half of the frequencies (1: rotate-half's repeated halves);
    `negated_first` False writes Concat(x1, -x2); `slices_of` names what rotate_half slices."""
    half = HEAD_DIM // 2
    nodes = [
        helper.make_node("Cast", ["position_ids"], ["pos"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["pos", "last"], ["pos_u"]),
        helper.make_node("Mul", ["pos_u", "inv_freq"], ["freqs"]),
        helper.make_node("Mul", ["freqs", "scale"], ["freqs2"]),
        helper.make_node("Concat", ["freqs", "freqs2"], ["emb"], axis=-1),
        helper.make_node("Cos", ["emb"], ["cos"]), helper.make_node("Sin", ["emb"], ["sin"]),
        helper.make_node("Unsqueeze", ["cos", "heads_axis"], ["cos_u"]),
        helper.make_node("Unsqueeze", ["sin", "heads_axis"], ["sin_u"]),
        helper.make_node("Slice", [slices_of, "zero", "mid", "dim"], ["x1"]),
        helper.make_node("Slice", [slices_of, "mid", "end", "dim"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["neg"]),
        helper.make_node("Concat", ["neg", "x1"] if negated_first else ["x1", "neg"], ["rot"], axis=-1),
        helper.make_node("Mul", ["x", "cos_u"], ["xc"]), helper.make_node("Mul", ["rot", "sin_u"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["rotated"]),
        helper.make_node("Identity", ["rotated"], ["y"]),  # what reads it (attention, in a model)
    ]
    constants = {"inv_freq": 1.0 / 10000 ** (np.arange(half, dtype=np.float32) / half),
                 "scale": np.array(second_half, np.float32), "last": np.array([-1], np.int64),
                 "heads_axis": np.array([1], np.int64), "zero": np.array([0], np.int64),
                 "mid": np.array([half], np.int64), "end": np.array([HEAD_DIM], np.int64),
                 "dim": np.array([3], np.int64)}
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", HEADS, "s", HEAD_DIM]),
              helper.make_tensor_value_info("other", TensorProto.FLOAT, ["b", HEADS, "s", HEAD_DIM]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"])]
    graph = helper.make_graph(nodes, "rotary", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _fused(model: onnx.ModelProto) -> tuple[int, onnx.ModelProto]:
    import onnx_ir as ir

    graph = ir.from_proto(onnx.shape_inference.infer_shapes(model))
    count = rotary_embedding.apply(graph, SimpleNamespace(max_positions=POSITIONS))
    return count, ir.to_proto(graph)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]


def test_rotate_half_rotation_fuses_and_computes_the_same():
    model = _rotary()
    count, fused = _fused(model)
    assert count == 1
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("RotaryEmbedding") == 1 and not {"Cos", "Sin", "Neg", "Slice"} & set(ops)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, HEADS, 5, HEAD_DIM)).astype(np.float32)
    # the second row is left-padded: its positions start late and repeat 0 over the pads
    positions = np.array([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]) + np.array([[7], [0]])
    feeds = {"x": x, "other": x, "position_ids": positions}
    np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), atol=1e-5)


@pytest.mark.parametrize("why, kwargs", [
    ("the two halves of cos/sin differ (not rotate-half's repeated frequencies)", {"second_half": 2.0}),
    ("rotate_half written as (x1, -x2): the other direction", {"negated_first": False}),
    ("rotate_half of another tensor than the one rotated", {"slices_of": "other"}),
])
def test_a_rotation_the_op_cannot_express_does_not_fuse(why, kwargs):
    count, fused = _fused(_rotary(**kwargs))
    assert count == 0, why
    assert "RotaryEmbedding" not in [n.op_type for n in fused.graph.node], why
