"""pack_matmuls: sibling weight MatMuls (and MatMulNBits) -> one MatMul and a Split, same numbers."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from compiler.fusions import pack_matmuls

K = 64


def _model(widths, shared_input=True, tied=False):
    rng = np.random.default_rng(0)
    nodes, inits, outputs = [], [], []
    for i, n in enumerate(widths):
        source = "x" if shared_input or i == 0 else "x2"
        weight = "w0" if tied else f"w{i}"
        if not tied or i == 0:
            inits.append(numpy_helper.from_array(rng.standard_normal((K, n)).astype(np.float32), weight))
        nodes.append(helper.make_node("MatMul", [source, weight], [f"y{i}"], name=f"mm{i}"))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, n]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, K]) for n in ("x", "x2")]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def _packed(model):
    """pack_matmuls on an onnx_ir copy of `model`: (MatMuls removed, the packed ModelProto)."""
    graph = ir.from_proto(model)
    removed = pack_matmuls.apply(graph)
    return removed, ir.to_proto(graph)


def _run(model):
    feed = {n: np.random.default_rng(1).standard_normal((2, K)).astype(np.float32) for n in ("x", "x2")}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: feed[n] for n in names})


def test_siblings_pack_into_one_matmul_and_a_split_with_the_same_outputs():
    model = _model([48, 16, 16])
    before = _run(model)
    removed, model = _packed(model)
    assert removed == 2
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Split"]
    assert sorted(i.name for i in model.graph.initializer) == ["mm0_packed_1", "mm0_packed_sizes"]
    onnx.checker.check_model(model)
    after = _run(model)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_quantized_siblings_pack_and_keep_their_numbers():
    model = _model([64, 32])
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=False, accuracy_level=4)
    quantizer.process()
    model = quantizer.model.model
    before = _run(model)
    removed, model = _packed(model)
    assert removed == 1
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits", "Split"]
    assert next(a.i for a in model.graph.node[0].attribute if a.name == "N") == 96
    assert all(np.array_equal(a, b) for a, b in zip(before, _run(model), strict=True))


def test_what_must_not_pack():
    for model in (_model([16, 16], shared_input=False),  # different activations
                  _model([16, 16], tied=True),           # one weight read twice
                  _model([16])):                         # nothing beside it
        removed, packed = _packed(model)
        assert removed == 0
        assert len(packed.graph.node) == len(model.graph.node)
