"""The RMSNorm rules on small graphs: the chain the dynamo exporter emits fuses (and computes the
same under ONNX Runtime); a norm over another axis does not."""

from __future__ import annotations

import numpy as np
from onnx import helper

from compiler.fusions import rms_normalization
from tests.compiler.fusions.test_layer_normalization import HIDDEN, _feeds, _fused, _fuses_into, _model, _run

WEIGHT = {"w": np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32), "two": np.array(2, np.float32),
          "eps": np.array(1e-6, np.float32)}


def _rms(source: str, axis: int) -> list:
    return [helper.make_node("Pow", [source, "two"], ["sq"]),
            helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1, noop_with_empty_axes=0),
            helper.make_node("Add", ["mean", "eps"], ["var"]), helper.make_node("Sqrt", ["var"], ["std"]),
            helper.make_node("Reciprocal", ["std"], ["inv"]), helper.make_node("Mul", [source, "inv"], ["normed"]),
            helper.make_node("Mul", ["w", "normed"], ["y"])]


def _weights(axis: int) -> dict:
    return {**WEIGHT, "axes": np.array([axis], np.int64)}


def test_rms_norm_fuses_and_computes_the_same():
    model = _model(_rms("a", -1), ["a"], _weights(-1))
    _fuses_into(model, rms_normalization.apply, "SimplifiedLayerNormalization", "a")


def test_residual_add_and_rms_norm_fuse():
    model = _model([helper.make_node("Add", ["a", "b"], ["sum"]), *_rms("sum", -1)], ["a", "b"], _weights(-1))
    _, normed = _fused(model, rms_normalization.apply)
    count, fused = _fused(normed, rms_normalization.apply_skip)
    assert count == 1 and [n.op_type for n in fused.graph.node] == ["SkipSimplifiedLayerNormalization"]
    # Nothing reads the mean and inverse deviation: unnamed, so ONNX Runtime does not write them.
    assert list(fused.graph.node[0].output)[1:3] == ["", ""]
    feeds = _feeds("a", "b")
    np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), atol=1e-5)


def test_a_norm_over_another_axis_does_not_fuse():
    count, fused = _fused(_model(_rms("a", 1), ["a"], _weights(1)), rms_normalization.apply)
    assert count == 0 and "SimplifiedLayerNormalization" not in [n.op_type for n in fused.graph.node]
