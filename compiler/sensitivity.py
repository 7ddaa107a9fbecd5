"""`quantize.exclude: auto`: which modules a quantized variant keeps in fp32, and where its accuracy goes.

Two steps, both measured under ONNX Runtime on the graphs that would ship, and both skipped when the
variant with every group quantized meets its gates (the pipeline builds and measures that first: one
build, where the ranking costs one per group):

1. Sensitivity (`layer_sensitivity`): each module group (a decoder layer's attention projections, its
   MLP projections, the LM head) quantized alone, every other weight left in fp32; the KL divergence of
   its next-token distributions from the fp32 graph's, teacher-forced over the calibration prompts.
   This is the per-layer table a user reads to see where accuracy goes; it reads the calibration set,
   not the held-out text the gates judge.
2. Search (`lightest_kept`): the groups kept (in fp32, or in finer blocks with `exclude_block_size`)
   start as a prefix of that ranking, most sensitive first: the shortest prefix whose variant meets
   the gates, found by doubling, then bisection (`fewest_kept`). Then each kept group, heaviest first,
   is dropped if the variant still meets the gates without it. Weights are what a decode step reads, so
   what stays in fp32 is its speed, and KL is not what the gates measure: SmolLM2's LM head holds a
   fifth of its weights (as many as ten MLPs) and ranks 4th by KL, yet with its top logits recomputed
   in fp32 (`exact_top_logits`) its argmax hardly moves, so top-1 does not need it. Ranking by KL per
   weight instead was measured and was worse there (34 groups, 364 MiB resident against 299). The
   prefix takes passing to be monotone in its length, which holds when the groups' errors roughly add
   up; every attempt is recorded, so a case where it does not shows in the report. The attempts are
   gated on the gates' own held-out text and prompts, so for an `exclude: auto` variant those are the
   search's stopping rule as well as its measurement, no longer an independent estimate.

Every quantized variant also gets a layerwise comparison (`residual_errors`, Polygraphy's per-tensor
comparison of two runners, on the points that matter): the residual stream after each attention and
MLP block, quantized graph against fp32 graph on the calibration prompts, and how much each block adds
to its error, then the logits and what the LM head adds to theirs. It costs two prefills, not a build
per group, so it is there when everything quantized passes too, and the residual stream is what
smoothing leaves unchanged (a norm's or up_proj's output is not).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .accuracy import kl_divergence, teacher_forced
from .bf16 import cpu_graph
from .graph import OnnxArtifact, load_structure
from .progress import release_freed_memory
from .recipe import Variant

SENSITIVITY_ROW_TOKENS = 64  # the calibration prompts, joined and cut into teacher-forced rows this long
LAYERWISE_ROWS = 8  # of those rows, compared layer by layer (512 tokens: 72 MB of SmolLM2's residual stream)
SKIP_NORMS = ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")


def module_groups(paths: Sequence[str]) -> dict[str, list[str]]:
    """{group: its weight MatMuls' module paths}: a path's parent module (`model.layers.3.mlp` for
    `model.layers.3.mlp.down_proj`), or the path itself at the top level (`lm_head`); in graph order."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        groups.setdefault(path.rsplit(".", 1)[0] if "." in path else path, []).append(path)
    return groups


def weight_groups(source: OnnxArtifact) -> dict[str, dict[str, int]]:
    """{group: {module path: its weights' element count}} (module_groups) of the weight MatMuls the
    quantizer sees: a tied LM head's too, which reads the embedding through a Transpose until the
    quantizer unties it. Only the tied weight is read."""

    from .quantize import untie_transposed_weights, weight_matmuls

    proto = load_structure(source.model_path)
    untie_transposed_weights(proto, str(source.folder))
    elements = {i.name: math.prod(i.dims) for i in proto.graph.initializer}
    weights = {n.name: n.input[1] for n in proto.graph.node if len(n.input) > 1}
    matmuls = weight_matmuls(proto)
    per_path: dict[str, int] = {}
    for node, path in matmuls.items():
        per_path[path] = per_path.get(path, 0) + elements[weights[node]]
    return {group: {path: per_path[path] for path in dict.fromkeys(paths)}
            for group, paths in module_groups(list(matmuls.values())).items()}


def with_exclude(variant: Variant, paths: Sequence[str]) -> Variant:
    """The variant with these module paths kept in fp32 (exact paths are their own globs)."""
    assert variant.quantize is not None
    return variant.model_copy(update={"quantize": variant.quantize.model_copy(update={"exclude": list(paths)})})


def calibration_rows(calibration: Sequence[list[int]]) -> list[list[int]]:
    """The calibration prompts joined and cut into rows of SENSITIVITY_ROW_TOKENS; each row at least
    two tokens long, so that it predicts something."""
    stream = [t for ids in calibration for t in ids]
    return [stream[i:i + SENSITIVITY_ROW_TOKENS] for i in range(0, len(stream) - 1, SENSITIVITY_ROW_TOKENS)]


def layer_sensitivity(source: OnnxArtifact, variant: Variant, groups: dict[str, dict[str, int]],
                      calibration: Sequence[list[int]], pad_id: int, folder: Path,
                      on_group: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """One record per module group (weight_groups), most sensitive first: {group, modules, weight_elements,
    kl_divergence (mean), kl_divergence_max, top1_agreement} of the variant with only that group
    quantized, against `source`."""
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    from .quantize import quantize

    paths = [p for members in groups.values() for p in members]
    rows = calibration_rows(calibration)
    # Both sides' logits go to files as they come (0.25 GiB each over SmolLM2's calibration prompts)
    # and are compared a row at a time.
    logits_folder = folder.with_name(folder.name + "-logits")
    fp32 = OnnxRuntimeBackend(source.model_path, source.interface)
    reference = teacher_forced(fp32, rows, pad_id, into=logits_folder / "reference.bin")
    fp32.close()
    records = []
    # The rest in fp32 even where exclude_block_size would keep them in finer blocks: one group's weights
    # quantized per build, not every weight.
    coarse_only = variant.quantize.model_copy(update={"exclude_block_size": None})
    fp32_rest = variant.model_copy(update={"quantize": coarse_only})
    for group, members in groups.items():
        alone = with_exclude(fp32_rest, [p for p in paths if p not in members])
        graph, _ = quantize(source, alone, calibration, folder)
        runnable = cpu_graph(graph)  # a bf16 graph's fp32 twin (compiler/bf16.py)
        backend = OnnxRuntimeBackend(runnable.model_path, runnable.interface)
        logits = teacher_forced(backend, rows, pad_id, into=logits_folder / "group.bin")
        backend.close()
        shutil.rmtree(folder)
        shutil.rmtree(runnable.folder, ignore_errors=True)
        release_freed_memory()  # this group's graph and session, before the next group's
        kl_rows, agree_rows = [], []
        for r, c in zip(reference, logits, strict=True):  # each row read from disk once
            kl_rows.append(kl_divergence(r, c))
            agree_rows.append(r.argmax(-1) == c.argmax(-1))
        kl, agree = np.concatenate(kl_rows), np.concatenate(agree_rows)
        records.append({"group": group, "modules": list(members), "weight_elements": sum(members.values()),
                        "kl_divergence": float(kl.mean()),
                        "kl_divergence_max": float(kl.max()), "top1_agreement": float(agree.mean())})
        if on_group:
            on_group()
    shutil.rmtree(logits_folder)
    return sorted(records, key=lambda r: -r["kl_divergence"])


def fewest_kept(ranking: Sequence[dict[str, Any]], attempt: Callable[[int], bool]) -> int | None:
    """The fewest leading groups of `ranking` that `attempt(count)` (keep that many in fp32, build,
    measure, gate) passes with; None if even all of them do not. Attempts 0, 1, 2, 4, ... then bisects."""
    tried: dict[int, bool] = {}

    def passes(count: int) -> bool:
        if count not in tried:
            tried[count] = attempt(count)
        return tried[count]

    if passes(0):
        return 0
    low, high = 0, 1
    while not passes(high):
        if high == len(ranking):
            return None
        low, high = high, min(2 * high, len(ranking))
    while high - low > 1:  # low fails, high passes
        middle = (low + high) // 2
        low, high = (middle, high) if not passes(middle) else (low, middle)
    return high


def weight_elements(groups: Sequence[dict[str, Any]]) -> int:
    return sum(r["weight_elements"] for r in groups)


def lightest_kept(ranking: Sequence[dict[str, Any]],
                  attempt: Callable[[Sequence[dict[str, Any]]], bool]) -> list[dict[str, Any]] | None:
    """The groups of `ranking` (most sensitive first) to keep in fp32, where `attempt(groups)` keeps those
    in fp32, builds, measures and gates: the shortest passing prefix, less each of its groups, heaviest
    first, that it passes without; None if even all of them do not pass. A set is attempted once."""
    tried: dict[frozenset[str], bool] = {}

    def passes(groups: Sequence[dict[str, Any]]) -> bool:
        key = frozenset(r["group"] for r in groups)
        if key not in tried:
            tried[key] = attempt(groups)
        return tried[key]

    count = fewest_kept(ranking, lambda n: passes(ranking[:n]))
    if count is None:
        return None
    kept = list(ranking[:count])
    for group in sorted(kept, key=lambda r: -r["weight_elements"]):
        fewer = [r for r in kept if r is not group]
        if passes(fewer):
            kept = fewer
    return kept


def residual_stream(proto: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(block, tensors) for each point of a fused graph's residual stream, in graph order: the sum each
    skip norm writes (its fourth output; where nothing reads that, as after the last layer, the two
    tensors it adds, to be summed), named after the block whose output it adds (`model.layers.3.mlp`:
    the module group of the nearest weight MatMul above that input). Empty for a graph without skip
    norms (fuse: false)."""
    from .weights import weight_matmuls

    groups = {node: path.rsplit(".", 1)[0] for node, path in weight_matmuls(proto).items()}
    producer = {out: node for node in proto.graph.node for out in node.output}

    def block_of(tensor: str) -> str | None:
        frontier = [tensor]
        for _ in range(4):  # through a bias Add or a post-block norm (Gemma 2) to the projection
            nodes = [producer[t] for t in frontier if t in producer]
            found = next((groups[n.name] for n in nodes if n.name in groups), None)
            if found or not nodes:
                return found
            frontier = [i for n in nodes if n.op_type not in SKIP_NORMS for i in n.input]
        return None

    points = []
    for node in proto.graph.node:
        if node.op_type in SKIP_NORMS:
            block = next((b for b in map(block_of, node.input[:2]) if b), node.name)
            summed = (node.output[3],) if len(node.output) > 3 and node.output[3] else tuple(node.input[:2])
            points.append((block, summed))
    return points


def residual_errors(source: OnnxArtifact, quantized: OnnxArtifact, calibration: Sequence[list[int]]
                    ) -> list[dict[str, Any]]:
    """[{block, point, relative_error, added}] along the residual stream (residual_stream), then at the
    logits: each point's error in the quantized graph, |q - r| / |r| per token against the fp32 graph,
    averaged over the first LAYERWISE_ROWS calibration rows, and what the block added to the point
    before it. The error carried in from earlier blocks passes through each block too, so `added` is what
    the block adds to it, not what it would cost alone (the sensitivity ranking measures that).

    The logits row (point "logits", block the LM head's module group) is there when the fp32 graph's
    head is a MatMul over an initializer (or its Transpose: a tied head): its `added` is the quantized
    logits' error less that of the fp32 head applied to the quantized graph's own head input, i.e. what
    the head's quantization adds to the error the stream carries into it. With `logits: last` it covers
    each row's last token only (LAYERWISE_ROWS tokens)."""
    from onnx import numpy_helper

    from .gptq import activations
    from .weights import lm_head_weight

    proto = load_structure(source.model_path)
    points = residual_stream(proto)
    head = lm_head_weight(proto)
    head_weight = next(i for i in proto.graph.initializer if i.name == head.weight) if head else None
    del proto
    graph = load_structure(quantized.model_path)
    written = {out for node in graph.graph.node for out in node.output}
    del graph
    points = [(block, summed) for block, summed in points if set(summed) <= written]
    if not points:
        return []
    names = {tensor for _, summed in points for tensor in summed}
    weight = None
    if head is not None and head.activation in written:
        names |= {head.activation, "logits"}
        weight = numpy_helper.to_array(head_weight, str(Path(source.model_path).parent))  # its external data
        weight = weight.T if head.transposed else weight  # [hidden, vocab]
    rows = calibration_rows(calibration)[:LAYERWISE_ROWS]
    reference = list(activations(Path(source.model_path), names, source.interface, rows, Path()))
    errors: dict[tuple[str, ...], list[np.ndarray]] = {summed: [] for _, summed in points}
    logits_errors: list[np.ndarray] = []
    through_errors: list[np.ndarray] = []  # the fp32 head on the quantized graph's head input
    candidate = activations(Path(quantized.model_path), names, quantized.interface, rows, Path())
    for expected, got in zip(reference, candidate, strict=True):
        for summed in errors:
            r, q = sum(expected[t] for t in summed), sum(got[t] for t in summed)  # [1, tokens, hidden]
            errors[summed].append(_relative(q, r))
        if weight is not None:
            r = expected["logits"]  # [1, tokens, vocab]: every token, or the last
            logits_errors.append(_relative(got["logits"], r))
            through_errors.append(_relative(got[head.activation] @ weight, r))
    records, before = [], 0.0
    for block, summed in points:
        error = float(np.concatenate(errors[summed]).mean())
        records.append({"block": block, "point": "residual stream", "relative_error": error, "added": error - before})
        before = error
    if logits_errors:
        error = float(np.concatenate(logits_errors).mean())
        records.append({"block": head.path, "point": "logits", "relative_error": error,
                        "added": error - float(np.concatenate(through_errors).mean())})
    return records


def _relative(q: np.ndarray, r: np.ndarray) -> np.ndarray:
    """|q - r| / |r| for each token of [1, tokens, width] arrays."""
    return np.linalg.norm(q - r, axis=-1).ravel() / np.maximum(np.linalg.norm(r, axis=-1).ravel(), 1e-12)

