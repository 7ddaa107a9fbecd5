"""Fusion rule: each layer's attention core -> com.microsoft GroupQueryAttention over shared KV buffers.

Why by hand: onnxscript's GQA rule (ort_fusions/gqa.py) only matches SDPA + repeat_kv with an older
transformers mask pattern, and the graph it makes keeps the Concat cache, so every decode step
still copies the whole cache. Kiln's export is known exactly (compiler/attention.py, or
transformers' eager attention for GPT-2), so the rule anchors on the graph outputs instead of
matching a pattern: present.{i}.key/value are Concat(past, new) and feed the attention core.

Before, per layer:
    past_key ──┐
    k_new ───Concat──> present.key ──Transpose──┐
    q ──(Reshape)──────────────────────────MatMul── scale, mask, Softmax ──MatMul──...──> attn [b, s, h*d]
    past_value ┐                                                           │
    v_new ───Concat──> present.value ─────────────────────────────────────┘
After:
    q, k_new, v_new ──Transpose(0,2,1,3)──Reshape[b, s, -1]──┐
    past_key, past_value ───────────────────────────────────GroupQueryAttention──> attn [b, s, h*d]
    seqlens_k, total_length, bias (once, from the mask) ─────┘        └──> present.key, present.value

With the same buffer bound as past and present (IO binding), ONNX Runtime writes only this step's
keys and values into it: the cache is never copied. Each row's length is read from its mask
(seqlens_k = its last unmasked slot), so the graph takes both layouts: left-padded rows that end in
the last column (Optimum's; seqlens_k = slots - 1 for every row) and rows that start at slot 0
(onnxruntime-genai's, and Kiln's runtime's: each row at the front of its buffer, so ONNX Runtime's
attention reduces over that row's own slots and the result does not depend on what else is in the
batch). The additive bias masks pad slots. Rotary stays outside the op here, on the model's own
position ids: the graph this rule makes is the one onnxruntime-genai runs, and GQA's built-in rotary
rotates by KV slot, which its right-padded batches mis-position. A variant's finished graph moves the
rotations into the op afterwards (fusions/rotary_in_attention.py), and keeps this one beside it for
onnxruntime-genai. With position ids fed, the op reads only the first one in a prompt, which breaks
the left-padded layout, so they are not fed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NAME = "group_query_attention"
# Added to the scores of pad slots. Finite, so a query row with only pads (a left pad in the
# prompt, whose output is never used) softmaxes to a uniform row instead of NaN; small enough
# that fp16 graphs hold it.
MASKED_SCORE = -10000.0


def apply(model: Any, shapes: Any) -> int | tuple[int, str]:
    """Rewrite `model` (an onnx_ir Model) in place; returns the number of layers fused, or 0 and why
    not (the graph is then unchanged: every layer is fused, or none)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

    graph = model.graph
    outputs = {v.name: i for i, v in enumerate(graph.outputs)}
    found = [_layer_anchors(graph, outputs, i) for i in range(shapes.layers)]
    missing = next((i for i, anchors in enumerate(found) if anchors is None), None)
    if missing is not None:
        return 0, f"layer {missing}: no Concat(past, new) -> attention core -> merged heads around present.{missing}"
    problem = next(((i, a) for i, a in enumerate(found) if isinstance(a, str)), None)
    if problem is not None:
        return 0, f"layer {problem[0]}: {problem[1]}"
    shared = _mask_inputs(graph)
    for layer, anchors in enumerate(found):
        _fuse_layer(graph, outputs, layer, anchors, shared, shapes)
    _last_token_of_each_row(graph, shared["row_end"])
    model.opset_imports.setdefault("com.microsoft", 1)
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    return len(found)


def _layer_anchors(graph: Any, outputs: dict[str, int], layer: int) -> dict[str, Any] | str | None:
    present_key = graph.outputs[outputs[f"present.{layer}.key"]]
    present_value = graph.outputs[outputs[f"present.{layer}.value"]]
    key_concat, value_concat = present_key.producer(), present_value.producer()
    if key_concat is None or value_concat is None or {key_concat.op_type, value_concat.op_type} != {"Concat"}:
        return None
    scores = _only_consumer(_only_consumer(key_concat, "Transpose"), "MatMul")
    weighted = _only_consumer(value_concat, "MatMul")
    if scores is None or weighted is None:
        return None
    query = scores.inputs[0]
    if query.producer() is not None and query.producer().op_type == "Reshape":  # Kiln's grouped attention
        query = query.producer().inputs[0]
    attention_out = _merged_heads(weighted)
    if attention_out is None:
        return None
    chain = _score_chain(scores)
    if isinstance(chain, str):
        return chain
    return {"query": query, "key": key_concat.inputs[1], "value": value_concat.inputs[1],
            "past_key": key_concat.inputs[0], "past_value": value_concat.inputs[0], "out": attention_out, **chain}


