"""Fusion rules: RMSNorm -> SimplifiedLayerNormalization, residual Add + RMSNorm -> SkipSimplifiedLayerNormalization.

These use the onnxscript rewriter's own rules (onnxscript/rewriter/ort_fusions/rms_normalization.py
and skip_normalization.py) rather than a matcher of ours: they match the Pow/ReduceMean/Add/Sqrt/
Reciprocal/Mul chain that the dynamo exporter emits for every RMSNorm in transformers, and they are
tested upstream against the same exporter. Each fused op replaces 6 to 7 nodes per norm.

    x ─Pow 2─ReduceMean─Add eps─Sqrt─Reciprocal─Mul x─Mul weight─>   =>   SimplifiedLayerNormalization
    a ─Add b─> (RMSNorm as above)                                    =>   SkipSimplifiedLayerNormalization
"""

from __future__ import annotations

from typing import Any

NAME = "rms_normalization"
SKIP_NAME = "skip_rms_normalization"


def apply(model: Any, shapes: Any) -> int:
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization

    return int(fuse_rms_normalization(model))


def apply_skip(model: Any, shapes: Any) -> int:
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

    count = int(fuse_skip_rms_normalization(model))
    statistics_dropped(model, "SkipSimplifiedLayerNormalization")
    return count


def statistics_dropped(model: Any, op_type: str) -> None:
    """Unname the mean and inverse-deviation outputs (1 and 2) of the skip norms that nothing reads.
    The rewriter names all four outputs, and ONNX Runtime computes and writes every named one:
    ONNX Runtime's profiler put SmolLM2 int8's 60 skip norms at 1.10 ms a batch-1 step with them,
    0.85 without."""
    for node in model.graph:
        if node.op_type != op_type or node.domain != "com.microsoft":
            continue
        for output in node.outputs[1:3]:
            if not output.uses() and not output.is_graph_output():
                output.name = ""
