"""GPTQ rounding (compiler/gptq.py): what it promises, on arrays and through ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from compiler.gptq import gptq_blocks, matmul_nbits


def _correlated_inputs(rng, features: int, *tokens: int) -> list[np.ndarray]:
    """Samples of activations whose features move together, as a layer's inputs do (and GPTQ
    exploits), some channels much larger than others."""
    mixing = rng.standard_normal((features, features)) / np.sqrt(features)
    scales = np.exp(rng.standard_normal(features))
    return [(rng.standard_normal((count, features)) @ mixing) * scales for count in tokens]


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_moves_a_layers_outputs_less_than_nearest_rounding(bits):
    rng = np.random.default_rng(0)
    k, n, block = 128, 48, 32
    weight = rng.standard_normal((k, n)).astype(np.float32)
    calibration, held_out = _correlated_inputs(rng, k, 512, 256)

    def decoded(hessian):
        codes, scales, zeros = gptq_blocks(weight, hessian, bits, block)
        assert codes.max() < 2 ** bits and zeros.max() < 2 ** bits
        return ((codes.astype(np.float64) - zeros[..., None]) * scales[..., None]).reshape(n, k).T

    nearest = decoded(np.eye(k))  # no correlations to use: each weight to its nearest level
    assert np.abs(nearest - weight).max() <= (weight.max() - weight.min()) / (2 ** bits - 1)
    gptq = decoded(calibration.T @ calibration)
    error = {name: np.linalg.norm(held_out @ (w - weight)) for name, w in (("nearest", nearest), ("gptq", gptq))}
    assert error["gptq"] < 0.8 * error["nearest"], error  # measured: 0.75 (4 bits), 0.73 (8 bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_nbits_packing_is_what_onnx_runtime_reads(bits):
    rng = np.random.default_rng(1)
    k, n, block = 96, 40, 32  # 3 blocks: the 4-bit zero points pad to a whole byte
    weight = rng.standard_normal((k, n)).astype(np.float32)
    codes, scales, zeros = gptq_blocks(weight, np.eye(k), bits, block)
    expected = ((codes.astype(np.float32) - zeros[..., None]) * scales[..., None]).reshape(n, k).T
    node, initializers = matmul_nbits("mm", "x", "y", "w", codes, scales, zeros, bits, block)
    next(a for a in node.attribute if a.name == "accuracy_level").i = 0  # fp32 activations: exact
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, n])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((2, k)).astype(np.float32)
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.allclose(y, x @ expected, atol=1e-4)