def _score_chain(scores: Any) -> dict[str, float] | str:
    """What the graph does between Q @ K^T and Softmax, as GroupQueryAttention's scale and softcap:

        scores ──Mul/Div by constants (product p)──[Tanh──Mul(cap)]──(Reshape)──Add(mask)──(Reshape)──Softmax

    Without Tanh, scale = p (the model's own: Granite's attention_multiplier, Gemma 2's
    query_pre_attn_scalar); with it (Gemma 2's soft-cap), tanh(p * QK) * cap = tanh(scale * QK / cap) * cap,
    so scale = p * cap. Anything else there is not what the op computes: why, as a string."""
    before, after, tanh, masked, node = 1.0, [], False, False, scores
    while True:
        consumers = list(node.outputs[0].consumers())
        if len(consumers) != 1:
            return f"the attention scores feed {len(consumers)} nodes, not one chain to Softmax"
        node = consumers[0]
        if node.op_type == "Softmax":
            break
        constant = _scalar(node.inputs[1]) if len(node.inputs) == 2 else None
        if masked and node.op_type != "Reshape":  # the op scales and caps the scores, then adds the mask
            return f"{node.op_type} after the mask is added to the attention scores, which GroupQueryAttention " \
                   "cannot do"
        if node.op_type == "Add":
            masked = True
        elif node.op_type in ("Mul", "Div") and constant is not None:
            factor = constant if node.op_type == "Mul" else 1.0 / constant
            if tanh:
                after.append(factor)
            else:
                before *= factor
        elif node.op_type == "Tanh" and not tanh:
            tanh = True
        elif node.op_type != "Reshape":
            return f"{node.op_type} between the attention scores and Softmax, which GroupQueryAttention cannot do"
    if not tanh:
        return {"scale": before, "softcap": 0.0}
    if len(after) > 1:
        return "a Tanh in the attention scores that is not a soft-cap (tanh(x / cap) * cap)"
    cap = after[0] if after else 1.0  # a cap of 1: the export folded away the divide and multiply by 1
    return {"scale": before * cap, "softcap": cap}


def _scalar(value: Any) -> float | None:
    """A one-element constant's value (an initializer or a Constant node), else None."""
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant":
        tensor = producer.attributes["value"].value
    if tensor is None:
        return None
    array = tensor.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _window(shapes: Any, layer: int) -> int:
    """GroupQueryAttention's local_window_size for the layer: -1 attends to every slot."""
    windows = shapes.layer_windows
    window = windows[layer] if layer < len(windows) else shapes.sliding_window
    return window or -1


def _only_consumer(node: Any, op_type: str) -> Any:
    if node is None:
        return None
    consumers = list(node.outputs[0].consumers())
    return consumers[0] if len(consumers) == 1 and consumers[0].op_type == op_type else None


def _merged_heads(node: Any) -> Any:
    """Follow weights @ value through Reshape/Transpose to the [b, s, heads * d] tensor (GPT-2 merges
    batch and sequence too, [b * s, heads * d], for its Gemm)."""
    value = node.outputs[0]
    for _ in range(4):
        consumers = list(value.consumers())
        if len(consumers) != 1 or consumers[0].op_type not in ("Reshape", "Transpose"):
            return None
        value = consumers[0].outputs[0]
        if consumers[0].op_type == "Reshape" and value.shape is not None and len(value.shape) in (2, 3):
            return value
    return None


