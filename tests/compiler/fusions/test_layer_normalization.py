"""The LayerNorm families' rules on small graphs: what must fuse (and computes the same under ONNX
Runtime), and what must not."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.fusions import layer_normalization

HIDDEN = 8


def _model(nodes, inputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", HIDDEN])
                                           for n in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _fused(model: onnx.ModelProto, apply) -> tuple[int, onnx.ModelProto]:
    import onnx_ir as ir

    graph = ir.from_proto(onnx.shape_inference.infer_shapes(model))  # the rules read element types
    count = apply(graph, None)
    return count, ir.to_proto(graph)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]


def _feeds(*names):
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal((2, 3, HIDDEN)).astype(np.float32) for n in names}


def _fuses_into(model: onnx.ModelProto, apply, op_type: str, *inputs: str) -> None:
    """`apply` fuses the whole graph into one `op_type` node, which computes what the graph did."""
    count, fused = _fused(model, apply)
    assert count == 1 and [n.op_type for n in fused.graph.node] == [op_type]
    feeds = _feeds(*inputs)
    np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), atol=1e-5)


WEIGHTS = {"w": np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32), "bias": np.linspace(-0.1, 0.1, HIDDEN,
                                                                                        dtype=np.float32)}


def test_residual_add_and_layer_norm_fuse():
    model = _model([helper.make_node("Add", ["a", "b"], ["sum"]),
                    helper.make_node("LayerNormalization", ["sum", "w", "bias"], ["y"], epsilon=1e-5, axis=-1)],
                   ["a", "b"], WEIGHTS)
    _fuses_into(model, layer_normalization.apply_skip, "SkipLayerNormalization", "a", "b")


def test_layer_norm_without_a_residual_add_does_not_fuse():
    model = _model([helper.make_node("Relu", ["a"], ["r"]),
                    helper.make_node("LayerNormalization", ["r", "w", "bias"], ["y"], epsilon=1e-5, axis=-1)],
                   ["a"], WEIGHTS)
    count, fused = _fused(model, layer_normalization.apply_skip)
    assert count == 0 and "SkipLayerNormalization" not in [n.op_type for n in fused.graph.node]


def _erf_gelu(half: float) -> onnx.ModelProto:
    """y = half * x * (1 + erf(x / sqrt 2)): GELU when half is 0.5."""
    return _model([helper.make_node("Div", ["a", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                   helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["a", "p"], ["m"]),
                   helper.make_node("Mul", ["m", "half"], ["y"])], ["a"],
                  {"sqrt2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32),
                   "half": np.array(half, np.float32)})


def test_erf_gelu_fuses_and_computes_the_same():
    model = _erf_gelu(0.5)
    _fuses_into(model, layer_normalization.apply_gelu, "Gelu", "a")


@pytest.mark.parametrize("half", [0.6])
def test_what_is_not_gelu_does_not_fuse(half):
    count, fused = _fused(_erf_gelu(half), layer_normalization.apply_gelu)
    assert count == 0 and "Gelu" not in [n.op_type for n in fused.graph.node]


def test_layer_norm_without_bias_fuses_with_its_residual_add():
    """OLMo's weightless LayerNorm: the exporter writes a scale of ones and no bias input."""
    model = _model([helper.make_node("Add", ["a", "b"], ["sum"]),
                    helper.make_node("LayerNormalization", ["sum", "w"], ["y"], epsilon=1e-5, axis=-1)],
                   ["a", "b"], {"w": np.ones(HIDDEN, np.float32)})
    _fuses_into(model, layer_normalization.apply_skip, "SkipLayerNormalization", "a", "b")


def test_layer_norm_over_another_axis_does_not_fuse():
    model = _model([helper.make_node("Add", ["a", "b"], ["sum"]),
                    helper.make_node("LayerNormalization", ["sum", "w"], ["y"], epsilon=1e-5, axis=1)],
                   ["a", "b"], {"w": np.ones((3, HIDDEN), np.float32)})
    count, fused = _fused(model, layer_normalization.apply_skip)
    assert count == 0 and "SkipLayerNormalization" not in [n.op_type for n in fused.graph.node]


def _gelu_new(cube: float) -> onnx.ModelProto:
    """transformers' gelu_new as the exporter writes it: (0.5 x) * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^cube)))."""
    return _model([helper.make_node("Mul", ["a", "half"], ["h"]), helper.make_node("Pow", ["a", "cube"], ["p"]),
                   helper.make_node("Mul", ["p", "k"], ["pk"]), helper.make_node("Add", ["a", "pk"], ["s"]),
                   helper.make_node("Mul", ["s", "c"], ["sc"]), helper.make_node("Tanh", ["sc"], ["t"]),
                   helper.make_node("Add", ["t", "one"], ["t1"]), helper.make_node("Mul", ["h", "t1"], ["y"])], ["a"],
                  {"half": np.array(0.5, np.float32), "cube": np.array(cube, np.float32),
                   "k": np.array(0.044715, np.float32), "c": np.array(np.sqrt(2 / np.pi), np.float32),
                   "one": np.array(1, np.float32)})


def test_gelu_new_fuses_to_fast_gelu_and_computes_the_same():
    model = _gelu_new(3.0)
    _fuses_into(model, layer_normalization.apply_gelu, "FastGelu", "a")


def test_a_tanh_chain_with_another_power_does_not_fuse():
    count, fused = _fused(_gelu_new(2.0), layer_normalization.apply_gelu)
    assert count == 0 and "FastGelu" not in [n.op_type for n in fused.graph.node]
