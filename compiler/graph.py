"""Graphs on disk: the one place the compiler loads and saves ONNX graphs and their external data.

Every graph a stage writes is a folder with model.onnx and, where it has weights, model.onnx.data
beside it (OnnxArtifact). The weights are written tensor by tensor, never serialized whole in memory
(protobuf could not hold over 2 GiB anyway), and ONNX Runtime maps them from the file rather than
copying them out of the graph's bytes (a 1.9 GB graph: 2.47 GiB resident once loaded from one file,
1.82 GiB from two). Most steps change the graph and not its weights: they load the structure alone
(`load_structure`), rewrite nodes, and save the structure beside the weights they leave on disk
(`save_structure`); steps that write new weights save through `save_model` (onnx_ir) or
`save_proto` (onnx); Kiln's CPU kernels' packed weights are appended page-aligned to a file of
their own (`append_external`). `saved_graph` then finishes the model file and describes the folder.

Two writers are not Kiln's: torch.onnx saves the export (compiler/export.py), and ONNX Runtime's
quantization tools write the graphs they quantize (compiler/quantize.py hands them a path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .families import Shapes

MODEL_FILE = "model.onnx"
DATA_FILE = MODEL_FILE + ".data"


@dataclass(frozen=True)
class OnnxArtifact:
    """A graph on disk plus the interface the runtime reads from the manifest."""

    folder: Path
    interface: dict[str, Any]
    shapes: Shapes
    node_count: int
    files: list[str] = field(default_factory=list)

    @property
    def model_path(self) -> Path:
        return self.folder / MODEL_FILE


def retyped_kv(interface: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A graph's interface (as the manifest writes it) with its past and present KV tensors of `dtype`."""
    retyped = lambda entries: [{**e, "dtype": dtype} if "{layer}" in e["name"] else e for e in entries]  # noqa: E731
    return {**interface, "inputs": retyped(interface["inputs"]), "outputs": retyped(interface["outputs"])}


def load_structure(path: Path) -> Any:
    """The graph's ModelProto without its external weights: nodes and initializers' references only, so
    rewriting nodes moves no weight."""
    import onnx

    return onnx.load(str(path), load_external_data=False)


def load_weights(proto: Any, folder: Path) -> None:
    """Read a structure's external weights (from `folder`) into it, for steps that rewrite weights."""
    import onnx

    onnx.load_external_data_for_model(proto, str(folder))


def load_ir(path: Path) -> Any:
    """The graph as an onnx_ir model; its weights stay mapped from disk until a save copies them over."""
    import onnx_ir as ir

    return ir.load(str(path))


def save_structure(proto: Any, path: Path) -> None:
    """A structure loaded by load_structure, written back: its initializers keep pointing at the weights
    files they name, relative to `path`'s folder (linked or left there by the caller)."""
    import onnx

    onnx.save(proto, str(path))


def save_model(model: Any, folder: Path) -> None:
    """An onnx_ir model as folder/model.onnx with its weights in model.onnx.data (before saved_graph).
    Weights mapped from another graph's data file are copied in chunks."""
    import onnx_ir as ir

    folder.mkdir(parents=True, exist_ok=True)
    (folder / DATA_FILE).unlink(missing_ok=True)
    ir.save(model, str(folder / MODEL_FILE), external_data=DATA_FILE)


def save_proto(proto: Any, folder: Path, name: str = MODEL_FILE) -> None:
    """An onnx ModelProto as folder/name with its weights in name.data (before saved_graph).
    onnx writes the weights one by one and drops each from `proto` once written: `proto` keeps none."""
    import onnx

    folder.mkdir(parents=True, exist_ok=True)
    (folder / (name + ".data")).unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save(proto, str(folder / name), save_as_external_data=True, location=name + ".data")


def initializer_array(tensor: Any, folder: Path) -> np.ndarray:
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


def append_external(data: BinaryIO, location: str, name: str, values: np.ndarray) -> Any:
    """A uint8 initializer `name` whose bytes are appended to `data` (the open file `location`, beside
    the graph) at the next 4 KiB boundary, so ONNX Runtime can map them in place."""
    import onnx

    data.write(b"\0" * (-data.tell() % 4096))
    tensor = onnx.TensorProto(name=name, data_type=onnx.TensorProto.UINT8, dims=[values.size],
                              data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", data.tell()), ("length", values.size)):
        tensor.external_data.add(key=key, value=str(value))
    data.write(values.tobytes())
    return tensor


def saved_graph(folder: Path, interface: dict[str, Any], shapes: Shapes) -> OnnxArtifact:
    """The graph just saved in `folder` (model.onnx, and model.onnx.data where it has weights), its
    model file finished by finish_model_file."""
    files = [MODEL_FILE] + ([DATA_FILE] if (folder / DATA_FILE).exists() else [])
    return OnnxArtifact(folder, interface, shapes, finish_model_file(folder / MODEL_FILE), files)


def finish_model_file(path: Path) -> int:
    """Lower the IR version to the least the opset needs: onnxruntime-gpu lags the CPU package and
    refuses newer IR versions. Only the graph proto is rewritten; external weights stay untouched."""
    import onnx

    proto = load_structure(path)
    # Only the standard domains have IR requirements onnx knows; contrib domains add none.
    standard = [o for o in proto.opset_import if o.domain in ("", "ai.onnx", "ai.onnx.ml")]
    lowest = onnx.helper.find_min_ir_version_for(standard)
    proto.ir_version = max(lowest, 8)  # IR 8 is the first with the model-local functions the exporter may emit
    proto.producer_name = "kiln"
    save_structure(proto, path)
    # onnx's checker knows standard ops only; graphs with ONNX Runtime contrib ops (some of them in the
    # default domain) are checked by loading them into ONNX Runtime instead, which every stage does.
    if all(onnx.defs.has(node.op_type, node.domain) for node in proto.graph.node):
        onnx.checker.check_model(str(path))
    return len(proto.graph.node)