def _carry_types(nodes: Any) -> None:
    """Give the values this rule creates their element types. Later passes need them: the fp16
    conversion, for one, places its Casts around fp32-only ops by them."""
    import onnx_ir as ir

    for node in nodes:
        output = node.outputs[0]
        if output.dtype is not None:
            continue
        if node.op_type == "Constant":
            output.dtype = node.attributes["value"].value.dtype
        elif node.op_type == "Shape":
            output.dtype = ir.DataType.INT64
        elif node.op_type == "Equal":
            output.dtype = ir.DataType.BOOL
        elif node.op_type == "Cast":
            output.dtype = ir.DataType(node.attributes["to"].value)
        elif node.op_type == "Where":
            output.dtype = node.inputs[1].dtype
        elif node.inputs and node.inputs[0] is not None:
            output.dtype = node.inputs[0].dtype


def _merged_source(value: Any) -> Any:
    """x if value = Transpose(0, 2, 1, 3)(Reshape(x)) with x of rank 3, [b, s, n * d]; else None."""
    transpose = value.producer()
    if transpose is None or transpose.op_type != "Transpose":
        return None
    perm = transpose.attributes.get("perm")
    reshape = transpose.inputs[0].producer()
    if perm is None or list(perm.value) != [0, 2, 1, 3] or reshape is None or reshape.op_type != "Reshape":
        return None
    source = reshape.inputs[0]
    return source if source.shape is not None and len(source.shape) == 3 else None


def _mask_inputs(graph: Any) -> dict[str, Any]:
    """Once for all layers:

        attention_mask [b, t] ──Shape[1]──> t ──Cast int32──> total_length (scalar)
        attention_mask × Range(t) ──ReduceMax over slots──Cast int32──> seqlens_k [b] (last unmasked slot)
        attention_mask ──Equal 0──Where(MASKED_SCORE, 0)──Reshape[b,1,1,t]──Expand[b,1,s,t]──> bias
    """
    import onnx_ir as ir

    tape = ir.tape.Tape()
    inputs = {v.name: v for v in graph.inputs}
    mask, ids = inputs["attention_mask"], inputs["input_ids"]

    def const(name: str, array: np.ndarray) -> Any:
        return tape.op("Constant", [], {"value": ir.tensor(array, name=name)})

    slots = tape.op("Shape", [mask], {"start": 1, "end": 2})
    batch = tape.op("Shape", [ids], {"start": 0, "end": 1})
    seq = tape.op("Shape", [ids], {"start": 1, "end": 2})
    total_length = tape.op("Squeeze", [tape.op("Cast", [slots], {"to": ir.DataType.INT32})])
    slot_index = tape.op("Range", [const("zero_index", np.array(0, np.int64)), tape.op("Squeeze", [slots]),
                                   const("one_index", np.array(1, np.int64))])
    unmasked_index = tape.op("Mul", [mask, slot_index])
    last_unmasked = tape.op("ReduceMax", [unmasked_index, const("slot_axis", np.array([1], np.int64))], {"keepdims": 0})
    seqlens_k = tape.op("Cast", [last_unmasked], {"to": ir.DataType.INT32})
    is_pad = tape.op("Equal", [mask, const("zero", np.array(0, np.int64))])
    row_bias = tape.op("Where", [is_pad, const("masked", np.array(MASKED_SCORE, np.float32)),
                                 const("unmasked", np.array(0.0, np.float32))])
    one = const("one64", np.array([1], np.int64))
    bias_4d = tape.op("Reshape", [row_bias, tape.op("Concat", [batch, one, one, slots], {"axis": 0})])
    bias = tape.op("Expand", [bias_4d, tape.op("Concat", [batch, one, seq, slots], {"axis": 0})])
    _carry_types(tape.nodes)
    first = graph.node(0)
    graph.insert_before(first, tape.nodes)
    return {"seqlens_k": seqlens_k, "total_length": total_length, "bias": bias, "row_end": last_unmasked}


