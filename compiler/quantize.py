"""The quantize stage: an optimized fp32 graph -> the precision a variant asks for, with a report.

One table, QUANTIZERS, maps a variant's (precision, quantize mode) to the function that makes it
(it returns the graph's interface and the weights it kept on their source grid); a new mode is one
function and one row. Every mode keeps fp32 logits, and every mode's accuracy is
then measured against the fp32 graph by the gates (compiler/accuracy.py), so nothing here has to
guess what is good enough.

- int8-dynamic, int4: weight-only blocks, ONNX Runtime's MatMulNBits (asymmetric, one scale and zero
  point per `block_size` weights along K) with accuracy_level 4, which quantizes each activation
  block to int8 at run time. Small blocks, because on SmolLM2 8-bit blocks of 128 measured 90%
  teacher-forced top-1 agreement with fp32 against 97% for blocks of 32. accuracy_level 0 (fp32
  activations) has no fast 8-bit kernel on x86: 194 ms a decode step against 13 ms. A weight
  already on a symmetric int8 grid (a GGUF Q8_0 tensor) keeps that grid exactly, at 8 bits in
  both modes.
  `rounding: gptq` rounds them by GPTQ instead of to the nearest level (compiler/gptq.py); on
  SmolLM2's int4 that lifts top-1 agreement from 72% to 78% on the held-out text.
- int8-static: explicit QuantizeLinear/DequantizeLinear pairs (QDQ), symmetric int8 activations and
  per-channel symmetric weights, the form TensorRT's parser and ONNX Runtime both take; activation
  ranges come from running calibration prompts (minmax, entropy or percentile).
- fp16: weights and compute in fp16, with the numerically sensitive ops kept in fp32 (BLOCKED_FP16).

`exclude` in the recipe keeps matching layers in fp32: globs over module paths such as
`lm_head` or `model.layers.*.mlp.down_proj`, read from the exporter's name scopes.
"""

from __future__ import annotations

import fnmatch
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ExportError
from .export import MODEL_FILE, OnnxArtifact, save_proto, saved_graph
from .recipe import Variant

# Kept in fp32 by the fp16 conversion: reductions and exponentials whose range or rounding fp16
# cannot hold (RMSNorm's mean of squares overflows fp16 at |x| > 256; softmax needs fp32 sums), and
# the rotary angles, which lose position resolution in fp16 beyond a few hundred tokens.
BLOCKED_FP16 = (
    "ReduceMean", "Pow", "Sqrt", "Reciprocal", "Softmax", "Cos", "Sin", "Range", "CumSum",
    "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
    "GroupQueryAttention",
)


class QuantizeError(ExportError):
    pass


def quantize(source: OnnxArtifact, variant: Variant, calibration: Sequence[list[int]], folder: Path
             ) -> tuple[OnnxArtifact, dict[str, Any]]:
    """Return the quantized graph in `folder`, and a report of what was quantized and what was kept."""
    import onnx

    mode = variant.quantize.mode if variant.quantize else None
    make = QUANTIZERS[(variant.precision, mode)]
    proto = onnx.load(str(source.model_path))
    _untie_transposed_weights(proto)
    layers = weight_matmuls(proto)
    excluded = sorted(n for n, path in layers.items() if _matches(path, variant.quantize))
    interface, exact = make(proto, source, variant, calibration, excluded, folder)
    artifact = saved_graph(folder, interface, source.shapes)
    report = {"mode": mode or variant.precision, "weight_matmuls": len(layers),
              "kept_fp32": [layers[n] for n in excluded], "kept_source_grid": [layers[n] for n in exact],
              "settings": variant.quantize.model_dump() if variant.quantize else {}}
    return artifact, report


def _matches(path: str, spec: Any) -> bool:
    return spec is not None and any(fnmatch.fnmatchcase(path, pattern) for pattern in spec.exclude)


# -- the modes -------------------------------------------------------------------------------------

def _weight_blocks(bits: int) -> Callable[..., dict]:
    def make(proto: Any, source: OnnxArtifact, variant: Variant, calibration: Any, excluded: list[str],
             folder: Path) -> dict:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        spec = variant.quantize
        # A weight on an int8 grid keeps it at 8 bits in the 4-bit mode too: 4 bits would re-round it.
        exact = _on_int8_grid(proto, spec.block_size, excluded)
        if spec.rounding == "gptq":
            model = proto
            _gptq(model, source, [n for n in weight_matmuls(proto) if n not in excluded and n not in exact],
                  calibration, bits, spec.block_size, folder / ".gptq")
        else:
            quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=spec.block_size, is_symmetric=False,
                                             accuracy_level=4, nodes_to_exclude=[*excluded, *exact])
            quantizer.process()
            model = quantizer.model.model
        _encode_int8_grid(model, exact, spec.block_size)
        save_proto(model, folder)
        return source.interface, sorted(exact)

    return make


