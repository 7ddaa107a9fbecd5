"""The GroupQueryAttention rule: what it reads from the graph (scale, soft-cap, each layer's window),
and the graphs it must not fuse, each with the reason the optimize report gives."""

from __future__ import annotations

import onnx
import pytest

from compiler.optimize import optimize
from runtime.artifact import Artifact
from tests.compiler.test_optimize import _exported


def _attention_nodes(artifact) -> list:
    entry = Artifact.open(artifact).variant("cpu-fp32")
    graph = onnx.load(str(artifact / entry.model)).graph
    return [n for n in graph.node if n.op_type == "GroupQueryAttention"]


def _attributes(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_scale_soft_cap_and_windows_come_from_the_graph(tiny_artifacts):
    # Gemma 2: scale query_pre_attn_scalar ** -0.5, soft-cap 0.05, layers alternate sliding (8) and full.
    gemma2 = [_attributes(n) for n in _attention_nodes(tiny_artifacts["gemma2"])]
    assert [a["scale"] for a in gemma2] == pytest.approx([16 ** -0.5] * 2)
    assert [a["softcap"] for a in gemma2] == pytest.approx([0.05] * 2)
    assert [a["local_window_size"] for a in gemma2] == [8, -1]
    # Granite: its attention_multiplier, not 1 / sqrt(head_dim).
    assert [_attributes(n)["scale"] for n in _attention_nodes(tiny_artifacts["granite"])] == pytest.approx([0.2] * 2)
    # Mistral: every layer slides; Llama: none does, no soft-cap.
    assert [_attributes(n)["local_window_size"] for n in _attention_nodes(tiny_artifacts["mistral"])] == [8, 8]
    llama = [_attributes(n) for n in _attention_nodes(tiny_artifacts["llama"])]
    assert [(a["local_window_size"], a["softcap"], a["scale"]) for a in llama] == [(-1, 0.0, 0.25)] * 2


def _with_op_before_softmax(exported, folder, op_type: str):
    """The export with `op_type` inserted on the attention scores just before each Softmax."""
    model = onnx.load(str(exported.model_path))
    nodes = list(model.graph.node)
    for index, node in reversed(list(enumerate(nodes))):
        if node.op_type == "Softmax":
            extra = onnx.helper.make_node(op_type, [node.input[0]], [node.input[0] + f".{op_type}"])
            node.input[0] = extra.output[0]
            nodes.insert(index, extra)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    folder.mkdir(parents=True)
    onnx.save(model, str(folder / "model.onnx"))
    return type(exported)(folder, exported.interface, exported.shapes, 0, ["model.onnx"])


def test_an_op_the_fused_op_cannot_compute_is_not_fused_and_says_why(tiny_artifacts, tiny_checkpoints, tmp_path):
    exported = _with_op_before_softmax(_exported(tiny_artifacts, tiny_checkpoints, "llama"), tmp_path / "relu",
                                       "Relu")
    graph, report = optimize(exported, "onnxruntime", True, tmp_path / "out")
    assert report["rules"]["group_query_attention"] == 0
    assert report["unmatched"]["group_query_attention"] == (
        "layer 0: Relu after the mask is added to the attention scores, which GroupQueryAttention cannot do")
    assert graph.interface["kv_sharing"] == "none"  # still the Concat cache: nothing half-fused
    assert report["check"]["max_rel_logit_error"] < 1e-4


def test_a_tanh_that_is_not_a_soft_cap_is_not_fused(tiny_artifacts, tiny_checkpoints, tmp_path):
    exported = _with_op_before_softmax(_exported(tiny_artifacts, tiny_checkpoints, "llama"), tmp_path / "tanh",
                                       "Tanh")
    _, report = optimize(exported, "onnxruntime", True, tmp_path / "out")
    assert report["rules"]["group_query_attention"] == 0
    assert "layer 0:" in report["unmatched"]["group_query_attention"]
