"""GPTQ rounding for MatMulNBits' weight blocks (`quantize: {rounding: gptq}`).

Rounding each weight to its nearest level (what ONNX Runtime's quantizer does) treats every weight
alone. GPTQ (Frantar et al., 2022, "Accurate Post-Training Quantization for Generative Pre-trained
Transformers") rounds a layer one input feature at a time and moves each rounding error onto the
features not yet rounded, weighted by the inverse of H = X^T X over calibration activations X, so
the layer's outputs on real inputs move as little as they can. Why here: SmolLM2's weights come from
a Q4_1 GGUF file whose grid ONNX Runtime's 4-bit format cannot hold (integer zero points), so
nearest rounding quantizes them a second time and keeps 63% top-1 agreement.

    calibration prompts ─fp32 graph, greedy─> prompt + continuation tokens (the model's own text)
      ─fp32 graph, a graph output per MatMul input─> H per input (q, k, v share one)
      ─per weight: GPTQ over blocks of `block_size` input features─> codes, scales, zero points
      ─> MatMulNBits nodes (the same asymmetric format ONNX Runtime's quantizer writes)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .graph import load_structure, save_proto, save_structure

CONTINUATION_TOKENS = 64  # each calibration prompt is extended with the fp32 graph's own greedy text
LAZY_BLOCK = 128  # input features rounded before their errors are pushed to the rest in one product
DAMPING = 0.01  # of H's mean diagonal, added to its diagonal: H from a few thousand tokens is singular


def calibration_sequences(model_path: Path, interface: dict[str, Any], prompts: Sequence[list[int]],
                          pad_id: int) -> list[list[int]]:
    """Each prompt followed by the fp32 graph's greedy continuation."""
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    from .accuracy import greedy

    backend = OnnxRuntimeBackend(model_path, interface)
    tokens, _ = greedy(backend, list(prompts), CONTINUATION_TOKENS, pad_id)
    backend.close()
    return [list(p) + t for p, t in zip(prompts, tokens, strict=True)]


def hessians(proto: Any, inputs: set[str], interface: dict[str, Any], sequences: Sequence[list[int]],
             work: Path) -> dict[str, np.ndarray]:
    """{MatMul input name: sum over tokens of x x^T}, from one prefill per sequence."""
    sums: dict[str, np.ndarray] = {}
    for values in activations(proto, inputs, interface, sequences, work):
        for name, value in values.items():
            x = value.reshape(-1, value.shape[-1]).astype(np.float64)
            sums[name] = sums.get(name, 0) + x.T @ x
    return sums


def activations(proto: Any, names: set[str], interface: dict[str, Any], sequences: Sequence[list[int]],
                work: Path) -> Iterator[dict[str, np.ndarray]]:
    """{name: value} of these intermediate tensors of the graph, for one prefill per sequence in turn
    (a copy of the graph with them as outputs, in `work` while it runs). `proto` may be a graph file
    instead: then only its nodes are copied, beside it, and its weights are read from where they lie."""
    import onnx
    import onnxruntime as ort

    from runtime.backends.base import expand
    from runtime.manifest import Interface

    if isinstance(proto, Path):
        graph = load_structure(proto)
        path = proto.with_name(f".activations-{os.getpid()}.onnx")  # its weights' paths are relative
    else:
        graph = onnx.ModelProto()
        graph.CopyFrom(proto)
        path = work / "activations.onnx"
    declared = {o.name for o in graph.graph.output}
    graph.graph.output.extend(onnx.ValueInfoProto(name=name) for name in sorted(names - declared))
    if isinstance(proto, Path):
        save_structure(graph, path)
    else:
        save_proto(graph, work, path.name)
    del graph
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ordered = sorted(names)
    interface = Interface.of(interface)
    past = expand(interface.past, interface.layers)
    shared = interface.shared_buffers
    kv_dtype = np.dtype(interface.kv_dtype)  # float16 in an fp16 graph
    try:
        for ids in sequences:
            n = len(ids)
            feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
                    "position_ids": np.arange(n, dtype=np.int64)[None]}
            feed.update({name: np.zeros((1, interface.kv_heads, n if shared else 0, interface.head_dim),
                                        kv_dtype) for name in past})
            yield dict(zip(ordered, session.run(ordered, feed), strict=True))
    finally:
        del session
        path.unlink()
        path.with_name(path.name + ".data").unlink(missing_ok=True)


