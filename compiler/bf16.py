"""bfloat16 graphs for ONNX Runtime's CUDA provider, and the fp32 twins that stand in for them on a CPU.

A `precision: bf16` CUDA variant is its fp16 sibling's graph (compiler/quantize.py's fp16 conversion:
the same ops kept in fp32, the same fused ops in half) with every half-precision tensor in bfloat16:
bf16 has fp32's exponent range, so activations that overflow fp16 (|x| > 65504) stay finite, for
three fewer mantissa bits. The weights are rounded to bf16 from their fp32 values, not from fp16.

ONNX Runtime's CPU provider has no bfloat16 kernels for most ops (MatMul, Where, GroupQueryAttention),
so a machine without a GPU cannot run the graph itself. Every step of the compile that runs a graph
(the overflow check, the layerwise errors, the fold checks, the accuracy gates) runs its fp32 twin
instead (`cpu_graph`): the same nodes over the same weights, bf16 tensors widened to fp32, and each
value a node writes in bf16 rounded to bf16 right after it (a Cast to bfloat16 and back: ONNX Runtime's
CPU Cast rounds to nearest even, as CUDA's conversion does). Inside a node the twin computes in fp32;
so do the CUDA kernels (they accumulate in fp32 and round what they write). One value is not rounded:
the KV cache that GroupQueryAttention writes in place (a Cast behind it would end the in-place update),
so the twin's keys and values keep fp32's bits where the GPU's keep bf16's. The twin is what the gates
measure; the placement check reads the bf16 graph itself (compiler/cuda_placement.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from .graph import OnnxArtifact, initializer_array, load_structure, retyped_kv, save_proto, saved_graph

BFLOAT16 = "bfloat16"
TWIN_SUFFIX = ".fp32-twin"
# Ops whose CUDA kernels take fp16 but not bf16 (exact_top_logits' TopK): computed in fp32 between Casts.
WIDENED_OPS = {("", "TopK")}
# Outputs written in place into the bound KV buffers: rounding them would end the in-place update.
IN_PLACE_OUTPUTS = {("com.microsoft", "GroupQueryAttention"): (1, 2)}


def is_bfloat16(interface: dict[str, Any]) -> bool:
    return any(entry["dtype"] == BFLOAT16 for entry in interface["inputs"])


def to_bfloat16(proto: Any, fp32_values: dict[str, np.ndarray]) -> None:
    """Every float16 tensor of `proto` (an fp16 graph with its weights loaded) made bfloat16, in place:
    declared types, Cast targets, constants, and initializers, these rounded from their fp32 values in
    `fp32_values` where the name is there (else from their fp16 values, which bf16 holds to its own
    rounding)."""
    import ml_dtypes
    from onnx import TensorProto, numpy_helper

    half, bf16 = TensorProto.FLOAT16, TensorProto.BFLOAT16
    graph = proto.graph
    _retype_declared(graph, half, bf16)
    for tensor in graph.initializer:
        if tensor.data_type == half:
            wide = fp32_values.get(tensor.name)
            if wide is None or list(wide.shape) != list(tensor.dims):
                wide = numpy_helper.to_array(tensor).astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(wide.astype(ml_dtypes.bfloat16), tensor.name))
    for node in graph.node:
        _retype_attributes(node, half, bf16, ml_dtypes.bfloat16)
    _widen(proto, WIDENED_OPS)


def _retype_declared(graph: Any, old: int, new: int) -> None:
    """The graph's declared inputs, outputs and value_info of ONNX element type `old` made `new`."""
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.tensor_type.elem_type == old:
            value.type.tensor_type.elem_type = new


def _retype_attributes(node: Any, old: int, new: int, values_as: Any) -> None:
    """A node's type attributes (to, dtype) of element type `old` made `new`, and its tensor attributes
    of `old` converted (through fp32) to the numpy dtype `values_as`."""
    from onnx import numpy_helper

    for attribute in node.attribute:
        if attribute.name in ("to", "dtype") and attribute.type == attribute.INT and attribute.i == old:
            attribute.i = new
        elif attribute.type == attribute.TENSOR and attribute.t.data_type == old:
            values = numpy_helper.to_array(attribute.t).astype(np.float32).astype(values_as)
            attribute.t.CopyFrom(numpy_helper.from_array(values, attribute.t.name))


