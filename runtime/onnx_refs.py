"""Where an ONNX file keeps tensors outside itself, read without loading any tensor.

A production host has no `onnx` package, and a file from an archive must not be handed to ONNX
Runtime before its external-data references are known to stay inside the artifact. So this walks
the protobuf wire format over a memory map, descending only into the messages that can hold tensors
and skipping everything else (raw weights included) by its length:

    ModelProto.graph(7), .training_info(20) -> .initialization(1), .algorithm(2), .functions(25)
      FunctionProto.node(7), .attribute_proto(11)
      GraphProto.node(1), .initializer(5), .sparse_initializer(15)
        NodeProto.attribute(5) -> AttributeProto.t(5), .g(6), .tensors(10), .graphs(11),
                                  .sparse_tensor(22), .sparse_tensors(23)
        TensorProto.external_data(13) -> StringStringEntryProto key(1), value(2); .data_location(14)
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

# message kind -> {field number: message kind of that (repeated) field}
_CHILDREN = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "function": {7: "node", 11: "attribute"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {13: "entry"},
}
EXTERNAL = 1  # TensorProto.DataLocation
_MAX_DEPTH = 64  # subgraphs nest; a crafted file must not recurse without end


class MalformedModel(ValueError):
    pass


def external_data(path: Path) -> list[dict[str, str]]:
    """Every external-data entry ({"location", "offset"?, "length"?}) of the ONNX file at `path`."""
    with open(path, "rb") as handle:
        if handle.seek(0, 2) == 0:
            raise MalformedModel(f"{path.name} is empty")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            view = memoryview(data)
            try:
                return [entry for entry in _tensors(view, 0, len(view), "model", 0)]
            finally:
                view.release()


def _tensors(data: memoryview, start: int, end: int, kind: str, depth: int) -> Iterator[dict[str, str]]:
    if depth > _MAX_DEPTH:
        raise MalformedModel("messages nested too deep")
    if kind == "tensor":
        entries, external = [], False
        for field, wire, s, e in _fields(data, start, end):
            if field == 13 and wire == 2:
                entries.append(_entry(data, s, e))
            elif field == 14 and wire == 0:
                external = s == EXTERNAL
        if external and not entries:
            raise MalformedModel("a tensor is stored externally but names no location")
        if entries:
            yield {k: v for k, v in entries}
        return
    children = _CHILDREN[kind]
    for field, wire, s, e in _fields(data, start, end):
        if wire == 2 and field in children:
            yield from _tensors(data, s, e, children[field], depth + 1)


def _entry(data: memoryview, start: int, end: int) -> tuple[str, str]:
    key = value = ""
    for field, wire, s, e in _fields(data, start, end):
        if wire != 2:
            continue
        try:
            text = bytes(data[s:e]).decode("utf-8", errors="strict")
        except UnicodeDecodeError:
            raise MalformedModel("an external-data entry is not UTF-8") from None
        key, value = (text, value) if field == 1 else (key, text) if field == 2 else (key, value)
    return key, value


def _fields(data: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field, wire type, start, end) of each length-delimited field in data[start:end], and (field, 0,
    value, 0) of each varint; fixed-width fields are skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(data, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos, end)
            yield field, 0, value, 0
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(data, pos, end)
            if pos + length > end:
                raise MalformedModel("a field runs past the end of its message (truncated file?)")
            yield field, 2, pos, pos + length
            pos += length
        else:
            raise MalformedModel(f"unsupported protobuf wire type {wire}")
    if pos != end:
        raise MalformedModel("a field runs past the end of its message (truncated file?)")


def _varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise MalformedModel("bad varint (truncated file?)")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
