"""Which nodes of a graph ONNX Runtime's CUDA execution provider would leave on the CPU, predicted on a
machine without a GPU.

ONNX Runtime runs a node on CUDA only where onnxruntime-gpu registers a CUDA kernel for the node's op,
opset and types; every other node falls back to the CPU, with a copy of its inputs to the host and of
its outputs back (the probe that motivated this: GroupQueryAttention in fp32 has no CUDA kernel, so
the attention of an fp32-attention graph ran on the CPU, with 8 MemcpyToHost a decode step). The
kernels the pinned onnxruntime-gpu registers are data in compiler/data/ (scripts/cuda_kernel_table.py
writes them from the wheel itself); the op schemas that say which input binds which type come from
the onnxruntime installed here (its CPU build knows every schema the GPU build does).

Constant nodes are not counted (ONNX Runtime folds them into initializers). Shape arithmetic is
excepted and counted apart: nodes computed from shapes and constants alone, with
integer or boolean outputs (Shape, Gather of a dimension, Concat of sizes). ONNX Runtime keeps those
on the CPU by design, where their few int64 scalars are cheaper than a launch.

What the table cannot see, a GPU host's profile shows: ONNX Runtime also moves to the CPU the nodes
whose outputs a CUDA kernel reads on the host (GroupQueryAttention's total_sequence_length). Where
this host runs CUDA, `measure` replaces the prediction: ONNX Runtime's profiler over a prefill and a
few decode steps says which provider ran each node, and how many copies to the host a step made.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ONNXRUNTIME_GPU = "1.31.1"  # the pinned onnxruntime-gpu (pyproject.toml's gpu extra)
TABLE = Path(__file__).parent / "data" / f"onnxruntime_gpu_{ONNXRUNTIME_GPU}_cuda_kernels.json"
SHAPE_OPS = frozenset({"Shape", "Size"})
# Folded into initializers when ONNX Runtime loads the graph: never a node that runs.
FOLDED_OPS = frozenset({"Constant"})
INTEGER_TYPES = frozenset({"int64", "int32", "bool"})
SHOWN = 8  # nodes named in a refusal; the report lists them all


@dataclass(frozen=True)
class Placement:
    """The prediction for one graph: the nodes without a CUDA kernel, each with why."""

    on_cpu: list[dict[str, Any]] = field(default_factory=list)  # {node, op, types, why}
    compute_nodes: int = 0
    shape_arithmetic: int = 0
    measured: dict[str, Any] | None = None  # from ONNX Runtime's profile, where it ran (measure)
    shape_nodes: frozenset[str] = frozenset()  # the shape arithmetic's node names

    @property
    def all_on_cuda(self) -> bool:
        return not self.on_cpu

    def summary(self) -> str:
        where = f"measured on {self.measured['providers'][0]}: " if self.measured else ""
        if self.measured and self.all_on_cuda:
            return (f"{where}every compute node of {self.compute_nodes} ran on CUDA, {self.measured['copies_to_host']} "
                    f"copies to the host a decode step ({self.shape_arithmetic} nodes of shape arithmetic on the CPU)")
        if self.measured:
            named = "; ".join(f"{n['node']} ({n['op']})" for n in self.on_cpu[:SHOWN])
            more = f"; and {len(self.on_cpu) - SHOWN} more" if len(self.on_cpu) > SHOWN else ""
            return (f"{where}{len(self.on_cpu)} nodes besides shape arithmetic ran on the CPU (the graph has "
                    f"{self.compute_nodes} compute nodes; ONNX Runtime may add its own): {named}{more}")
        if self.all_on_cuda:
            return (f"every compute node of {self.compute_nodes} has a CUDA kernel in onnxruntime-gpu "
                    f"{ONNXRUNTIME_GPU} ({self.shape_arithmetic} nodes of shape arithmetic left to the CPU)")
        named = "; ".join(f"{n['node']} ({n['why']})" for n in self.on_cpu[:SHOWN])
        more = f"; and {len(self.on_cpu) - SHOWN} more" if len(self.on_cpu) > SHOWN else ""
        return (f"{len(self.on_cpu)} of {self.compute_nodes} compute nodes have no CUDA kernel in onnxruntime-gpu "
                f"{ONNXRUNTIME_GPU} and would run on the CPU: {named}{more}")

    def to_json(self) -> dict[str, Any]:
        return {"onnxruntime_gpu": ONNXRUNTIME_GPU, "predicted": self.measured is None,
                "compute_nodes": self.compute_nodes, "shape_arithmetic": self.shape_arithmetic, "on_cpu": self.on_cpu,
                **({"measured": self.measured} if self.measured else {})}


def predict(proto: Any) -> Placement:
    """The nodes of `proto` (an onnx ModelProto, its weights loaded or not) with no CUDA kernel for their
    op, opset and types."""
    graph = proto.graph
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in proto.opset_import}
    types = _declared_types(graph)
    shape_derived = {i.name for i in graph.initializer}
    on_cpu, compute, shapes, shape_nodes = [], 0, 0, set()
    for node in graph.node:
        schema = _schema(node.domain, node.op_type, opsets.get(node.domain, 1))
        bound = _bind(node, schema, types)
        if node.op_type in FOLDED_OPS and not node.domain:
            shape_derived.update(node.output)
            continue
        from_shapes = node.op_type in SHAPE_OPS or all(name in shape_derived for name in node.input if name)
        outputs = [types.get(name) for name in node.output if name]
        if from_shapes and all(t in INTEGER_TYPES for t in outputs if t):
            shape_derived.update(node.output)
            shape_nodes.add(node.name)
            shapes += 1
            continue
        compute += 1
        why = _no_kernel(node, schema, bound)
        if why:
            on_cpu.append({"node": node.name or f"{node.op_type} -> {node.output[0]}", "op": _op(node),
                           "types": dict(sorted((k, v) for k, v in bound.items() if v)), "why": why})
    return Placement(on_cpu, compute, shapes, shape_nodes=frozenset(shape_nodes))


def measure(model_path: Path, interface: dict[str, Any], providers: list[Any], work: Path,
            decode_steps: int = 3) -> Placement:
    """Which provider ran each node of the graph, from ONNX Runtime's profile of a prefill of 8 tokens and
    `decode_steps` decode steps at batch 2. Nodes the prediction calls shape arithmetic, and ONNX Runtime's
    own copies between devices, are not counted as compute on the CPU. The KV buffers are the CPU backend's
    (host memory): their crossings are feeds and fetches, not copy nodes, and are not counted."""
    import numpy as np

    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    from .graph import load_structure

    predicted = predict(load_structure(model_path))
    work.mkdir(parents=True, exist_ok=True)
    backend = OnnxRuntimeBackend(model_path, interface, providers, profile=work / "placement")
    prompt = 8
    cache = backend.new_cache(2, prompt + decode_steps + 1)
    ids = np.ones((2, prompt), np.int64)
    _, cache = backend.run(ids, np.ones((2, prompt), np.int64), np.tile(np.arange(prompt), (2, 1)), cache)
    for step in range(decode_steps):
        length = prompt + step + 1
        _, cache = backend.run(ids[:, :1], np.ones((2, length), np.int64), np.full((2, 1), length - 1), cache)
    events = json.loads(Path(backend.session.end_profiling()).read_text())
    backend.close()
    ran: dict[str, tuple[str, set[str]]] = {}
    for event in events:
        args = event.get("args") or {}
        if event.get("cat") != "Node" or "provider" not in args:
            continue
        name = event["name"].removesuffix("_kernel_time")
        ran.setdefault(name, (args.get("op_name", "?"), set()))[1].add(args["provider"])
    # Every run executes each copy node ONNX Runtime inserted once: their number is the copies a step makes.
    copies = sum(op == "MemcpyToHost" for op, _ in ran.values())
    on_cpu = [{"node": name, "op": op, "providers": sorted(where)} for name, (op, where) in sorted(ran.items())
              if "CPUExecutionProvider" in where and name not in predicted.shape_nodes and not op.startswith("Memcpy")]
    measured = {"providers": [p if isinstance(p, str) else p[0] for p in providers], "nodes_run": len(ran),
                "copies_to_host": copies, "decode_steps": decode_steps}
    return Placement(on_cpu, predicted.compute_nodes, predicted.shape_arithmetic, measured)


# -- types through the graph ---------------------------------------------------------------------

def tensor_types(proto: Any) -> dict[str, str]:
    """{value name: its element type ("float16", "bfloat16", "int64", ...)} for the graph's declared values
    and every node output whose type its op's schema fixes from its inputs and attributes."""
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in proto.opset_import}
    types = _declared_types(proto.graph)
    for node in proto.graph.node:
        _bind(node, _schema(node.domain, node.op_type, opsets.get(node.domain, 1)), types)
    return types


