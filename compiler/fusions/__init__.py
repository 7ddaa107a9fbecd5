"""Fusion rules, one per file, each `apply(model: onnx_ir.Model, shapes) -> number of fusions`, or
`(0, why)` when it can say why it found nothing.

The optimize stage (compiler/optimize.py) runs the rules its target lists, in order, and reports
`{rule: count}` and, for each rule that matched nothing, why (the rule's own reason, else the
pattern it looks for). A rule that finds nothing it knows leaves the graph unchanged.

pack_matmuls is the exception: it runs on a variant's finished graph, after quantization (the
pipeline calls compiler.optimize.pack), so that each layer's precision is decided before layers
are joined.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import group_query_attention, layer_normalization, rms_normalization, rotary_embedding


@dataclass(frozen=True)
class Rule:
    name: str
    apply: Callable[[Any, Any], int | tuple[int, str]]
    looks_for: str  # the pattern, said when the rule matched nothing and gave no reason of its own

    def run(self, model: Any, shapes: Any) -> tuple[int, str | None]:
        result = self.apply(model, shapes)
        count, why = result if isinstance(result, tuple) else (result, None)
        return count, (why or f"no {self.looks_for} in the graph") if count == 0 else None


# Rotary before attention, so that attention can rotate the [b, s, heads * d] projections directly
# and drop the Reshape/Transpose pairs around each rotation; attention before the norms, because it
# needs the export's own node structure.
ONNXRUNTIME_RULES = (
    Rule(rotary_embedding.NAME, rotary_embedding.apply, "rotary embedding (x * cos + rotate_half(x) * sin)"),
    Rule(group_query_attention.NAME, group_query_attention.apply, "attention over a Concat KV cache"),
    Rule(rms_normalization.NAME, rms_normalization.apply,
         "RMSNorm (x * rsqrt(mean(x^2) + eps) * weight; LayerNorm families have none)"),
    Rule(rms_normalization.SKIP_NAME, rms_normalization.apply_skip, "residual Add followed by an RMSNorm"),
    Rule(layer_normalization.SKIP_NAME, layer_normalization.apply_skip,
         "residual Add followed by a LayerNormalization (RMSNorm families have none)"),
    Rule(layer_normalization.GELU_NAME, layer_normalization.apply_gelu,
         "GELU (erf or tanh form; SiLU-gated MLPs have none)"),
)
