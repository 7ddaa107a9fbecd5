"""rotary_in_attention: the q and k RotaryEmbeddings before a GroupQueryAttention -> the op's own rotation
(do_rotary), the packed projections' Split with them; small graphs that must fold, and graphs that must
not, each run by ONNX Runtime before and after."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.fusions import rotary_in_attention

HEADS, KV_HEADS, HEAD_DIM, SEQ, MAX_POSITIONS = 4, 2, 16, 5, 16  # do_rotary takes head sizes of 16s
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


def _caches() -> tuple[np.ndarray, np.ndarray]:
    """cos and sin for every position, [max positions, head_dim / 2], as a rotary embedding stores them."""
    inverse = 1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    angles = np.arange(MAX_POSITIONS)[:, None] * inverse[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _model(packed: bool = True, positions: str = "position_ids", key_rotated: bool = True,
           interleaved: tuple[int, int] = (0, 0)) -> onnx.ModelProto:
    """One attention layer as the earlier fusions leave it: qkv (packed) or q, k, v inputs; RotaryEmbedding
    on q and k; GroupQueryAttention over an empty past (a first prompt of SEQ tokens)."""
    cos, sin = _caches()
    inits = [numpy_helper.from_array(cos, "cos_cache"), numpy_helper.from_array(sin, "sin_cache"),
             numpy_helper.from_array(np.array([SEQ - 1], np.int32), "seqlens_k"),
             numpy_helper.from_array(np.array(SEQ, np.int32), "total_sequence_length")]
    nodes = []
    inputs = [helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, SEQ])]
    if packed:
        inputs.append(helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, SEQ, Q + 2 * KV]))
        inits.append(numpy_helper.from_array(np.array([Q, KV, KV], np.int64), "sizes"))
        nodes.append(helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1, name="split"))
    else:
        inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, SEQ, width])
                   for name, width in (("q", Q), ("k", KV), ("v", KV))]
    if positions != "position_ids":  # positions computed in the graph rather than read from its input
        nodes.append(helper.make_node("Identity", ["position_ids"], [positions], name="computed"))
    nodes.append(helper.make_node("RotaryEmbedding", ["q", positions, "cos_cache", "sin_cache"], ["q_rot"],
                                  domain="com.microsoft", num_heads=HEADS, interleaved=interleaved[0], name="rq"))
    key = "k"
    if key_rotated:
        nodes.append(helper.make_node("RotaryEmbedding", ["k", positions, "cos_cache", "sin_cache"], ["k_rot"],
                                      domain="com.microsoft", num_heads=KV_HEADS, interleaved=interleaved[1],
                                      name="rk"))
        key = "k_rot"
    past = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, KV_HEADS, 0, HEAD_DIM])
            for name in ("past_key", "past_value")]
    nodes.append(helper.make_node(
        "GroupQueryAttention", ["q_rot", key, "v", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
        ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS,
        name="attention"))
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, SEQ, Q]),
               helper.make_tensor_value_info("present_key", TensorProto.FLOAT, [1, KV_HEADS, SEQ, HEAD_DIM])]
    graph = helper.make_graph(nodes, "layer", inputs + past, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    feed = {"position_ids": np.arange(SEQ)[None].astype(np.int64),
            "past_key": np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32),
            "past_value": np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32)}
    projections = {name: rng.standard_normal((1, SEQ, width)).astype(np.float32)
                   for name, width in (("q", Q), ("k", KV), ("v", KV))}
    feed["qkv"] = np.concatenate(list(projections.values()), axis=-1)
    feed.update(projections)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})


@pytest.mark.parametrize("packed", [True, False])
def test_the_rotations_fold_into_attention_with_the_same_outputs(packed):
    model = _model(packed)
    before = _run(model)
    assert rotary_in_attention.apply(model) == 1
    ops = [node.op_type for node in model.graph.node]
    assert ops == ["GroupQueryAttention"]  # the rotations gone, and the Split of packed projections too
    attention = model.graph.node[0]
    attributes = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
    assert attributes["do_rotary"] == 1 and attributes["rotary_interleaved"] == 0
    assert list(attention.input[:3]) == (["qkv", "", ""] if packed else ["q", "k", "v"])
    onnx.checker.check_model(model)
    after = _run(model)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("changes", "why"), [
    ({"key_rotated": False}, "not each rotated by a RotaryEmbedding of their own"),
    ({"positions": "computed_positions"}, "read computed positions"),
    ({"interleaved": (0, 1)}, "rotate in different layouts"),
])
def test_a_layer_the_op_cannot_rotate_alike_is_left_as_it_is(changes, why):
    model = _model(**changes)
    before = model.SerializeToString()
    count, reason = rotary_in_attention.apply(model)
    assert count == 0 and why in reason
    assert model.SerializeToString() == before


def test_a_graph_without_attention_or_rotation_says_so():
    model = _model()
    attention_free = onnx.ModelProto()
    attention_free.CopyFrom(model)
    kept = [n for n in attention_free.graph.node if n.op_type != "GroupQueryAttention"]
    del attention_free.graph.node[:]
    attention_free.graph.node.extend(kept)
    assert rotary_in_attention.apply(attention_free) == (0, "no GroupQueryAttention")
    rotation_free = onnx.ModelProto()
    rotation_free.CopyFrom(model)
    for node in rotation_free.graph.node:
        if node.op_type == "RotaryEmbedding":
            node.op_type = "Identity"
    assert rotary_in_attention.apply(rotation_free)[1].startswith("no RotaryEmbedding")
