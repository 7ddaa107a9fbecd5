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


# Rotary before attention, so that attention can rotate the [b, s, heads * d] projections directly
# and drop the Reshape/Transpose pairs around each rotation; attention before the norms, because it
# needs the export's own node structure.
ONNXRUNTIME_RULES = (
    Rule(rotary_embedding.NAME, rotary_embedding.apply),
    Rule(group_query_attention.NAME, group_query_attention.apply),
    Rule(rms_normalization.NAME, rms_normalization.apply),
    Rule(rms_normalization.SKIP_NAME, rms_normalization.apply_skip),
)