def gptq_blocks(weight: np.ndarray, hessian: np.ndarray, bits: int, block_size: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [K, N] of MatMul(x, weight) -> codes [N, K / block, block], scales and zero points
    [N, K / block]: asymmetric blocks along K, as MatMulNBits reads them."""
    k, n = weight.shape
    top = 2 ** bits - 1
    w = weight.astype(np.float64).copy()
    h = hessian.astype(np.float64).copy()
    dead = np.diag(h) == 0  # a feature no calibration token used: its weights cannot matter there
    h[dead, dead] = 1
    w[dead] = 0
    h[np.diag_indices(k)] += DAMPING * np.mean(np.diag(h))
    inverse = np.linalg.cholesky(np.linalg.inv(h)).T  # upper Cholesky factor of H^-1
    codes = np.zeros((k, n), np.uint8)
    scales = np.zeros((k // block_size, n))
    zeros = np.zeros((k // block_size, n))
    for start in range(0, k, LAZY_BLOCK):
        end = min(start + LAZY_BLOCK, k)
        part, errors = w[start:end].copy(), np.zeros((end - start, n))
        for i in range(end - start):
            row = start + i
            if row % block_size == 0:  # the block's levels, from its weights as they are now
                group = part[i:i + block_size]
                low, high = np.minimum(group.min(0), 0), np.maximum(group.max(0), 0)
                scale = np.where(high > low, (high - low) / top, 1.0)
                scales[row // block_size], zeros[row // block_size] = scale, np.clip(np.rint(-low / scale), 0, top)
            scale, zero = scales[row // block_size], zeros[row // block_size]
            code = np.clip(np.rint(part[i] / scale) + zero, 0, top)
            codes[row] = code
            error = (part[i] - (code - zero) * scale) / inverse[row, row]
            part[i + 1:] -= np.outer(inverse[row, row + 1:end], error)
            errors[i] = error
        w[end:] -= inverse[start:end, end:].T @ errors
    blocks = codes.T.reshape(n, k // block_size, block_size)
    return blocks, scales.T.astype(np.float32), zeros.T.astype(np.uint8)


def matmul_nbits(name: str, activation: str, output: str, weight_name: str, blocks: np.ndarray,
                 scales: np.ndarray, zeros: np.ndarray, bits: int, block_size: int) -> tuple[Any, list[Any]]:
    """A MatMulNBits node and its initializers, packed as ONNX Runtime's contrib op defines: codes
    low bits first within each byte, zero points likewise, one row of bytes per output feature."""
    from onnx import helper, numpy_helper

    n, count, _ = blocks.shape
    per_byte = 8 // bits
    packed = np.zeros((n, count, block_size // per_byte), np.uint8)
    for j in range(per_byte):
        packed |= (blocks[:, :, j::per_byte] << (bits * j)).astype(np.uint8)
    padded = np.zeros((n, -(-count // per_byte) * per_byte), np.uint8)
    padded[:, :count] = zeros
    zero_bytes = np.zeros((n, padded.shape[1] // per_byte), np.uint8)
    for j in range(per_byte):
        zero_bytes |= (padded[:, j::per_byte] << (bits * j)).astype(np.uint8)
    names = [f"{weight_name}_Q{bits}", f"{weight_name}_scales", f"{weight_name}_zero_points"]
    initializers = [numpy_helper.from_array(packed, names[0]), numpy_helper.from_array(scales.reshape(-1), names[1]),
                    numpy_helper.from_array(zero_bytes.reshape(-1), names[2])]
    node = helper.make_node("MatMulNBits", [activation, *names], [output], name=f"{name}_Q{bits}",
                            domain="com.microsoft", K=count * block_size, N=n, bits=bits, block_size=block_size,
                            accuracy_level=4)
    return node, initializers


def replace_with_nbits(graph: Any, node: Any, blocks: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int,
                       block_size: int) -> None:
    """Swap a weight MatMul for MatMulNBits over these codes, in place; its fp32 weight goes when
    nothing else reads it."""
    fused, initializers = matmul_nbits(node.name, node.input[0], node.output[0], node.input[1], blocks, scales,
                                       zeros, bits, block_size)
    graph.initializer.extend(initializers)
    index = list(graph.node).index(node)
    graph.node.remove(node)
    graph.node.insert(index, fused)
    if not any(node.input[1] in x.input for x in graph.node):
        graph.initializer.remove(next(i for i in graph.initializer if i.name == node.input[1]))


def quantize_gptq(proto: Any, nodes: Sequence[str], hessian_of: dict[str, np.ndarray], bits: int,
                  block_size: int) -> None:
    """Replace the MatMuls named in `nodes` (in place) with GPTQ-rounded MatMulNBits."""
    from onnx import numpy_helper

    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    for name in nodes:
        node = next(x for x in graph.node if x.name == name)
        weight = numpy_helper.to_array(inits[node.input[1]])
        replace_with_nbits(graph, node, *gptq_blocks(weight, hessian_of[node.input[0]], bits, block_size), bits,
                           block_size)
