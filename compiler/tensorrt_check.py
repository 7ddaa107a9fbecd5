"""Can TensorRT's ONNX parser take this graph? Checked here, on any machine, before an engine build.

The table of what the parser supports (op types and the data types of each) is onnx-tensorrt's
docs/operators.md, copied into compiler/tensorrt_ops.py with its source. A graph with an op from
another domain (ONNX Runtime's com.microsoft contrib ops, say), an op the parser does not know, or
a data type it does not take for that op is refused with the first offenders named.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .errors import ExportError
from .tensorrt_ops import ONNX_TO_TRT_DTYPE, SUPPORTED_OPS, TABLE_SOURCE


class TensorRTIncompatible(ExportError):
    pass


def unsupported_ops(model: Any) -> dict[str, set[str]]:
    """{op: reasons} for every op in the graph that TensorRT's parser cannot take."""
    problems: dict[str, set[str]] = defaultdict(set)
    for node in model.graph:
        op = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        if node.domain not in ("", "ai.onnx"):
            problems[op].add(f"domain {node.domain} is not standard ONNX")
        elif node.op_type not in SUPPORTED_OPS:
            problems[op].add("not in the parser's operator table")
        else:
            for value in node.inputs:  # the table's types are input types (comparisons output BOOL)
                dtype = _short_dtype(value)
                if dtype is not None and dtype not in SUPPORTED_OPS[node.op_type]:
                    problems[op].add(f"data type {dtype}")
    return problems


def check_tensorrt_graph(model: Any) -> dict[str, Any]:
    problems = unsupported_ops(model)
    if problems:
        listed = "; ".join(f"{op} ({', '.join(sorted(why))})" for op, why in sorted(problems.items())[:4])
        hint = ("; its experts are ONNX Runtime's MoE op: compile with export.experts: dense for TensorRT"
                if "com.microsoft::MoE" in problems else "")
        raise TensorRTIncompatible(f"TensorRT's ONNX parser cannot take this graph: {listed}{hint}")
    return {"parser_table": TABLE_SOURCE, "unsupported": {}}


def _short_dtype(value: Any) -> str | None:
    if value is None or value.dtype is None:
        return None
    return ONNX_TO_TRT_DTYPE.get(value.dtype.name)
