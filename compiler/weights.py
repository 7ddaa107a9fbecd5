"""Questions about a graph's weights that quantization, smoothing and the sensitivity search all ask:
which MatMuls multiply by a stored weight, under which module path, and which of them is the LM head."""

from __future__ import annotations

from typing import Any, NamedTuple


def logits_writer(graph: Any) -> Any:
    return next((n for n in graph.node if "logits" in n.output), None)


def lm_head(proto: Any) -> str | None:
    """The weight MatMul that writes the `logits` output (the LM head), or None if another op does or
    it reads its weight through a Transpose (a tied head before untie_transposed_weights)."""
    head = lm_head_weight(proto)
    return head.node if head is not None and not head.transposed else None


class LmHead(NamedTuple):
    node: str
    path: str  # its module path, as weight_matmuls gives them
    activation: str
    weight: str  # the initializer: [hidden, vocab], or [vocab, hidden] where transposed
    transposed: bool


def lm_head_weight(proto: Any) -> LmHead | None:
    """The LM head of a graph: the MatMul that writes `logits`, its weight an initializer or, for a head
    tied to the embedding table, a Transpose of one. None if another op writes the logits."""
    node = logits_writer(proto.graph)
    if node is None or node.op_type != "MatMul":
        return None
    weights = {i.name for i in proto.graph.initializer}
    producer = next((n for n in proto.graph.node if node.input[1] in n.output), None)
    if node.input[1] in weights:
        weight, transposed = node.input[1], False
    elif producer is not None and producer.op_type == "Transpose" and producer.input[0] in weights:
        weight, transposed = producer.input[0], True
    else:
        return None
    scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
    return LmHead(node.name, _module_path(scopes) if scopes else "lm_head", node.input[0], weight, transposed)


def weight_matmuls(proto: Any) -> dict[str, str]:
    """{node name: module path} for every MatMul whose weight is an initializer. The path comes from
    the exporter's name scopes (`model.model.layers.0.mlp.down_proj` -> `model.layers.0.mlp.down_proj`)."""
    weights = {i.name for i in proto.graph.initializer}
    found = {}
    for node in proto.graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in weights:
            scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
            path = _module_path(scopes) if scopes else node.name
            found[node.name] = path
    return found


def _module_path(scopes: str) -> str:
    parts = [p.strip(" '\"") for p in scopes.strip("[]").split(",")]
    modules = [p for p in parts if p][:-1]  # the last entry is the op itself
    path = modules[-1] if modules else ""
    return path.removeprefix("model.")