def _widen(proto: Any, ops: set[tuple[str, str]]) -> None:
    """Each node of `ops` whose first input is bf16 computed in fp32: a Cast before it, and one back to bf16
    after each output that was bf16."""
    from onnx import TensorProto, helper

    from .cuda_placement import tensor_types

    types = tensor_types(proto)
    nodes = []
    for node in proto.graph.node:
        if (node.domain, node.op_type) not in ops or types.get(node.input[0]) != BFLOAT16:
            nodes.append(node)
            continue
        nodes.append(helper.make_node("Cast", [node.input[0]], [node.input[0] + "/fp32"], to=TensorProto.FLOAT,
                                      name=_named(node, "widen")))
        node.input[0] += "/fp32"
        nodes.append(node)
        for index, name in enumerate(node.output):
            if name and types.get(name) == BFLOAT16:
                node.output[index] = name + "/fp32"
                nodes.append(helper.make_node("Cast", [name + "/fp32"], [name], to=TensorProto.BFLOAT16,
                                              name=_named(node, f"narrow{index}")))
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)


def cpu_graph(artifact: OnnxArtifact) -> OnnxArtifact:
    """The graph the CPU runs for `artifact`: itself, or for a bfloat16 graph its fp32 twin (module doc),
    written once beside it (in `<folder>.fp32-twin`)."""
    if not is_bfloat16(artifact.interface):
        return artifact
    folder = twin_folder(artifact)
    interface = retyped_kv(artifact.interface, "float32")
    if not (folder / "model.onnx").exists():
        proto = fp32_twin(load_structure(artifact.model_path), artifact.folder)
        save_proto(proto, folder)
    return dataclasses.replace(saved_graph(folder, interface, artifact.shapes), node_count=artifact.node_count)


def twin_folder(artifact: OnnxArtifact) -> Path:
    """Where cpu_graph writes a graph's twin: beside it, deleted with it (VariantBuild.replace_graph)."""
    return artifact.folder.with_name(artifact.folder.name + TWIN_SUFFIX)


def fp32_twin(proto: Any, folder: Path) -> Any:
    """The fp32 twin of a bfloat16 graph `proto` whose weights lie in `folder` (module doc)."""
    from onnx import TensorProto, helper, numpy_helper

    from .cuda_placement import tensor_types

    float32, bf16 = TensorProto.FLOAT, TensorProto.BFLOAT16
    types = tensor_types(proto)
    graph = proto.graph
    _retype_declared(graph, bf16, float32)
    for tensor in graph.initializer:  # read one by one: a variant's graphs share a weights file by hard links
        values = initializer_array(tensor, folder)
        tensor.CopyFrom(numpy_helper.from_array(values.astype(np.float32) if tensor.data_type == bf16 else values,
                                                tensor.name))
    nodes = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type == "Cast" and _attribute(node, "to") == bf16:
            wide = node.output[0]
            node.output[0] = wide + "/bf16"
            nodes.append(helper.make_node("Cast", [node.output[0]], [wide], to=float32, name=_named(node, "widen")))
            continue
        _retype_attributes(node, bf16, float32, np.float32)
        if node.op_type in ("Constant", "ConstantOfShape"):
            continue  # exact bf16 values, widened above
        in_place = IN_PLACE_OUTPUTS.get((node.domain, node.op_type), ())
        for index, name in enumerate(node.output):
            if not name or types.get(name) != BFLOAT16 or index in in_place:
                continue
            node.output[index] = name + "/wide"
            nodes.append(helper.make_node("Cast", [name + "/wide"], [name + "/bf16"], to=bf16,
                                          name=_named(node, f"round{index}")))
            nodes.append(helper.make_node("Cast", [name + "/bf16"], [name], to=float32,
                                          name=_named(node, f"widen{index}")))
    del graph.node[:]
    graph.node.extend(nodes)
    return proto


def _attribute(node: Any, name: str) -> Any:
    return next((a.i for a in node.attribute if a.name == name), None)


def _named(node: Any, what: str) -> str:
    return f"{node.name or node.output[0]}/{what}"