def _gptq(proto: Any, source: OnnxArtifact, nodes: list[str], calibration: Sequence[list[int]], bits: int,
          block_size: int, work: Path) -> None:
    from . import gptq

    sequences = gptq.calibration_sequences(source.model_path, source.interface, calibration, pad_id=0)
    inputs = {n.input[0] for n in proto.graph.node if n.name in set(nodes)}
    hessians = gptq.hessians(proto, inputs, source.interface, sequences, work)
    gptq.quantize_gptq(proto, nodes, hessians, bits, block_size)
    shutil.rmtree(work, ignore_errors=True)


def _qdq_static(proto: Any, source: OnnxArtifact, variant: Variant, calibration: Sequence[list[int]],
                excluded: list[str], folder: Path) -> dict:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    spec = variant.quantize
    work = folder / ".calibration"
    work.mkdir(parents=True, exist_ok=True)
    prepared = work / "prepared.onnx"
    save_proto(proto, work, prepared.name)
    targets = [n for n in weight_matmuls(proto) if n not in excluded]
    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[spec.method]
    try:
        quantize_static(
            str(prepared), str(folder / MODEL_FILE), _CalibrationFeed(source, calibration),
            quant_format=QuantFormat.QDQ, nodes_to_quantize=targets, per_channel=True,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, calibrate_method=method,
            use_external_data_format=True,
            # Symmetric activations with zero points of 0: TensorRT's Q/DQ support requires it.
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
        )
    except ValueError as exc:  # ONNX Runtime's histogram calibrators fail on near-constant tensors
        raise QuantizeError(f"{variant.name}: calibration method {spec.method} failed in ONNX Runtime's "
                            f"calibrator ({exc}); use method: minmax") from None
    shutil.rmtree(work)
    return source.interface, []


def _fp16(proto: Any, source: OnnxArtifact, variant: Variant, calibration: Any, excluded: list[str],
          folder: Path) -> dict:
    import onnx_ir as ir
    from onnx_ir.passes.common import TopologicalSortPass
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(proto, keep_io_types=["logits"], op_block_list=list(BLOCKED_FP16),
                                         node_block_list=excluded, disable_shape_infer=True)
    model = ir.from_proto(converted)
    TopologicalSortPass()(model)  # the converter appends its Casts after their consumers
    save_proto(ir.to_proto(model), folder)
    half = lambda entries: [{**e, "dtype": "float16"} if "{layer}" in e["name"] else e  # noqa: E731
                            for e in entries]
    return {**source.interface, "inputs": half(source.interface["inputs"]),
            "outputs": half(source.interface["outputs"])}, []


def _on_int8_grid(proto: Any, block_size: int, excluded: list[str]) -> dict[str, np.ndarray]:
    """{node: weight} for the weight MatMuls whose every block already lies on a symmetric int8 grid
    (a multiple of max|w| / 127): a GGUF Q8_0 tensor, dequantized. SmolLM2's tied embedding and LM
    head is one. Re-rounding it to ONNX Runtime's asymmetric grid cost 1.1 points of top-1 agreement
    (97.0% against 98.1% kept exact), so such a weight keeps its own grid, value for value."""
    from onnx import numpy_helper

    inits = {i.name: i for i in proto.graph.initializer}
    found = {}
    for name in weight_matmuls(proto):
        if name in excluded:
            continue
        node = next(n for n in proto.graph.node if n.name == name)
        weight = numpy_helper.to_array(inits[node.input[1]])
        if weight.ndim == 2 and weight.shape[0] % block_size == 0:
            codes, scales = _int8_blocks(weight, block_size)
            decoded = ((codes.astype(np.float32) - 128) * scales[..., None]).reshape(weight.shape[1], -1).T
            if np.abs(decoded - weight).max() <= 1e-6 * np.abs(weight).max():  # float rounding, not a grid step
                found[name] = weight
    return found


