"""Fusion rules, one per file, each `apply(model: onnx_ir.Model, shapes) -> number of fusions`, or
`(0, why)` when it can say why it found nothing.

The optimize stage (compiler/optimize.py) runs the rules its target lists, in order, and reports
`{rule: count}` and, for each rule that matched nothing, why (the rule's own reason, else the
pattern it looks for). A rule that finds nothing it knows leaves the graph unchanged.

FINISHED_GRAPH_RULES run later, on a variant's finished graph, after quantization: pack_matmuls
joins MatMuls once each layer's precision is decided, and rotary_in_attention folds the rotations
into the packed attention. The variant build's `pack` and `rotary` steps run them, in this order
(compiler/variant_build.py), each checked against the graph before it (compiler/optimize.py pack,
fold_rotary).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import (
    group_query_attention,
    layer_normalization,
    pack_matmuls,
    rms_normalization,
    rotary_embedding,
    rotary_in_attention,
)


@dataclass(frozen=True)
class Rule:
    name: str
    apply: Callable[..., int | tuple[int, str]]
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

# apply(model) without shapes: pack_matmuls on an onnx_ir model, rotary_in_attention on a ModelProto.
FINISHED_GRAPH_RULES = (
    Rule(pack_matmuls.NAME, pack_matmuls.apply, "two MatMuls that read one activation with weights of their own"),
    Rule(rotary_in_attention.NAME, rotary_in_attention.apply,
         "rotary embedding feeding a GroupQueryAttention's query and key"),
)
PACK_MATMULS, ROTARY_IN_ATTENTION = FINISHED_GRAPH_RULES
