"""Fusion rules, one per file, each `apply(model: onnx_ir.Model, shapes) -> number of fusions`.

The optimize stage (compiler/optimize.py) runs the rules its target lists, in order, and reports
`{rule: count}`. A rule that finds nothing it knows returns 0 and leaves the graph unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import group_query_attention, rms_normalization, rotary_embedding


@dataclass(frozen=True)
class Rule:
    name: str
    apply: Callable[[Any, Any], int]


# Attention first: it removes the Concat cache that the norms' patterns never touch anyway, and it
# needs the export's own node structure, which later rules rewrite.
ONNXRUNTIME_RULES = (
    Rule(group_query_attention.NAME, group_query_attention.apply),
    Rule(rms_normalization.NAME, rms_normalization.apply),
    Rule(rms_normalization.SKIP_NAME, rms_normalization.apply_skip),
    Rule(rotary_embedding.NAME, rotary_embedding.apply),
)
