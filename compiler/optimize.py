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

import dataclasses
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from runtime.files import link_or_copy

from .errors import ExportMismatch
from .export import (
    MODEL_FILE,
    OnnxArtifact,
    forget_matched_graphs,
    save_model,
    saved_graph,
    small_constants_kept,
)
from .fusions import ONNXRUNTIME_RULES, group_query_attention, pack_matmuls, rotary_in_attention
from .progress import release_freed_memory
from .tensorrt_check import check_tensorrt_graph
from .validate_export import RELATIVE_TOLERANCE


def optimize(exported: OnnxArtifact, target: str, fuse: bool, folder: Path) -> tuple[OnnxArtifact, dict[str, Any]]:
    import onnx_ir as ir
    from onnxscript import optimizer

    model = ir.load(str(exported.model_path))
    nodes_before = len(model.graph)
    with small_constants_kept():
        optimizer.optimize(model)
    rules, unmatched = {}, {}
    if target == "onnxruntime" and fuse:
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
    if target == "tensorrt":
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
    import onnx_ir as ir

    model = ir.load(str(graph.model_path))  # weights stay on disk until the save copies them over
    removed = pack_matmuls.apply(model)
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
    import onnx

    proto = onnx.load(str(graph.model_path), load_external_data=False)  # the graph alone: no weight moves
    result = rotary_in_attention.apply(proto)
    count, why = result if isinstance(result, tuple) else (result, "")
    if not count:
        return graph, why
    folder.mkdir(parents=True)
    for name in graph.files[1:]:  # the weights: one file on disk under both folders
        link_or_copy(graph.folder / name, folder / name)
    onnx.save(proto, str(folder / MODEL_FILE))
    del proto
    folded = saved_graph(folder, graph.interface, graph.shapes)
    try:
        compare_graphs(graph, folded, left_padded=exact)
    except ExportMismatch as error:
        shutil.rmtree(folder)
        detail = str(error).split(": ", 1)[-1].split(";")[0]  # the numbers, not the unfused-graph advice
        return graph, f"the folded graph disagreed with the unfolded one: {detail}"
    os.replace(graph.model_path, folder / GENAI_MODEL_FILE)
    return dataclasses.replace(folded, files=[*folded.files, GENAI_MODEL_FILE]), count


def kernel_graph(graph: OnnxArtifact, folder: Path) -> tuple[OnnxArtifact | None, int | str]:
    """The graph for Kiln's CPU kernels (runtime/cpu_kernels.py) in `folder`: `graph` with each 8-bit
    MatMulNBits in blocks of 32 with int8 activations as ai.kiln::MatMulInt8Blocks, its weights packed
    into the kernel's layout in KERNEL_DATA_FILE and every other weight read from `graph`'s weights
    file; and how many nodes it runs. None and why not where no node qualifies.

    The caller measures it against eager as it measures `graph`: the kernel rounds each activation as
    MLAS does but sums in another order, and int8 activations carry a last-bit difference into other
    roundings a layer later (SmolLM2 int8: top-1 0.985 on MLAS, 0.973 and 0.980 with two orders of
    the kernel's sums), so the two graphs agree to int8's accuracy, not to fp32's tolerance."""
    import onnx

    from runtime.cpu_kernels import DOMAIN, INT8_BLOCKS_OP, KERNEL_DATA_FILE, pack_int8_blocks

    proto = onnx.load(str(graph.model_path), load_external_data=False)  # the graph alone: no weight moves
    initializers = {i.name: i for i in proto.graph.initializer}
    eligible = []
    for node in proto.graph.node:
        if (node.domain, node.op_type) != ("com.microsoft", "MatMulNBits"):
            continue
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if (attributes.get("bits") == 8 and attributes.get("block_size") == 32
                and attributes.get("accuracy_level") == 4 and attributes["K"] % 32 == 0
                and all(name in initializers for name in node.input[1:4] if name)
                and not any(node.input[4:])):  # no g_idx, no bias
            eligible.append((node, attributes["K"], attributes["N"]))
    if not eligible:
        return None, "no 8-bit MatMulNBits in blocks of 32 with int8 activations in the graph"
    folder.mkdir(parents=True)
    for name in graph.files[1:]:
        if name.endswith(".data"):
            link_or_copy(graph.folder / name, folder / name)
    replaced = set()
    with open(folder / KERNEL_DATA_FILE, "wb") as data:
        for number, (node, k, n) in enumerate(eligible):
            weights = [_initializer_array(initializers[name], graph.folder) if name else None
                       for name in [*node.input[1:4], ""][:3]]
            packed = pack_int8_blocks(*weights)
            data.write(b"\0" * (-data.tell() % 4096))  # page-aligned: ONNX Runtime can map it in place
            tensor = onnx.TensorProto(name=f"int8_blocks.{number}.{node.name}", data_type=onnx.TensorProto.UINT8,
                                      dims=[packed.size], data_location=onnx.TensorProto.EXTERNAL)
            for key, value in (("location", KERNEL_DATA_FILE), ("offset", data.tell()), ("length", packed.size)):
                tensor.external_data.add(key=key, value=str(value))
            data.write(packed.tobytes())
            proto.graph.initializer.append(tensor)
            replaced.update(name for name in node.input[1:4] if name)
            node.domain, node.op_type = DOMAIN, INT8_BLOCKS_OP
            node.input[:] = [node.input[0], tensor.name]
            del node.attribute[:]
            node.attribute.extend([onnx.helper.make_attribute("K", k), onnx.helper.make_attribute("N", n)])
    used = _names_read(proto.graph) | {output.name for output in proto.graph.output}
    kept = [i for i in proto.graph.initializer if i.name in used or i.name not in replaced]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    proto.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    onnx.save(proto, str(folder / MODEL_FILE))
    built = saved_graph(folder, graph.interface, graph.shapes)
    return dataclasses.replace(built, files=[*built.files, KERNEL_DATA_FILE]), len(eligible)


def _names_read(graph: Any) -> set[str]:
    """Every value name a node of `graph` or of any subgraph in it reads."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            for subgraph in [attribute.g] * attribute.HasField("g") + list(attribute.graphs):
                names |= _names_read(subgraph)
    return names


def _initializer_array(tensor: Any, folder: Path) -> np.ndarray:
    """An initializer's values, read from its external file where it has one (onnx's own reader refuses
    the hard links that let a variant's graphs share one weights file)."""
    import onnx
    from onnx import numpy_helper

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    where = {entry.key: entry.value for entry in tensor.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    offset = int(where.get("offset", 0))
    return np.fromfile(folder / where["location"], dtype, int(np.prod(tensor.dims)), offset=offset).reshape(tensor.dims)


# -- the numerical check: the runtime's backend on both graphs ------------------------------------

CHECK_PADS = (0, 3, 6)  # left padding per row
CHECK_PROMPT, CHECK_STEPS = 9, 4


def compare_graphs(reference: OnnxArtifact, candidate: OnnxArtifact, seed: int = 0,
                   left_padded: bool = True) -> dict[str, Any]:
    """Greedy decode of the reference graph, replayed on the candidate; raise if logits part ways. One
    ONNX Runtime session at a time: a session holds the weights (and ONNX Runtime's pre-packed copy).
    `left_padded=False` checks Kiln's layout only, where the candidate reads the graph's rows from slot 0."""
    from runtime.backend import OnnxRuntimeBackend

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
    from runtime.backend import OnnxRuntimeBackend

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
