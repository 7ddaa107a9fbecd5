"""`quantize.exclude: auto`: which modules a quantized variant keeps in fp32, and where its accuracy goes.

Two steps, both measured under ONNX Runtime on the graphs that would ship, and both skipped when the
variant with every group quantized meets its gates (the pipeline builds and measures that first: one
build, where the ranking costs one per group):

1. Sensitivity (`layer_sensitivity`): each module group (a decoder layer's attention projections, its
   MLP projections, the LM head) quantized alone, every other weight left in fp32; the KL divergence of
   its next-token distributions from the fp32 graph's, teacher-forced over the calibration prompts.
   This is the per-layer table a user reads to see where accuracy goes; it reads the calibration set,
   not the held-out text the gates judge.
2. Search (`lightest_kept`): the groups kept in fp32 start as a prefix of that ranking, most sensitive
   first: the shortest prefix whose variant meets the gates, found by doubling, then bisection
   (`fewest_kept`). Then each kept group, heaviest first, is dropped if the variant still meets the
   gates without it. Weights are what a decode step reads, so what stays in fp32 is its speed, and KL
   is not what the gates measure: SmolLM2's LM head holds a fifth of its weights (as many as ten
   MLPs) and ranks 4th by KL, yet with its top logits recomputed in fp32 (`exact_top_logits`) its
   argmax hardly moves, so top-1 does not need it. Ranking by KL per weight instead was measured and
   was worse there (34 groups, 364 MiB resident against 299). The prefix takes passing to be
   monotone in its length, which holds when the groups' errors roughly add up; every attempt is
   recorded, so a case where it does not shows in the report. The attempts are gated on the gates'
   own held-out text and prompts, so for an `exclude: auto` variant those are the search's stopping
   rule as well as its measurement, no longer an independent estimate.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .accuracy import kl_divergence, teacher_forced
from .export import OnnxArtifact
from .progress import release_freed_memory
from .recipe import Variant

SENSITIVITY_ROW_TOKENS = 64  # the calibration prompts, joined and cut into teacher-forced rows this long


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
    import onnx

    from .quantize import untie_transposed_weights, weight_matmuls

    proto = onnx.load(str(source.model_path), load_external_data=False)
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
    from runtime.backend import OnnxRuntimeBackend

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
    for group, members in groups.items():
        alone = with_exclude(variant, [p for p in paths if p not in members])
        graph, _ = quantize(source, alone, calibration, folder)
        backend = OnnxRuntimeBackend(graph.model_path, graph.interface)
        logits = teacher_forced(backend, rows, pad_id, into=logits_folder / "group.bin")
        backend.close()
        shutil.rmtree(folder)
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