def _int8_blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """weight [K, N] -> MatMulNBits' 8-bit codes [N, K / block, block] (zero point 128) and scales
    [N, K / block]: symmetric, scale max|w| / 127, so a block's largest weight is exact."""
    k, n = weight.shape
    blocks = weight.T.reshape(n, k // block_size, block_size)
    largest = np.abs(blocks).max(-1)
    scales = np.where(largest > 0, largest / 127, 1).astype(np.float32)
    codes = np.clip(np.rint(blocks / scales[..., None]), -127, 127) + 128
    return codes.astype(np.uint8), scales


def _encode_int8_grid(model: Any, weights: dict[str, np.ndarray], block_size: int) -> None:
    """Replace each MatMul in `weights` with MatMulNBits over its own int8 grid (accuracy_level 4)."""
    from .gptq import replace_with_nbits

    for name, weight in weights.items():
        node = next(n for n in model.graph.node if n.name == name)
        codes, scales = _int8_blocks(weight, block_size)
        replace_with_nbits(model.graph, node, codes, scales, np.full(scales.shape, 128, np.uint8), 8, block_size)


QUANTIZERS: dict[tuple[str, str | None], Callable[..., dict]] = {
    ("fp32", "int8-dynamic"): _weight_blocks(bits=8),
    ("fp32", "int4"): _weight_blocks(bits=4),
    ("fp32", "int8-static"): _qdq_static,
    ("fp16", None): _fp16,
}


# -- helpers ---------------------------------------------------------------------------------------

def weight_matmuls(proto: Any) -> dict[str, str]:
    """{node name: module path} for every MatMul whose weight is an initializer. The path comes from
    the exporter's name scopes (`model.model.layers.0.mlp.down_proj` -> `model.layers.0.mlp.down_proj`)."""
    weights = {i.name for i in proto.graph.initializer}
    found = {}
    for node in proto.graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in weights:
            scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
            path = _module_path(scopes) if scopes else node.name
            found[node.name] = path
    return found


def _module_path(scopes: str) -> str:
    parts = [p.strip(" '\"") for p in scopes.strip("[]").split(",")]
    modules = [p for p in parts if p][:-1]  # the last entry is the op itself
    path = modules[-1] if modules else ""
    return path.removeprefix("model.")


def _untie_transposed_weights(proto: Any) -> None:
    """MatMul(x, Transpose(W)) with W an initializer -> MatMul(x, W^T) with W^T stored.

    A tied LM head reads the embedding table through a Transpose; MatMulNBits and QDQ weight
    quantization need the weight as an initializer. The embedding itself stays fp32 for the Gather.
    """
    from onnx import numpy_helper

    inits = {i.name: i for i in proto.graph.initializer}
    consumers: dict[str, list] = {}
    for node in proto.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for node in list(proto.graph.node):
        if node.op_type != "Transpose" or node.input[0] not in inits:
            continue
        if not all(c.op_type == "MatMul" and c.input[1] == node.output[0] for c in consumers.get(node.output[0], [])):
            continue
        weight = numpy_helper.to_array(inits[node.input[0]])
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        proto.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.transpose(perm)),
                                                               node.output[0]))
        proto.graph.node.remove(node)


CALIBRATION_CHUNK = 32


class _CalibrationFeed:
    """ONNX Runtime's CalibrationDataReader: prefills of batch 1 on an empty cache.

    The prompts are joined and cut into chunks of one length, because the histogram calibrators
    (entropy, percentile) stack every run's activations into one array and need equal shapes.
    """

    def __init__(self, source: OnnxArtifact, prompts: Sequence[list[int]]) -> None:
        from runtime.backend import expand

        stream = [t for p in prompts for t in p]
        prompts = [stream[i:i + CALIBRATION_CHUNK] for i in range(0, len(stream) - CALIBRATION_CHUNK + 1,
                                                                   CALIBRATION_CHUNK)]

        interface = source.interface
        shared = interface.get("kv_sharing") == "shared-buffer"
        names = expand(interface["inputs"][3:], interface["layers"])
        kv = (interface["kv_heads"], interface["head_dim"])
        self._feeds = iter([
            {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
             "position_ids": np.arange(len(ids), dtype=np.int64)[None],
             **{n: np.zeros((1, kv[0], len(ids) if shared else 0, kv[1]), np.float32) for n in names}}
            for ids in prompts
        ])

    def get_next(self) -> dict | None:
        return next(self._feeds, None)

    def rewind(self) -> None:  # pragma: no cover - the calibrators read once
        raise QuantizeError("calibration data can be read only once")


def check_finite(artifact: OnnxArtifact, prompts: Sequence[list[int]], name: str) -> None:
    """Overflow shows as inf or NaN in logits or KV: find it on the calibration prompts, not later."""
    from runtime.backend import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(artifact.model_path, artifact.interface)
    for number, ids in enumerate(prompts):
        row = np.array([ids], np.int64)
        cache = backend.new_cache(1, len(ids))
        logits, cache = backend.run(row, np.ones_like(row), np.arange(len(ids))[None], cache)
        bad = [what for what, t in [("logits", logits), *(("KV cache", c) for c in cache)] if not np.isfinite(t).all()]
        if bad:
            raise QuantizeError(
                f"{name}: {bad[0]} overflow (inf or NaN) on calibration prompt {number + 1} in "
                f"{artifact.interface['inputs'][3]['dtype']}; keep more ops in fp32 (quantize.exclude) or use fp32"
            )