def _dtype(elem_type: int) -> str | None:
    import onnx

    if not elem_type:
        return None
    return onnx.helper.tensor_dtype_to_string(elem_type).removeprefix("TensorProto.").lower()


def _declared_types(graph: Any) -> dict[str, str]:
    types = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        dtype = _dtype(value.type.tensor_type.elem_type)
        if dtype:
            types[value.name] = dtype
    for tensor in graph.initializer:
        types[tensor.name] = _dtype(tensor.data_type)
    return types


def _bind(node: Any, schema: Any, types: dict[str, str]) -> dict[str, str | None]:
    """{type constraint: the node's type for it}, read from its inputs, and its outputs' types set in `types`."""
    bound: dict[str, str | None] = {}
    if schema is None:
        return bound
    allowed = {c.type_param_str: [t.removeprefix("tensor(").removesuffix(")") for t in c.allowed_type_strs]
               for c in schema.type_constraints}
    for formal, name in _formals(schema.inputs, node.input):
        if formal.typeStr in allowed and types.get(name):
            bound.setdefault(formal.typeStr, types[name])
    for formal, name in _formals(schema.outputs, node.output):
        dtype = _output_type(node, formal.typeStr, bound, allowed)
        if dtype:
            types[name] = dtype
            if formal.typeStr in allowed:
                bound.setdefault(formal.typeStr, dtype)
    return bound


