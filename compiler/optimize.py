"""The optimize stage: the validated export -> the graph a variant's target runs best, with a report.

    export (fp32, standard ops) ─constant folding─┬─ onnxruntime: fusion rules (compiler/fusions) ─┐
                                                  └─ tensorrt: standard ops only, checked ─────────┴─> check vs unfused

Every target gets onnxscript's optimizer (constant folding, shape simplification, dead code). The
onnxruntime target then gets ONNX Runtime contrib ops; when GroupQueryAttention replaces attention,
the interface says so (`kv_sharing: shared-buffer`) and the runtime binds one buffer as past and
present; `row_lengths: mask` says the op reads each row's length from its mask, so the runtime may
keep every row at the front of its buffer. The fused graph is run against the unfused one under
ONNX Runtime on a left-padded batch, through prefill and decode steps, with the runtime's own
backend (in both row layouts where the graph takes both); a difference beyond the fp32 tolerance
of the export stage fails the compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from runtime.backends.registry import ONNXRUNTIME_TARGETS, Target
from runtime.files import link_or_copy

from .bf16 import cpu_graph, twin_folder
from .errors import ExportMismatch
from .export import forget_matched_graphs, small_constants_kept
from .fusions import ONNXRUNTIME_RULES, PACK_MATMULS, ROTARY_IN_ATTENTION, group_query_attention
from .graph import (
    MODEL_FILE,
    OnnxArtifact,
    append_external,
    initializer_array,
    load_ir,
    load_structure,
    retyped_kv,
    save_model,
    save_structure,
    saved_graph,
)
from .progress import release_freed_memory
from .tensorrt_check import check_tensorrt_graph
from .validate_export import RELATIVE_TOLERANCE


def optimize(exported: OnnxArtifact, target: str, fuse: bool, folder: Path) -> tuple[OnnxArtifact, dict[str, Any]]:
    from onnxscript import optimizer

    model = load_ir(exported.model_path)
    nodes_before = len(model.graph)
    with small_constants_kept():
        optimizer.optimize(model)
    rules, unmatched = {}, {}
    if target in ONNXRUNTIME_TARGETS and fuse:
        for rule in ONNXRUNTIME_RULES:
            rules[rule.name], why = rule.run(model, exported.shapes)
            if why:
                unmatched[rule.name] = why
    _drop_unused_initializers(model)
    interface = _interface_after(exported.interface, rules)
    save_model(model, folder)
    optimized = saved_graph(folder, interface, exported.shapes)
    report: dict[str, Any] = {
        "target": target,
        "rules": rules,
        "unmatched": unmatched,
        "nodes_before": nodes_before,
        "nodes_after": optimized.node_count,
        "ops_after": dict(sorted(_op_counts(model).items())),
    }
    if target == Target.TENSORRT:
        report["tensorrt_check"] = check_tensorrt_graph(model)
    del model  # the in-memory graph (its weights included) before the check's sessions load theirs
    forget_matched_graphs()  # the fusion rules' matchers hold it too
    release_freed_memory()
    report["check"] = compare_graphs(exported, optimized)
    return optimized, report


def _interface_after(interface: dict[str, Any], rules: dict[str, int]) -> dict[str, Any]:
    if not rules.get(group_query_attention.NAME):
        return interface
    capacity = ["batch", interface["kv_heads"], "capacity", interface["head_dim"]]
    shaped = lambda entries: [{**e, "shape": capacity} if "{layer}" in e["name"] else e for e in entries]  # noqa: E731
    return {**interface, "inputs": shaped(interface["inputs"]), "outputs": shaped(interface["outputs"]),
            "kv_sharing": "shared-buffer", "row_lengths": "mask"}


def _drop_unused_initializers(model: Any) -> None:
    graph = model.graph
    for name, value in list(graph.initializers.items()):
        if not value.uses() and value not in graph.outputs:
            del graph.initializers[name]


def _op_counts(model: Any) -> Counter:
    return Counter(f"{node.domain}::{node.op_type}" if node.domain else node.op_type for node in model.graph)


def pack(graph: OnnxArtifact, folder: Path) -> tuple[OnnxArtifact, int]:
    """The pack_matmuls rule on a variant's finished graph (after quantize, so that each layer's
    precision is decided first): the packed graph in `folder`, and how many MatMuls it removed."""

    model = load_ir(graph.model_path)  # weights stay on disk until the save copies them over
    removed = PACK_MATMULS.apply(model)
    if not removed:
        return graph, 0
    save_model(model, folder)
    return saved_graph(folder, graph.interface, graph.shapes), removed


# The unfolded graph, kept beside a folded one for onnxruntime-genai (fusions/rotary_in_attention.py).
GENAI_MODEL_FILE = "model_genai.onnx"


def fold_rotary(graph: OnnxArtifact, folder: Path, exact: bool) -> tuple[OnnxArtifact, int | str]:
    """The rotary_in_attention rule on a variant's finished graph (after pack): the folded graph in
    `folder`, checked against the unfolded one, with the unfolded graph moved beside it as
    GENAI_MODEL_FILE over the same weights file; or `graph` unchanged and why not.

    The check runs in Kiln's layout, where the op rotates each token by its own position and the
    numbers must not move, and, for an `exact` graph (fp32 throughout), in the left-padded one too. A
    left-padded row is rotated by slot there, a shift that rotary attention does not see but that
    rounds differently: int8 activations turn that rounding into other logits (0.7 apart on SmolLM2's
    int8, the same top-1 and perplexity), so a quantized graph leaves that layout to its fp32 twin's
    check (tests/compiler/test_optimize.py runs it for every family)."""

    proto = load_structure(graph.model_path)  # the graph alone: no weight moves
    result = ROTARY_IN_ATTENTION.apply(proto)
    count, why = result if isinstance(result, tuple) else (result, "")
    if not count:
        return graph, why
    folder.mkdir(parents=True)
    for name in graph.files[1:]:  # the weights: one file on disk under both folders
        link_or_copy(graph.folder / name, folder / name)
    save_structure(proto, folder / MODEL_FILE)
    del proto
    folded = saved_graph(folder, graph.interface, graph.shapes)
    try:
        compare_graphs(cpu_graph(graph), cpu_graph(folded), left_padded=exact)  # a bf16 graph's fp32 twins
    except ExportMismatch as error:
        shutil.rmtree(folder)
        shutil.rmtree(twin_folder(folded), ignore_errors=True)
        detail = str(error).split(": ", 1)[-1].split(";")[0]  # the numbers, not the unfused-graph advice
        return graph, f"the folded graph disagreed with the unfolded one: {detail}"
    os.replace(graph.model_path, folder / GENAI_MODEL_FILE)
    return dataclasses.replace(folded, files=[*folded.files, GENAI_MODEL_FILE]), count


def kernel_graph(graph: OnnxArtifact, folder: Path, kv_cache: str = "float32",
                 activations: str = "int8") -> tuple[OnnxArtifact | None, int | str]:
    """The graph for Kiln's CPU kernels (runtime/cpu_kernels.py) in `folder`: `graph` with each
    MatMulNBits in blocks of 32 with int8 activations as ai.kiln::MatMulInt8Blocks (8 bits) or
    MatMulInt4Blocks (4 bits), its weights packed into the kernel's layout in KERNEL_DATA_FILE, each
    GroupQueryAttention the kernel takes as ai.kiln::GroupQueryAttention (same inputs and attributes),
    each MatMul by fp32 weights as ai.kiln::MatMulFp32 over the same initializer (a Transpose of one, as a
    tied LM head has, read through the op's transB), and every other weight read from `graph`'s weights
    file; and how many nodes it runs. None and why not where no node qualifies. An fp32 graph gets one
    for its MatMuls, attention and SwiGLUs.

    A 4-bit node that reads its activations' block means beside them (a Q4_1 grid's zero-point
    correction, compiler/quantize.py _encode_int4_grid) becomes one node on the activations alone: the
    correction's two parts become the blocks' offsets, times the exact block sums rather than int8 codes
    of their means, and the AveragePool, Pad and Concat that fed it go where nothing else reads them.
    With activations "bf16" each 4-bit node is ai.kiln::MatMulInt4BlocksBf16 instead (its codes in
    bf16_layout's order), and the graph's interface says so (`activations`). A node
    whose output is only split in halves for a SwiGLU (silu(first) * second: pack_matmuls' gate/up)
    computes that itself (`gated`), bit for bit what the Split, Sigmoid and two Muls it replaces wrote;
    after an fp32 MatMul (an fp32 variant, or a layer the quantizer kept in fp32) those four nodes
    become one ai.kiln::SwiGLU, the same numbers in one pass.

    kv_cache "float16" or "int8" (the recipe's): where every attention is Kiln's and the KV cache is read
    by nothing else (a Shape aside), each is ai.kiln::GroupQueryAttentionFp16Cache or
    GroupQueryAttentionInt8Cache and the graph's past and present are of that type (its interface says
    so); else the cache stays fp32, and the interface's type is how the caller tells.

    The caller measures it against eager as it measures `graph`: the int8 kernels round each activation as MLAS
    does but sum in another order (the bf16 one rounds them to bf16 instead), and int8 activations carry a
    last-bit difference into other roundings a layer later (SmolLM2 int8: top-1 0.985 on MLAS, 0.973 and 0.980
    with two orders of the kernel's sums), so the two graphs agree to int8's accuracy, not to fp32's
    tolerance. The attention and SwiGLU kernels give ONNX Runtime's numbers bit for bit; MatMulFp32 sums in
    blocks of its own, so an fp32 graph's logits are model.onnx's to fp32's rounding."""
    import onnx

    from runtime.cpu_kernels import ATTENTION_OP, DOMAIN, KERNEL_DATA_FILE

    proto = load_structure(graph.model_path)  # the graph alone: no weight moves
    initializers = {i.name: i for i in proto.graph.initializer}
    producers = {output: node for node in proto.graph.node for output in node.output}
    graph_inputs = {i.name for i in proto.graph.input}
    eligible = [(node, made) for node in proto.graph.node
                if (made := _kernel_node(node, initializers, producers)) is not None]
    attentions = [node for node in proto.graph.node if _kernel_attention(node, proto.graph)]
    readers: dict[str, list[Any]] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    # read from outside the node list: by the graph's caller, or inside a subgraph (an If's branches)
    outside = {output.name for output in proto.graph.output} | {
        name for node in proto.graph.node for a in node.attribute
        for subgraph in [a.g] * a.HasField("g") + list(a.graphs) for name in _names_read(subgraph)}
    gated = {node.name: found for node, made in eligible if made.n % 32 == 0  # the kernel's tiles in pairs
             and (found := _swiglu_after(node.output[0], made.n, readers, initializers, outside)) is not None}
    fp32_weighted = [(node, found) for node in proto.graph.node
                     if (found := _fp32_matmul_weights(node, initializers, producers)) is not None]
    swiglus = [found for node, (_, _, n) in fp32_weighted  # ONNX's MatMul or Kiln's: the SwiGLU op reads either
               if (found := _swiglu_after(node.output[0], n, readers, initializers, outside)) is not None]
    fp32_matmuls = [(node, found) for node, found in fp32_weighted
                    if _fp32_matmul_op_takes(initializers[found[0]], graph_inputs)]
    if not eligible and not attentions and not swiglus and not fp32_matmuls:
        return None, ("no MatMulNBits of 8 or 4 bits in blocks of 32 with int8 activations, no "
                      "GroupQueryAttention the kernel takes and no MatMul by fp32 weights in the graph")
    for node in attentions:  # same inputs and attributes
        node.domain, node.op_type = DOMAIN, ATTENTION_OP
    folder.mkdir(parents=True)
    for name in graph.files[1:]:
        if name.endswith(".data"):
            link_or_copy(graph.folder / name, folder / name)
    replaced: set[str] = set()  # initializers that replaced nodes read: dropped where nothing else does
    _swap_swiglus(proto, swiglus, initializers, replaced)
    _swap_fp32_matmuls(proto, fp32_matmuls, producers, outside)
    _swap_block_matmuls(proto, eligible, gated, initializers, graph.folder, folder, activations, replaced)
    _drop_unread(proto, eligible, initializers, replaced)
    proto.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    interface = _kernel_graph_interface(proto, graph.interface, eligible, attentions, kv_cache, activations)
    save_structure(proto, folder / MODEL_FILE)
    built = saved_graph(folder, interface, graph.shapes)
    return dataclasses.replace(built, files=[*built.files, *[KERNEL_DATA_FILE] * bool(eligible)]), \
        len(eligible) + len(attentions) + len(swiglus) + len(fp32_matmuls)


def _swap_swiglus(proto: Any, swiglus: list, initializers: dict[str, Any], replaced: set[str]) -> None:
    """Each SwiGLU after an fp32 MatMul: its Split, Sigmoid and Mul go, the last Mul becomes the op where it
    stands in the order."""
    from runtime.cpu_kernels import DOMAIN, SWIGLU_OP

    for _, (split, sigmoid, silu, product) in swiglus:
        for gone in (split, sigmoid, silu):
            replaced.update(name for name in gone.input if name in initializers)  # the Split's sizes
            proto.graph.node.remove(gone)
        product.domain, product.op_type = DOMAIN, SWIGLU_OP
        product.input[:] = [split.input[0]]
        del product.attribute[:]


def _swap_fp32_matmuls(proto: Any, fp32_matmuls: list, producers: dict[str, Any], outside: set[str]) -> None:
    """Each MatMul by fp32 weights as MatMulFp32 over the same initializer, or over the initializer a
    Transpose fed it (transB); a Transpose nothing else reads goes."""
    import onnx

    from runtime.cpu_kernels import DOMAIN, FP32_MATMUL_OP

    transposes = [producers[node.input[1]] for node, (_, transposed, _) in fp32_matmuls if transposed]
    for node, (weights, transposed, _) in fp32_matmuls:
        node.domain, node.op_type = DOMAIN, FP32_MATMUL_OP
        if transposed:
            node.input[1] = weights
            node.attribute.append(onnx.helper.make_attribute("transB", 1))
    read = _names_read(proto.graph) | outside
    for transpose in {id(t): t for t in transposes}.values():  # one Transpose may feed several
        if transpose.output[0] not in read:
            proto.graph.node.remove(transpose)


def _swap_block_matmuls(proto: Any, eligible: list, gated: dict[str, Any], initializers: dict[str, Any],
                        source: Path, folder: Path, activations: str, replaced: set[str]) -> None:
    """Each MatMulNBits in blocks of 32 as Kiln's 8- or 4-bit op, its weights packed into KERNEL_DATA_FILE
    (page-aligned, so ONNX Runtime can map them in place); a gated one computes its SwiGLU itself."""
    import onnx

    from runtime import cpu_kernels
    from runtime.cpu_kernels import DOMAIN, KERNEL_DATA_FILE

    with open(folder / KERNEL_DATA_FILE, "wb") if eligible else contextlib.nullcontext() as data:
        for number, (node, made) in enumerate(eligible):
            weights = [initializer_array(initializers[name], source) if name else None
                       for name in [*node.input[1:4], ""][:3]]
            if node.name in gated:  # tiles alternate gate and up
                half = made.n // 2
                order = np.arange(half).reshape(-1, 16)
                columns = np.concatenate([order, order + half], axis=1).reshape(-1)
                weights = [None if w is None else w.reshape(made.n, -1)[columns].reshape(w.shape) for w in weights]
            packed = made.pack(*weights)
            bf16 = made.bits == 4 and activations == "bf16"
            if bf16:
                packed = cpu_kernels.bf16_layout(packed, made.k)
            tensor = append_external(data, KERNEL_DATA_FILE, f"int{made.bits}_blocks.{number}.{node.name}", packed)
            proto.graph.initializer.append(tensor)
            replaced.update(name for name in node.input[1:4] if name)
            node.domain, node.op_type = DOMAIN, cpu_kernels.INT4_BF16_OP if bf16 else made.op
            node.input[:] = [made.activation, tensor.name]
            del node.attribute[:]
            node.attribute.extend([onnx.helper.make_attribute("K", made.k), onnx.helper.make_attribute("N", made.n)])
            if node.name in gated:
                output, replaced_nodes = gated[node.name]
                node.output[0] = output
                node.attribute.append(onnx.helper.make_attribute("gated", 1))
                for gone in replaced_nodes:
                    replaced.update(name for name in gone.input if name in initializers)  # the Split's sizes
                    proto.graph.node.remove(gone)


def _drop_unread(proto: Any, eligible: list, initializers: dict[str, Any], replaced: set[str]) -> None:
    """The block means' nodes that no node reads any more (the Concat first), then the initializers that only
    replaced nodes read."""
    bypassed = {name for _, made in eligible for name in made.bypassed}
    while True:
        read = _names_read(proto.graph) | {output.name for output in proto.graph.output}
        dead = [n for n in proto.graph.node if n.name in bypassed and not read & set(n.output)]
        if not dead:
            break
        for node in dead:
            replaced.update(name for name in node.input if name in initializers)  # a Pad's pads
            proto.graph.node.remove(node)
    used = _names_read(proto.graph) | {output.name for output in proto.graph.output}
    kept = [i for i in proto.graph.initializer if i.name in used or i.name not in replaced]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)


def _kernel_graph_interface(proto: Any, interface: dict[str, Any], eligible: list, attentions: list,
                            kv_cache: str, activations: str) -> dict[str, Any]:
    """The variant's interface, with what the kernels' graph changes: bf16 activations, prompts of
    different lengths prefilled in one step where every attention is Kiln's (and no fp32 MoE node is
    there), an fp16 KV cache."""
    from runtime import cpu_kernels

    if activations == "bf16" and any(made.bits == 4 for _, made in eligible):
        interface = {**interface, "activations": cpu_kernels.BF16_ACTIVATIONS}
    if attentions and not any(n.op_type == "GroupQueryAttention" and n.domain != cpu_kernels.DOMAIN
                              for n in proto.graph.node):
        # Every attention is Kiln's: each row of a right-padded first prompt gets its numbers alone
        # (runtime/kernels/attention.c), so the backend prefills prompts of different lengths in one step.
        # Not where ONNX Runtime's fp32 MoE op is: it runs each expert's tokens as one MLAS SGEMM, whose
        # one-row case (M == 1: MlasSgemmKernelM1TransposeBAvx) sums in another order, so a token that is
        # its expert's only one gets other numbers than beside tokens routed alike: the tiny OLMoE's
        # padded prefill gave 4 of 6 rows logits up to 9e-8 off theirs alone. Its rows then prefill one
        # by one. (QMoE's CPU kernel, int8 activations, gave each token its numbers alone, in twos and
        # among 40.)
        if not any(n.op_type == "MoE" and n.domain == "com.microsoft" for n in proto.graph.node):
            interface = {**interface, "prefill": "batched"}
        if kv_cache != "float32" and _compact_cache(proto, attentions, kv_cache):
            interface = retyped_kv(interface, kv_cache)
    return interface


def _compact_cache(proto: Any, attentions: list[Any], kv_cache: str) -> bool:
    """Each of Kiln's attentions as its op over a `kv_cache` ("float16", "int8") cache, and its past and
    present (the graph's inputs and outputs) of that type, an int8 one a quarter wider a slot (its scales:
    runtime/kernels/attention.c); False, the graph unchanged, where a cache is not the graph's own input or
    output or another node reads it (a Shape aside: it reads no numbers, though of an int8 cache not the
    last dimension, which is not the head size there)."""
    import onnx

    from runtime.cpu_kernels import ATTENTION_FP16_CACHE_OP, ATTENTION_INT8_CACHE_OP
    from runtime.manifest import int8_kv_width

    element, op = {"float16": (onnx.TensorProto.FLOAT16, ATTENTION_FP16_CACHE_OP),
                   "int8": (onnx.TensorProto.INT8, ATTENTION_INT8_CACHE_OP)}[kv_cache]
    caches = {name for node in attentions for name in [*node.input[3:5], *node.output[1:3]] if name}
    ends = {value.name: value for value in [*proto.graph.input, *proto.graph.output]}
    ours = {id(node) for node in attentions}

    def reads_numbers(node: Any) -> bool:
        if node.op_type != "Shape" or node.domain:
            return True
        attributes = {a.name: a.i for a in node.attribute}
        end = attributes.get("end", 4)
        return kv_cache == "int8" and (end if end >= 0 else end + 4) > 3  # its last dimension: codes and scales

    if not caches <= set(ends) or any(id(node) not in ours and caches & set(node.input) and reads_numbers(node)
                                      for node in proto.graph.node):
        return False
    for name in caches:
        tensor_type = ends[name].type.tensor_type
        tensor_type.elem_type = element
        if kv_cache == "int8" and tensor_type.shape.dim[3].HasField("dim_value"):
            tensor_type.shape.dim[3].dim_value = int8_kv_width(tensor_type.shape.dim[3].dim_value)
    for value in [v for v in proto.graph.value_info if v.name in caches]:
        proto.graph.value_info.remove(value)
    for node in attentions:
        node.op_type = op
    return True


@dataclasses.dataclass(frozen=True)
class KernelNode:
    """What one MatMulNBits becomes in the kernels' graph."""
    op: str
    bits: int
    activation: str  # the input it reads
    k: int
    n: int
    pack: Any  # (codes, scales, zero points) as MatMulNBits holds them -> the kernel's packed bytes
    bypassed: tuple[str, ...] = ()  # nodes that fed it block means, removed where nothing else reads them


def _kernel_node(node: Any, initializers: dict[str, Any], producers: dict[str, Any]) -> KernelNode | None:
    """The kernel op for a MatMulNBits that one runs: 8 or 4 bits in blocks of 32, int8 activations
    (accuracy_level 4), weights in initializers, no g_idx or bias; else None."""
    import onnx

    from runtime.cpu_kernels import INT4_BLOCKS_OP, INT8_BLOCKS_OP, pack_int8_blocks

    if (node.domain, node.op_type) != ("com.microsoft", "MatMulNBits"):
        return None
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits = attributes["K"], attributes["N"], attributes.get("bits")
    if (attributes.get("block_size") != 32 or attributes.get("accuracy_level") != 4 or any(node.input[4:])
            or not all(name in initializers for name in node.input[1:4] if name)):
        return None
    if bits == 8 and k % 32 == 0:
        return KernelNode(INT8_BLOCKS_OP, 8, node.input[0], k, n, pack_int8_blocks)
    if bits != 4:
        return None
    plain = KernelNode(INT4_BLOCKS_OP, 4, node.input[0], k, n,
                       lambda codes, scales, zero_points: _pack_int4(codes, scales, zero_points, k, n, 0)) \
        if k % 32 == 0 else None
    joined = producers.get(node.input[0])
    joined_axis = {a.name: a.i for a in joined.attribute}.get("axis") if joined is not None else None
    padded = producers.get(joined.input[1]) if joined is not None and joined.op_type == "Concat" \
        and len(joined.input) == 3 and joined.input[1] == joined.input[2] and joined_axis in (-1, 2) \
        else None  # activations are [batch, seq, K]
    pooled = producers.get(padded.input[0]) if padded is not None and padded.op_type == "Pad" else None
    if pooled is None or pooled.op_type != "AveragePool" or pooled.input[0] != joined.input[0]:
        return plain
    pool = {a.name: onnx.helper.get_attribute_value(a) for a in pooled.attribute}
    parts = next((e for e in range(1, k // 64 + 1) if -(-(k - 64 * e) // 1024) == e), 0)  # blocks of means, each part
    width = k - 64 * parts
    pads = initializers.get(padded.input[1]) if len(padded.input) == 2 else None
    if (not parts or width % 32 or pool.get("kernel_shape") != [32] or pool.get("strides") != [32]
            or any(pool.get("pads", [])) or pads is None
            or onnx.numpy_helper.to_array(pads).tolist() != [0, 0, 0, 0, 0, 32 * parts - width // 32]):
        return plain
    return KernelNode(INT4_BLOCKS_OP, 4, joined.input[0], width, n,
                      lambda codes, scales, zero_points: _pack_int4(codes, scales, zero_points, k, n, width),
                      (joined.name, padded.name, pooled.name))


def _kernel_attention(node: Any, graph: Any) -> bool:
    """Whether ai.kiln::GroupQueryAttention (runtime/kernels/attention.c) computes what this node does:
    past buffers given, no position ids or later inputs or outputs, no softcap, local window or other
    variation, at most 64 query heads a kv head, fp32 heads of a multiple of 16 up to 256 (read from the
    past buffers' declared shapes). The op refuses the others when the session loads, which would cost
    the variant its whole kernels' graph."""
    import onnx

    if (node.domain, node.op_type) != ("com.microsoft", "GroupQueryAttention"):
        return False
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    defaults = {"softcap": 0.0, "local_window_size": -1, "do_rotary": 0, "rotary_interleaved": 0, "scale": 0.0}
    if (set(attributes) - set(defaults) - {"num_heads", "kv_num_heads"}
            or attributes.get("softcap", 0.0) != 0.0 or attributes.get("local_window_size", -1) != -1
            or attributes.get("do_rotary", 0) not in (0, 1) or attributes.get("rotary_interleaved", 0) not in (0, 1)):
        return False
    heads, kv_heads = attributes.get("num_heads", 0), attributes.get("kv_num_heads", 0)
    if not (0 < kv_heads and heads % kv_heads == 0 and 0 < heads // kv_heads <= 64):  # the op's limit
        return False
    inputs = list(node.input) + [""] * (11 - len(node.input))
    if len(node.input) > 11 or inputs[9] or not (inputs[3] and inputs[4]) or len(node.output) > 3:
        return False
    declared = {v.name: v.type.tensor_type for v in [*graph.input, *graph.value_info, *graph.output]}
    pasts = [declared.get(name) for name in inputs[3:5]]
    if any(p is None or p.elem_type != onnx.TensorProto.FLOAT or len(p.shape.dim) != 4 for p in pasts):
        return False
    head_size = pasts[0].shape.dim[3].dim_value
    return 0 < head_size <= 256 and head_size % 16 == 0 and pasts[1].shape.dim[3].dim_value == head_size


def _fp32_matmul_weights(node: Any, initializers: dict[str, Any],
                         producers: dict[str, Any]) -> tuple[str, bool, int] | None:
    """For an ONNX MatMul by fp32 weights: the initializer holding them, whether the graph transposes it
    first ([K, N] read as it is, or [N, K] through a Transpose: a tied LM head reads the embeddings so),
    and N. Else None."""
    import onnx

    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    name, transposed = node.input[1], False
    transpose = producers.get(name)
    if name not in initializers and transpose is not None and transpose.op_type == "Transpose" \
            and transpose.domain in ("", "ai.onnx"):
        perm = next((list(onnx.helper.get_attribute_value(a)) for a in transpose.attribute if a.name == "perm"), [1, 0])
        name, transposed = transpose.input[0], perm == [1, 0]
        if not transposed:
            return None
    weights = initializers.get(name)
    if weights is None or weights.data_type != onnx.TensorProto.FLOAT or len(weights.dims) != 2:
        return None
    return name, transposed, weights.dims[0 if transposed else 1]


def _fp32_matmul_op_takes(weights: Any, graph_inputs: set[str]) -> bool:
    """Whether MatMulFp32 loads these weights: it refuses sizes past 2^24, and an initializer that is also a
    graph input (the caller may feed another value at run time)."""
    return all(1 <= size <= 2**24 for size in weights.dims) and weights.name not in graph_inputs


def _swiglu_after(output: str, n: int, readers: dict[str, list[Any]], initializers: dict[str, Any],
                  outside: set[str]) -> tuple[str, list[Any]] | None:
    """Where `output` (n columns) is read only by a Split into two equal halves on its last axis, the
    first read only by Sigmoid and Mul (SiLU) and both only by one Mul of the SiLU and the second: that
    Mul's output and the four nodes (Split, Sigmoid, SiLU's Mul, the product's Mul). Else None."""
    import onnx
    from onnx import numpy_helper

    def only(name: str, count: int = 1) -> list[Any] | None:
        found = readers.get(name, [])
        return found if len(found) == count and name not in outside else None

    split = only(output)
    if split is None or split[0].op_type != "Split" or len(split[0].output) != 2:
        return None
    split = split[0]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in split.attribute}
    sizes = (numpy_helper.to_array(initializers[split.input[1]]).tolist()
             if len(split.input) > 1 and split.input[1] in initializers else attributes.get("split"))
    if attributes.get("axis", 0) not in (-1, 2) or n % 2 or (sizes is not None and list(sizes) != [n // 2] * 2):
        return None
    gate, up = split.output
    gate_readers = only(gate, 2)
    if gate_readers is None:
        return None
    sigmoid = next((r for r in gate_readers if r.op_type == "Sigmoid"), None)
    silu = next((r for r in gate_readers if r.op_type == "Mul"), None)
    if sigmoid is None or silu is None or only(sigmoid.output[0]) != [silu] \
            or sorted(silu.input) != sorted([gate, sigmoid.output[0]]):
        return None
    product = only(silu.output[0])
    if product is None or product[0].op_type != "Mul" or only(up) != product \
            or sorted(product[0].input) != sorted([silu.output[0], up]):
        return None
    return product[0].output[0], [split, sigmoid, silu, product[0]]


def _pack_int4(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
               width: int) -> np.ndarray:
    """A 4-bit MatMulNBits' weights in MatMulInt4Blocks' layout. With `width`, the node reads [x, x's
    block means, the same means] (each part of means padded to whole blocks): the rows past `width` hold
    each block's correction c in two parts, which the block's mean multiplies, so the block's offset is
    their sum / 32; else the offsets are 0."""
    from runtime.cpu_kernels import pack_int4_blocks

    blocks = -(-k // 32)
    nibbles = codes.reshape(n, blocks, 16)
    unpacked = np.stack([nibbles & 0x0F, nibbles >> 4], -1).reshape(n, blocks * 32)
    d = scales.reshape(n, blocks).astype(np.float32)
    if zero_points is None:
        zero = np.full((n, blocks), 8, np.uint8)
    else:
        pairs = zero_points.reshape(n, -1)
        zero = np.stack([pairs & 0x0F, pairs >> 4], -1).reshape(n, -1)[:, :blocks]
    kept = width // 32 if width else blocks
    offsets = np.zeros((n, kept), np.float64)
    if width:
        part = (k - width) // 2  # correction rows width + b and width + part + b multiply block b's mean
        for first in (width, width + part):
            rows = np.arange(first, first + kept)
            offsets += d[:, rows // 32] * (unpacked[:, rows].astype(np.float64) - zero[:, rows // 32]) / 32
    return pack_int4_blocks(unpacked[:, :kept * 32].reshape(n, kept, 32), d[:, :kept], zero[:, :kept], offsets)


def _names_read(graph: Any) -> set[str]:
    """Every value name a node of `graph` or of any subgraph in it reads."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            for subgraph in [attribute.g] * attribute.HasField("g") + list(attribute.graphs):
                names |= _names_read(subgraph)
    return names


# -- the numerical check: the runtime's backend on both graphs ------------------------------------

CHECK_PADS = (0, 3, 6)  # left padding per row
CHECK_PROMPT, CHECK_STEPS = 9, 4


def compare_graphs(reference: OnnxArtifact, candidate: OnnxArtifact, seed: int = 0,
                   left_padded: bool = True) -> dict[str, Any]:
    """Greedy decode of the reference graph, replayed on the candidate; raise if logits part ways. One
    ONNX Runtime session at a time: a session holds the weights (and ONNX Runtime's pre-packed copy).
    `left_padded=False` checks Kiln's layout only, where the candidate reads the graph's rows from slot 0."""
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    steps = _greedy_steps(reference, seed)
    release_freed_memory()
    backend = OnnxRuntimeBackend(candidate.model_path, candidate.interface)
    errors, agree = [], []
    # A graph that reads row lengths from the mask runs in Kiln's layout (rows from slot 0) and in
    # the left-padded one other tools feed it: both are checked.
    for front_aligned in sorted({backend.front_aligned} | ({False} if left_padded else set()), reverse=True):
        backend.front_aligned = front_aligned
        cache = backend.new_cache(len(CHECK_PADS), CHECK_PROMPT + CHECK_STEPS)
        for ids, mask, positions, ref in steps:
            out, cache = backend.run(ids, mask, positions, cache)
            real = mask[:, -ref.shape[1]:].astype(bool)
            errors.append((float(np.abs(out - ref)[real].max()), float(np.abs(ref[real]).max())))
            agree.append((out.argmax(-1) == ref.argmax(-1))[real])
    backend.close()
    del cache
    release_freed_memory()  # a closed session's memory goes back to the C heap, and stays there untrimmed
    worst_abs = max(e for e, _ in errors)
    relative = max(e / max(scale, 1e-12) for e, scale in errors)
    result = {"max_abs_logit_error": worst_abs, "max_rel_logit_error": relative,
              "top1_agreement": float(np.concatenate(agree).mean()), "tolerance_relative": RELATIVE_TOLERANCE,
              "steps": len(errors)}
    if not relative <= RELATIVE_TOLERANCE:
        raise ExportMismatch(
            f"the optimized graph disagrees with the unfused one beyond the fp32 tolerance {RELATIVE_TOLERANCE:g}: "
            f"max |logit error| {worst_abs:.3g} (relative {relative:.3g}); rebuild with fuse: false and report it"
        )
    return result


def _greedy_steps(reference: OnnxArtifact, seed: int) -> list[tuple]:
    """(input_ids, attention_mask, position_ids, logits) of each step of the reference graph's greedy
    decode of a left-padded batch: prefill, then CHECK_STEPS decode steps."""
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(reference.model_path, reference.interface)
    rng = np.random.default_rng(seed)
    batch = len(CHECK_PADS)
    ids = rng.integers(0, reference.shapes.vocab_size, (batch, CHECK_PROMPT))
    mask = np.ones((batch, CHECK_PROMPT), np.int64)
    for row, pad in enumerate(CHECK_PADS):
        mask[row, :pad] = 0
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    cache = backend.new_cache(batch, CHECK_PROMPT + CHECK_STEPS)
    steps = []
    for _ in range(CHECK_STEPS + 1):
        ref, cache = backend.run(ids, mask, positions, cache)
        steps.append((ids, mask, positions, ref))
        ids = ref[:, -1].argmax(-1)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        positions = mask.sum(-1, keepdims=True) - 1
    backend.close()
    return steps
