"""Fusion rule: the query and key rotations -> GroupQueryAttention's own (do_rotary), and the q/k/v
Split with them where the projections were packed.

Before, per layer:                               After:
    qkv ─Split─┬─ q ─RotaryEmbedding─┐               qkv ──────────────────┐
               ├─ k ─RotaryEmbedding─┼─ GQA          cos_cache, sin_cache ─┴─ GQA (do_rotary)
               └─ v ─────────────────┘

Why: at batch 1 a decode step is a chain of small ops, and each costs ONNX Runtime a dispatch over its
thread pool; this takes three of a layer's ops away (90 of SmolLM2's) and hands the op the packed
projections as onnxruntime-genai's builder does.

The op rotates by KV slot, not by the graph's position ids. That is each token's position in Kiln's
layout (every row at the front of its buffer) and the same shift for all of a row's queries and keys
in the left-padded one (Optimum's), which rotary attention does not see. onnxruntime-genai's
right-padded batches keep a shorter row's pads between its prompt and its new tokens, so there the
new tokens would be rotated as if further away (tiny OLMo 2's rows got other tokens): the graph
before this rule is kept beside the folded one for onnxruntime-genai (optimize.fold_rotary). The
pipeline keeps the folded graph only where it gives the unfolded one's numbers (optimize.fold_rotary).

It runs on a variant's finished graph, after pack_matmuls, on the graph's proto alone (its weights
stay in their file: the rule adds and removes no initializer).
"""

from __future__ import annotations

from typing import Any

NAME = "rotary_in_attention"
COS, SIN, POSITIONS = 7, 8, 9  # GroupQueryAttention's inputs


def apply(model: Any) -> int | tuple[int, str]:
    """Fold in place (an onnx ModelProto); returns the number of layers folded, or 0 and why not (the
    graph is then unchanged: every layer is folded, or none)."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for out in graph.output:
        readers[out.name] = readers.get(out.name, 0) + 1
    attentions = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    if not attentions:
        return 0, "no GroupQueryAttention"
    if not any(n.op_type == "RotaryEmbedding" for n in graph.node):
        return 0, "no RotaryEmbedding (the model has no rotary positions, or its rotation was not fused)"
    graph_inputs = {value.name for value in graph.input}
    plans = []
    for node in attentions:
        plan = _plan(node, producer, readers, graph_inputs)
        if isinstance(plan, str):
            return 0, f"{node.name}: {plan}"
        plans.append(plan)
    removed: set[int] = set()
    for node, rotations, split, caches, interleaved in plans:
        if split is not None:
            node.input[0], node.input[1], node.input[2] = split.input[0], "", ""
            removed.add(id(split))
        else:
            node.input[0], node.input[1] = rotations[0].input[0], rotations[1].input[0]
        while len(node.input) <= SIN:
            node.input.append("")
        node.input[COS], node.input[SIN] = caches
        _set_int(node, "do_rotary", 1)
        _set_int(node, "rotary_interleaved", interleaved)
        removed.update(id(r) for r in rotations)
    kept = [n for n in graph.node if id(n) not in removed]
    del graph.node[:]
    graph.node.extend(kept)
    return len(plans)


def _plan(node: Any, producer: dict[str, Any], readers: dict[str, int], graph_inputs: set[str]) -> tuple | str:
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("do_rotary"):
        return "already rotates"
    if len(node.input) > POSITIONS and node.input[POSITIONS]:
        return "reads position ids"
    rotations = [producer.get(node.input[i]) for i in (0, 1)]
    if any(r is None or r.op_type != "RotaryEmbedding" or readers[r.output[0]] != 1 for r in rotations):
        return "its query and key are not each rotated by a RotaryEmbedding of their own"
    q_rot, k_rot = rotations
    if list(q_rot.input[1:4]) != list(k_rot.input[1:4]):
        return "query and key are rotated with other positions or caches"
    if q_rot.input[1] not in graph_inputs:
        return "the rotations read computed positions, not the graph's position ids"
    rot_attrs = [{a.name: helper.get_attribute_value(a) for a in r.attribute} for r in rotations]
    if any(a.get("rotary_embedding_dim", 0) or a.get("scale", 1.0) != 1.0 for a in rot_attrs):
        return "a partial or scaled rotation"
    interleaved = rot_attrs[0].get("interleaved", 0)
    if rot_attrs[1].get("interleaved", 0) != interleaved:
        return "query and key rotate in different layouts"
    split = producer.get(q_rot.input[0])
    sources = [q_rot.input[0], k_rot.input[0], node.input[2]]
    packed = (split is not None and split.op_type == "Split" and list(split.output) == sources
              and all(readers[name] == 1 for name in sources))
    return node, rotations, split if packed else None, (q_rot.input[2], q_rot.input[3]), interleaved


def _set_int(node: Any, name: str, value: int) -> None:
    from onnx import helper

    for attribute in node.attribute:
        if attribute.name == name:
            node.attribute.remove(attribute)
            break
    node.attribute.append(helper.make_attribute(name, value))