def _formals(formals: Any, names: Any) -> list[tuple[Any, str]]:
    """(formal parameter, value name) for each value present; a variadic last formal takes the rest."""
    pairs = []
    for index, name in enumerate(names):
        if name and formals:
            pairs.append((formals[min(index, len(formals) - 1)], name))
    return pairs


def _output_type(node: Any, type_str: str, bound: dict[str, str | None], allowed: dict[str, list[str]]) -> str | None:
    if type_str in bound:
        return bound[type_str]
    if type_str.startswith("tensor("):
        return type_str.removeprefix("tensor(").removesuffix(")")
    attributes = {a.name: a for a in node.attribute}
    if node.op_type in ("Cast", "RandomNormal", "RandomUniform", "EyeLike") and "to" in attributes:
        return _dtype(attributes["to"].i)
    if "dtype" in attributes:
        return _dtype(attributes["dtype"].i)
    if node.op_type in ("Constant", "ConstantOfShape"):
        value = attributes.get("value")
        if value is not None:
            return _dtype(value.t.data_type)
        return "float" if node.op_type == "ConstantOfShape" else None
    choices = allowed.get(type_str, [])
    return choices[0] if len(choices) == 1 else None


# -- kernels --------------------------------------------------------------------------------------

def _no_kernel(node: Any, schema: Any, bound: dict[str, str | None]) -> str | None:
    """Why no CUDA kernel takes the node, or None where one does."""
    version = schema.since_version if schema is not None else None
    rows = [row for row in _kernels().get(node.domain, {}).get(node.op_type, [])
            if version is None or (row[0] <= version and (row[1] is None or version <= row[1]))]
    if not rows:
        return f"no CUDA kernel for {_op(node)}" + (f" at opset {version}" if version else "")
    for _, _, constraints in rows:
        if all(bound.get(name) is None or bound[name] in allowed for name, allowed in constraints.items()):
            return None
    taken = defaultdict(set)
    for _, _, constraints in rows:
        for name, allowed in constraints.items():
            taken[name].update(allowed)
    misses = [f"{name}={bound[name]} (CUDA takes {', '.join(sorted(taken[name]))})"
              for name in sorted(taken) if bound.get(name) and bound[name] not in taken[name]]
    over = ", ".join(misses) or ", ".join(f"{k}={v}" for k, v in sorted(bound.items()) if v)
    return f"no CUDA kernel for {_op(node)} over {over}"


def _op(node: Any) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain else node.op_type


@functools.cache
def _kernels() -> dict[str, dict[str, list]]:
    return json.loads(TABLE.read_text())["kernels"]


@functools.cache
def _schemas() -> dict[tuple[str, str], list[Any]]:
    import onnxruntime.capi.onnxruntime_pybind11_state as ort_state

    schemas: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for schema in ort_state.get_all_operator_schema():
        domain = "" if schema.domain == "ai.onnx" else schema.domain
        schemas[(domain, schema.name)].append(schema)
    for versions in schemas.values():
        versions.sort(key=lambda s: s.since_version)
    return schemas


def _schema(domain: str, op: str, opset: int) -> Any:
    """The op's schema in force at the graph's opset for its domain: the newest one not after it."""
    versions = [s for s in _schemas().get((domain, op), []) if s.since_version <= opset]
    return versions[-1] if versions else None