def _last_token_of_each_row(graph: Any, row_end: Any) -> None:
    """`logits: last` exports Slice(hidden, -1:) on the sequence axis: the last column, which is every
    row's last token only when rows are left-padded. onnxruntime-genai feeds a batch of prompts
    right-padded, rows from slot 0 (measured on the tiny Llama: its shorter rows' tokens were wrong
    with the Slice); each row's last token is then at min(seq, row_end + 1) - 1, which is seq - 1
    for left-padded rows and for decode steps, so one GatherND at that index reads both layouts.
    Without such a Slice (`logits: all`) the graph stays as it is."""
    import onnx_ir as ir

    logits = next((v for v in graph.outputs if v.name == "logits"), None)
    node = logits.producer() if logits is not None else None
    while node is not None and node.op_type != "Slice" and node.inputs:
        node = node.inputs[0].producer()
    if node is None or node.op_type != "Slice" or not _is_last_position(node):
        return
    tape = ir.tape.Tape()
    ids = next(v for v in graph.inputs if v.name == "input_ids")
    one = tape.op("Constant", [], {"value": ir.tensor(np.array(1, np.int64), name="one_row_end")})
    seq = tape.op("Shape", [ids], {"start": 1, "end": 2})
    last = tape.op("Sub", [tape.op("Min", [tape.op("Add", [row_end, one]), seq]), one])
    axis = tape.op("Constant", [], {"value": ir.tensor(np.array([1], np.int64), name="row_axis")})
    picked = tape.op("GatherND", [node.inputs[0], tape.op("Unsqueeze", [last, axis])], {"batch_dims": 1})
    kept = tape.op("Unsqueeze", [picked, axis])
    _carry_types(tape.nodes)
    kept.shape = node.outputs[0].shape
    graph.insert_before(node, tape.nodes)
    ir.convenience.replace_all_uses_with(node.outputs[0], kept)


def _is_last_position(node: Any) -> bool:
    """Slice(x, starts=[-1], ends=[any], axes=[1]), steps 1 or absent."""
    def ints(index: int) -> list[int] | None:
        value = node.inputs[index] if len(node.inputs) > index else None
        tensor = value.const_value if value is not None else None
        return None if tensor is None else [int(x) for x in np.asarray(tensor.numpy()).ravel()]

    steps = ints(4) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    return ints(1) == [-1] and ints(3) == [1] and steps == [1]


def _fuse_layer(graph: Any, outputs: dict[str, int], layer: int, anchors: dict[str, Any], shared: dict[str, Any],
                shapes: Any) -> None:
    import onnx_ir as ir

    tape = ir.tape.Tape()
    merge = tape.op("Constant", [], {"value": ir.tensor(np.array([0, 0, -1], np.int64), name=f"merge_{layer}")})

    def heads_last(value: Any, heads: int) -> Any:  # [b, n, s, d] -> [b, s, n * d]
        merged = _merged_source(value)
        if merged is not None:  # it was split from [b, s, n * d] just before: use that
            return merged
        rotary = value.producer()
        if rotary is not None and rotary.op_type == "RotaryEmbedding" and _merged_source(rotary.inputs[0]):
            # Rotate the [b, s, n * d] tensor itself (RotaryEmbedding takes 3-D input with num_heads):
            # no Reshape/Transpose pair on either side of it.
            source = _merged_source(rotary.inputs[0])
            return tape.op("RotaryEmbedding", [source, *rotary.inputs[1:]], {"interleaved": 0, "num_heads": heads},
                           domain="com.microsoft")
        return tape.op("Reshape", [tape.op("Transpose", [value], {"perm": [0, 2, 1, 3]}), merge])

    attention, present_key, present_value = tape.op_multi_out(
        "GroupQueryAttention",
        [heads_last(anchors["query"], shapes.heads), heads_last(anchors["key"], shapes.kv_heads),
         heads_last(anchors["value"], shapes.kv_heads),
         anchors["past_key"], anchors["past_value"], shared["seqlens_k"], shared["total_length"],
         None, None, None, shared["bias"]],
        {"num_heads": shapes.heads, "kv_num_heads": shapes.kv_heads, "scale": anchors["scale"],
         "softcap": anchors["softcap"], "local_window_size": _window(shapes, layer)},
        num_outputs=3, domain="com.microsoft", name=f"layers.{layer}.GroupQueryAttention",
    )
    _carry_types(tape.nodes)
    if len(anchors["out"].shape) == 2:
        flat = tape.op("Constant", [], {"value": ir.tensor(np.array([-1, shapes.heads * shapes.head_dim], np.int64),
                                                           name=f"flat_{layer}")})
        attention = tape.op("Reshape", [attention, flat])
    graph.insert_after(anchors["out"].producer(), tape.nodes)
    ir.convenience.replace_all_uses_with(anchors["out"], attention)
    for kind, fused in (("key", present_key), ("value", present_value)):
        name = f"present.{layer}.{kind}"
        old = graph.outputs[outputs[name]]
        old.name = f"{name}.unfused"
        fused.name, fused.shape, fused.dtype = name, old.shape, old.dtype
        graph.outputs[outputs[name]] = fused
