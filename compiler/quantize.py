"""The quantize stage: an optimized fp32 graph -> the precision a variant asks for, with a report.

One table, QUANTIZERS, maps a variant's (precision, quantize mode) to the function that makes it
(it returns the graph's interface, the weights it kept on their source grid and notes for the
report); a new mode is one function and one row. Every mode keeps fp32 logits, and every mode's
accuracy is then measured against the fp32 graph by the gates (compiler/accuracy.py), so nothing
here has to guess what is good enough.

- int8-dynamic, int4: weight-only blocks, ONNX Runtime's MatMulNBits (asymmetric, one scale and zero
  point per `block_size` weights along K) with accuracy_level 4, which quantizes each activation
  block to int8 at run time. Small blocks, because on SmolLM2 8-bit blocks of 128 measured 90%
  teacher-forced top-1 agreement with fp32 against 97% for blocks of 32. accuracy_level 0 (fp32
  activations) has no fast 8-bit kernel on x86: 194 ms a decode step against 13 ms. A weight
  already on a symmetric int8 grid (a GGUF Q8_0 tensor) keeps that grid exactly, at 8 bits in
  both modes (but the int4 mode's LM head when its top logits are rescored, below); in the int4
  mode a weight on a 4-bit grid (a GGUF Q4_1 tensor) keeps its 16 levels exactly, its fractional
  zero points corrected by the op itself (_encode_int4_grid): SmolLM2's int4 went from 72% top-1
  agreement to 96.8% and from +30.8% perplexity to +0.18%.
  `rounding: gptq` rounds them by GPTQ instead of to the nearest level (compiler/gptq.py); on
  SmolLM2's int4 that lifts top-1 agreement from 72% to 78% on the held-out text.
- int8-dynamic, int8-static: `smoothing: ALPHA` folds SmoothQuant's per-channel scales into the
  RMSNorm scales, up_proj's and v_proj's columns first (compiler/smoothing.py), so int8 activation
  blocks (or int8-static's one scale per tensor) lose less.
- int8-dynamic, int4: a quantized LM head's `exact_top_logits` highest logits are recomputed in
  fp32 from its fp32 rows (_rescore_top_logits): SmolLM2's all-quantized int8 went from 97.3% to
  98.1% top-1 agreement on the held-out text, int4 from 96.2% to 96.6%.
- int8-static: explicit QuantizeLinear/DequantizeLinear pairs (QDQ), symmetric int8 activations and
  per-channel symmetric weights, the form TensorRT's parser and ONNX Runtime both take; activation
  ranges come from running calibration prompts (minmax, entropy or percentile). For the onnxruntime
  target the MatMuls' outputs stay fp32 and the activations' codes are stored as uint8 about 128
  (_activations_as_uint8: the same numbers), the only form ONNX Runtime fuses into integer MatMuls
  (MatMulIntegerToFloat) on x86.
- fp16: weights and compute in fp16, with the numerically sensitive ops kept in fp32 (BLOCKED_FP16).

`exclude` in the recipe keeps matching layers in fp32: globs over module paths such as
`lm_head` or `model.layers.*.mlp.down_proj`, read from the exporter's name scopes; `exclude: auto`
is resolved to paths before this stage, by a sensitivity search (compiler/sensitivity.py). With
`exclude_block_size` (int8-dynamic, int4) they are quantized in that finer block size instead, in a
second pass, so the weights a search keeps cost a quarter of their fp32 bytes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.backends.registry import Target
from runtime.manifest import Interface

from .errors import ExportError
from .graph import (
    MODEL_FILE,
    OnnxArtifact,
    load_structure,
    load_weights,
    retyped_kv,
    save_proto,
    save_structure,
    saved_graph,
)
from .recipe import Variant
from .smoothing import smooth
from .weights import lm_head, logits_writer, weight_matmuls

# Kept in fp32 by the fp16 conversion: reductions and exponentials whose range or rounding fp16
# cannot hold (RMSNorm's mean of squares overflows fp16 at |x| > 256; softmax needs fp32 sums), and
# the rotary angles, which lose position resolution in fp16 beyond a few hundred tokens.
BLOCKED_FP16 = (
    "ReduceMean", "Pow", "Sqrt", "Reciprocal", "Softmax", "Cos", "Sin", "Range", "CumSum",
    "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
    "GroupQueryAttention",
)
# For ONNX Runtime's CUDA provider the fused ops stay in half precision: their CUDA kernels take fp16
# (GroupQueryAttention fp16 and bf16 only, fp32 has none) and accumulate in fp32 themselves (the norms'
# sums of squares, attention's softmax). The rest of BLOCKED_FP16 stays fp32 where an unfused graph
# still has it; CUDA runs those in fp32 too.
CUDA_HALF_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
                 "GroupQueryAttention")
# Histogram bins of the entropy and percentile calibrations: TensorRT's entropy calibrator's 2048, so
# the KL search has 961 thresholds to try between 128 quantized bins and the whole range.
HISTOGRAM_BINS = 2048
GRID_TEST_COLUMNS = 2048  # a weight's output columns tested for a source grid at once


class QuantizeError(ExportError):
    pass


# What a mode returns: the graph's interface, the weights it kept on their source grid, and notes for
# the variant's report.
Made = tuple[dict[str, Any], list[str], dict[str, Any]]


def quantize(source: OnnxArtifact, variant: Variant, calibration: Sequence[list[int]], folder: Path
             ) -> tuple[OnnxArtifact, dict[str, Any]]:
    """Return the quantized graph in `folder`, and a report of what was quantized and what was kept."""

    mode = variant.quantize.mode if variant.quantize else None
    make = QUANTIZERS[(variant.precision, mode)]
    spec = variant.quantize
    # The weights come after smoothing: it reads the ones it changes from disk and stores them smoothed,
    # where a graph loaded whole would keep both copies (protobuf frees a replaced tensor's bytes only
    # with the whole graph: SmolLM2's int8 quantize peaked 0.27 GiB higher so).
    proto = load_structure(source.model_path)
    smoothed = (smooth(proto, source, calibration, spec.smoothing, folder / ".smoothing")
                if spec is not None and spec.smoothing is not None else None)
    load_weights(proto, source.folder)
    untie_transposed_weights(proto)
    layers = weight_matmuls(proto)
    excluded = sorted(n for n, path in layers.items() if _matches(path, variant.quantize))
    interface, exact, notes = make(proto, source, variant, calibration, excluded, folder)
    artifact = saved_graph(folder, interface, source.shapes)
    finer = spec is not None and spec.exclude_block_size is not None  # then the mode's notes list them
    report = {"mode": mode or variant.precision, "weight_matmuls": len(layers),
              "kept_fp32": [] if finer else [layers[n] for n in excluded],
              "kept_source_grid": [layers[n] for n in exact],
              "settings": spec.model_dump() if spec else {}, **notes, **({"smoothing": smoothed} if smoothed else {})}
    return artifact, report


def _matches(path: str, spec: Any) -> bool:
    if spec is not None and spec.exclude == "auto":  # the pipeline's search resolves it to paths first
        raise QuantizeError("quantize.exclude: auto reached the quantizer unresolved")
    return spec is not None and any(fnmatch.fnmatchcase(path, pattern) for pattern in spec.exclude)


# -- the modes -------------------------------------------------------------------------------------

def _int4_then_fp16(proto: Any, source: OnnxArtifact, variant: Variant, calibration: Any, excluded: list[str],
                    folder: Path) -> Made:
    """int4 weight blocks (MatMulNBits), then the whole graph in fp16 (or bf16) as _fp16 makes it: a CUDA
    variant's 4-bit weights over half-precision activations, scales in the same half precision."""
    interface, on_grid, notes = _weight_blocks(bits=4)(proto, source, variant, calibration, excluded,
                                                        folder / ".int4")
    quantized = load_structure(folder / ".int4" / MODEL_FILE)
    load_weights(quantized, folder / ".int4")
    half, _, _ = _fp16(quantized, dataclasses.replace(source, interface=interface), variant, calibration, excluded,
                       folder)  # the modules int4 kept in fp32 stay fp32 (the report's kept_fp32)
    del quantized
    shutil.rmtree(folder / ".int4")
    return half, on_grid, notes


def _weight_blocks(bits: int) -> Callable[..., Made]:
    def make(proto: Any, source: OnnxArtifact, variant: Variant, calibration: Any, excluded: list[str],
             folder: Path) -> Made:
        spec = variant.quantize
        # `exclude` keeps its modules in fp32, or with exclude_block_size quantizes them in a second pass,
        # in finer blocks.
        paths = weight_matmuls(proto)
        finer = excluded if spec.exclude_block_size else []
        # Read before quantizing: the quantizer drops the head's fp32 weight where nothing else reads it.
        exact_rows, rescoring = _rows_to_rescore(proto, spec.exact_top_logits, [] if finer else excluded)
        rescored_head = lm_head(proto) if exact_rows is not None else None
        model, on_grid, rerounded = _quantize_blocks(proto, source, spec, calibration, bits, spec.block_size,
                                                     [] if finer else excluded, finer, rescored_head, folder)
        # What the first pass kept on its source grid stays there: a finer block would no longer find the
        # grid (a GGUF block is 32 wide) and would re-round it.
        finer = [n for n in finer if n not in on_grid]
        if finer:
            rest = [n for n in paths if n not in finer]
            model, exact, rerounded_finer = _quantize_blocks(model, source, spec, calibration, bits,
                                                             spec.exclude_block_size, rest, [], rescored_head, folder)
            on_grid, rerounded = on_grid + exact, rerounded or rerounded_finer
        if rerounded:
            rescoring += "; the head itself at 4 bits, re-rounded from its int8 source grid"
        if exact_rows is not None:
            _rescore_top_logits(model, exact_rows, spec.exact_top_logits)
        experts = _quantize_experts(model, bits, spec.block_size)
        save_proto(model, folder)
        notes = {"exact_top_logits": rescoring, **({"experts": experts} if experts else {})}
        if spec.exclude_block_size:
            notes["kept_finer_blocks"] = [paths[n] for n in finer]
        return source.interface, sorted(on_grid), notes

    return make


def _quantize_blocks(model: Any, source: OnnxArtifact, spec: Any, calibration: Any, bits: int, block_size: int,
                     skipped: list[str], later: list[str], rescored_head: str | None, folder: Path
                     ) -> tuple[Any, list[str], bool]:
    """The weight MatMuls but `skipped` -> MatMulNBits of `bits` in blocks of `block_size`, but those of
    `later` (left for a pass in finer blocks) that are not on a source grid here; returns the model, the
    weights kept on their source grid, and whether the rescored head left its int8 grid."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # A weight on an int8 grid keeps it at 8 bits in the 4-bit mode too: 4 bits would re-round it.
    # Not a rescored LM head: its top logits come from the fp32 rows whatever its bits, so 4 bits
    # cost only the logits below them, and it is the largest weight a step reads (SmolLM2's
    # int4: decode steps 5% to 7% faster alone at batch 1, top-1 0.972 either way, perplexity +0.73%
    # against +0.28%).
    exact = _on_int8_grid(model, block_size, skipped)
    rerounded = bits == 4 and rescored_head in exact
    if rerounded:
        exact.remove(rescored_head)
    # A weight on a 4-bit grid (GGUF Q4_1) keeps its levels exactly in the 4-bit mode. Not at 8 bits:
    # measured on SmolLM2, exact levels there gave perplexity -0.27% against +1.14% but top-1 on the
    # held-out text 95.6% against 98.1%, with 240 nodes more; 8-bit blocks are within 1/34 of a
    # Q4_1 step already.
    exact4 = _on_int4_grid(model, block_size, [*skipped, *exact]) if bits == 4 else []
    kept = [*skipped, *exact, *exact4, *later]
    if spec.rounding == "gptq":
        rounded = [n for n in weight_matmuls(model) if n not in kept]
        if rounded:
            _gptq(model, source, rounded, calibration, bits, block_size, folder / ".gptq")
    else:
        quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=False,
                                         accuracy_level=4, nodes_to_exclude=kept)
        quantizer.process()
        model = quantizer.model.model
    _encode_int8_grid(model, exact, block_size)
    _encode_int4_grid(model, exact4, block_size, bits)
    return model, [*exact, *exact4], rerounded


def _gptq(proto: Any, source: OnnxArtifact, nodes: list[str], calibration: Sequence[list[int]], bits: int,
          block_size: int, work: Path) -> None:
    from . import gptq

    sequences = gptq.calibration_sequences(source.model_path, source.interface, calibration, pad_id=0)
    inputs = {n.input[0] for n in proto.graph.node if n.name in set(nodes)}
    hessians = gptq.hessians(proto, inputs, source.interface, sequences, work)
    gptq.quantize_gptq(proto, nodes, hessians, bits, block_size)
    shutil.rmtree(work, ignore_errors=True)


def _qdq_static(proto: Any, source: OnnxArtifact, variant: Variant, calibration: Sequence[list[int]],
                excluded: list[str], folder: Path) -> Made:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    spec = variant.quantize
    for_onnxruntime = variant.target == Target.ONNXRUNTIME  # else TensorRT, which takes the int8 form as it is
    work = folder / ".calibration"
    work.mkdir(parents=True, exist_ok=True)
    prepared = work / "prepared.onnx"
    save_proto(proto, work, prepared.name)
    targets = [n for n in weight_matmuls(proto) if n not in excluded]
    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[spec.method]
    ranges = work / "ranges.json"
    try:
        if method != CalibrationMethod.MinMax:
            _histogram_ranges(prepared, source, calibration, method, ranges)
        quantize_static(
            # The prompts run once: for the histogram methods they ran above, into `ranges`.
            str(prepared), str(folder / MODEL_FILE),
            None if ranges.is_file() else _CalibrationFeed(source, calibration),
            quant_format=QuantFormat.QDQ, nodes_to_quantize=targets, per_channel=True,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, calibrate_method=method,
            use_external_data_format=True,
            # Symmetric activations with zero points of 0: TensorRT's Q/DQ support requires it.
            # ONNX Runtime's MatMuls keep fp32 outputs: each is then one MatMulIntegerToFloat, and
            # the per-tensor static scale of a projection's output was error added for nothing
            # (SmolLM2: top-1 0.314 -> 0.513).
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                           **({"OpTypesToExcludeOutputQuantization": ["MatMul"]}
                              if for_onnxruntime else {})},
            calibration_cache_path=ranges if ranges.is_file() else None,
        )
    except ValueError as exc:  # ONNX Runtime's histogram calibrators fail on near-constant tensors
        raise QuantizeError(f"{variant.name}: calibration method {spec.method} failed in ONNX Runtime's "
                            f"calibrator ({exc}); use method: minmax") from None
    shutil.rmtree(work)
    if for_onnxruntime:
        _activations_as_uint8(folder / MODEL_FILE)
    return source.interface, [], {}


def _histogram_ranges(prepared: Path, source: OnnxArtifact, calibration: Sequence[list[int]], method: Any,
                      path: Path) -> None:
    """Calibrate `prepared`'s activation ranges by a histogram method (entropy, percentile) into the
    range file quantize_static reads, with HISTOGRAM_BINS bins.

    Why not let quantize_static calibrate: it gives its entropy calibrator no bin count, and that
    calibrator's default is 128 bins for 128 quantized levels, one candidate threshold, the whole
    range: `method: entropy` gave minmax's scales exactly (SmolLM2: every one of 121 equal)."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator, save_tensors_data
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    options = {"num_bins": HISTOGRAM_BINS, "symmetric": True,
               **({"num_quantized_bins": 128} if method == CalibrationMethod.Entropy else {})}
    calibrator = create_calibrator(prepared, sorted({*QLinearOpsRegistry, *QDQRegistry}),
                                   augmented_model_path=str(path.parent / "augmented.onnx"),
                                   calibrate_method=method, use_external_data_format=True, extra_options=options)
    calibrator.collect_data(_CalibrationFeed(source, calibration))
    save_tensors_data(calibrator.compute_data(), path)


def _activations_as_uint8(path: Path) -> None:
    """Every activation QuantizeLinear's zero point (and its DequantizeLinear's, the same tensor) from
    int8 0 to uint8 128, in place: each code moves by 128 and every dequantized value stays the same.

    Why: on x86 ONNX Runtime fuses a DequantizeLinear -> MatMul (-> QuantizeLinear) group into an
    integer MatMulIntegerToFloat (QLinearMatMul) only with uint8 activations, and turns int8 ones
    to uint8 itself only where one MatMul reads the pair. q/k/v and gate/up share theirs, so those
    MatMuls ran in fp32 over weights dequantized on every call: SmolLM2's int8-static step took 351
    ms at batch 1 against 9.05 after this (150 of its 211 MatMuls left unfused before, none after).
    TensorRT wants the int8 form."""
    import onnx
    from onnx import numpy_helper

    proto = load_structure(path)  # the weights stay where they are on disk
    inits = {i.name: i for i in proto.graph.initializer}
    for name in {n.input[2] for n in proto.graph.node if n.op_type == "QuantizeLinear" and len(n.input) > 2}:
        zero = inits[name]
        if zero.data_type == onnx.TensorProto.INT8:
            zero.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(zero).astype(np.int16) + 128).astype(np.uint8),
                                                  name))
    save_structure(proto, path)


def _fp16(proto: Any, source: OnnxArtifact, variant: Variant, calibration: Any, excluded: list[str],
          folder: Path) -> Made:
    import onnx_ir as ir
    from onnx import TensorProto, numpy_helper
    from onnx_ir.passes.common import TopologicalSortPass
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from .bf16 import to_bfloat16

    blocked = [op for op in BLOCKED_FP16 if variant.target != Target.ONNXRUNTIME_CUDA or op not in CUDA_HALF_OPS]
    # bf16 (CUDA variants): the fp16 graph retyped, its weights rounded from these fp32 values (compiler/bf16.py)
    fp32_values = ({t.name: numpy_helper.to_array(t) for t in proto.graph.initializer
                    if t.data_type == TensorProto.FLOAT} if variant.precision == "bf16" else {})
    converted = convert_float_to_float16(proto, keep_io_types=["logits"], op_block_list=blocked,
                                         node_block_list=excluded, disable_shape_infer=True)
    if variant.precision == "bf16":
        to_bfloat16(converted, fp32_values)
        del fp32_values
    model = ir.from_proto(converted)
    TopologicalSortPass()(model)  # the converter appends its Casts after their consumers
    save_proto(ir.to_proto(model), folder)
    return retyped_kv(source.interface, "bfloat16" if variant.precision == "bf16" else "float16"), [], {}


def _on_int8_grid(proto: Any, block_size: int, excluded: list[str]) -> list[str]:
    """The weight MatMuls whose every block already lies on a symmetric int8 grid (a multiple of
    max|w| / 127): a GGUF Q8_0 tensor, dequantized. SmolLM2's tied embedding and LM head is one.
    Re-rounding it to ONNX Runtime's asymmetric grid cost 1.1 points of top-1 agreement (97.0%
    against 98.1% kept exact), so such a weight keeps its own grid, value for value."""
    def on_grid(columns: np.ndarray, largest: float) -> bool:
        codes, scales = _int8_blocks(columns, block_size)
        decoded = ((codes.astype(np.float32) - 128) * scales[..., None]).reshape(columns.shape[1], -1).T
        return bool(np.abs(decoded - columns).max() <= 1e-6 * largest)  # float rounding, not a step

    return _weights_where(proto, block_size, excluded, on_grid)


def _weights_where(proto: Any, block_size: int, excluded: list[str],
                   test: Callable[[np.ndarray, float], bool]) -> list[str]:
    """The weight MatMuls, but `excluded`, whose weight [K, N] (K a multiple of block_size) passes `test`
    on every slice of its columns (given the weight's largest |w|); each weight is read, tested and let
    go in turn, a slice at a time: the tests' temporaries over a whole LM head were 0.45 GiB at 135M."""
    found = []
    for name in weight_matmuls(proto):
        if name in excluded:
            continue
        weight = _weight_of(proto, name)
        if weight.ndim != 2 or weight.shape[0] % block_size:
            continue
        largest = float(max(weight.max(), -weight.min()))
        if all(test(weight[:, i:i + GRID_TEST_COLUMNS], largest)
               for i in range(0, weight.shape[1], GRID_TEST_COLUMNS)):
            found.append(name)
    return found


def _weight_of(proto: Any, name: str) -> np.ndarray:
    from onnx import numpy_helper

    node = next(n for n in proto.graph.node if n.name == name)
    return numpy_helper.to_array(next(i for i in proto.graph.initializer if i.name == node.input[1]))


def _int8_blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """weight [K, N] -> MatMulNBits' 8-bit codes [N, K / block, block] (zero point 128) and scales
    [N, K / block]: symmetric, scale max|w| / 127, so a block's largest weight is exact."""
    k, n = weight.shape
    return _symmetric_codes(weight.T.reshape(n, k // block_size, block_size), bits=8)


def _symmetric_codes(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [..., block] -> codes about 2^(bits-1) (the zero point MatMulNBits and QMoE assume) and
    scales [...]: max|w| / (2^(bits-1) - 1), so a block's largest weight is exact."""
    top = 2 ** (bits - 1) - 1
    largest = np.abs(blocks).max(-1)
    scales = np.where(largest > 0, largest / top, 1).astype(np.float32)
    codes = np.clip(np.rint(blocks / scales[..., None]), -top, top) + top + 1
    return codes.astype(np.uint8), scales


def _encode_int8_grid(model: Any, names: list[str], block_size: int) -> None:
    """Replace each MatMul in `names` with MatMulNBits over its own int8 grid (accuracy_level 4)."""
    from .gptq import replace_with_nbits

    for name in names:
        codes, scales = _int8_blocks(_weight_of(model, name), block_size)
        node = next(n for n in model.graph.node if n.name == name)
        replace_with_nbits(model.graph, node, codes, scales, np.full(scales.shape, 128, np.uint8), 8, block_size)


def _on_int4_grid(proto: Any, block_size: int, excluded: list[str]) -> list[str]:
    """The weight MatMuls whose every block of `block_size` along K is 16 levels d * q + m, q = 0..15,
    spanning the block: a GGUF Q4_1 tensor, dequantized (its blocks are 32 wide and map their
    minimum to 0 and maximum to 15). SmolLM2's layer weights all are."""
    def on_grid(columns: np.ndarray, largest: float) -> bool:
        blocks = columns.T.reshape(columns.shape[1], -1, block_size)
        low = blocks.min(-1, keepdims=True)
        step = (blocks.max(-1, keepdims=True) - low) / 15
        if not (step > 0).all():
            return False
        levels = (blocks - low) / step
        return bool(np.abs(levels - np.rint(levels)).max() < 1e-3)  # float rounding, not a grid step

    return _weights_where(proto, block_size, excluded, on_grid)


def _encode_int4_grid(model: Any, names: list[str], block_size: int, bits: int) -> None:
    """Replace each MatMul in `names` with a MatMulNBits (4 or 8 bits) that decodes its Q4_1 levels
    exactly.

    MatMulNBits' zero points are integers on its fast path (a float zero point takes a dequantizing
    path: 5 ms a call instead of 34 us, measured), and a Q4_1 block's is -m / d, a fraction: rounding
    it moves every weight of the block by up to half a step, the same error as rounding afresh (it cost
    SmolLM2's int4 25 points of top-1 agreement). So the zero point is rounded, and what rounding moved,
    d * (its fraction) times the block's sum of activations, is added back by the same op: each
    activation row gets its block means as extra columns, twice (an AveragePool over x's last axis,
    padded with zero means to whole blocks; shared by the MatMuls that read x), and the
    weight gets, as extra rows, minus each block's block_size * d * fraction, then what quantizing
    that left, in blocks of their own. The correction is then quantized, not the weights: in one part
    its rounding error was up to a thirtieth of a step at 4 bits, a block's every weight off by it
    alike (SmolLM2's int4 layers 0.7% off their Q4_1 values on average; top-1 0.962 against 0.973 on
    bench/peers.py's text); the second part takes that to 1/450, and Kiln's 4-bit kernel reads the two
    as each block's offset (compiler/optimize.py). At 8 bits the codes are the same 0..15.

    Measured on a chain of 120 SmolLM2-sized 4-bit MatMulNBits at one row (2 threads, side by side):
    block sums by a MatMul with a [K, 32] matrix of ones cost 1.9 ms a decode step, against 0.8 ms as a
    Reshape + ReduceSum (and 9 MB less of SmolLM2's int4 graph). The AveragePool is the ReduceSum's cost
    without the Reshape: on SmolLM2's int4 step (1 thread, ONNX Runtime's profiler) 0.60 ms of
    AveragePool against 0.63 of ReduceSum and 0.60 of Reshape. It gives means, not sums, so the weight
    rows carry the block size."""
    from onnx import helper, numpy_helper

    from .gptq import replace_with_nbits

    graph = model.graph
    pooled: dict[tuple[str, int], str] = {}
    for name in names:
        weight = _weight_of(model, name)
        node = next(n for n in graph.node if n.name == name)
        k, n = weight.shape
        count = k // block_size
        extra = -(-count // block_size)  # blocks of block means, each part
        activation = node.input[0]
        if (activation, k) not in pooled:
            base = f"{activation}_block_means_{block_size}"  # unique where two block sizes read x
            at = next(i for i, x in enumerate(graph.node) if activation in x.input)  # before its first reader
            # Activations are [batch, seq, K] in every exported graph: pooled as [N, C, length]; zero means
            # pad them to whole blocks, so each part of the correction starts at a block of its own.
            pads = f"{base}_pads"
            graph.initializer.append(numpy_helper.from_array(np.array([0, 0, 0, 0, 0, extra * block_size - count],
                                                                      np.int64), pads))
            graph.node.insert(at, helper.make_node("AveragePool", [activation], [f"{base}_pooled"], name=base,
                                                   kernel_shape=[block_size], strides=[block_size]))
            graph.node.insert(at + 1, helper.make_node("Pad", [f"{base}_pooled", pads], [base], name=f"{base}_padded"))
            graph.node.insert(at + 2, helper.make_node("Concat", [activation, base, base], [f"{base}_joined"],
                                                       name=f"{base}_joined", axis=-1))
            pooled[(activation, k)] = f"{base}_joined"
        blocks = weight.T.reshape(n, count, block_size)
        low = blocks.min(-1)
        step = ((blocks.max(-1) - low) / 15).astype(np.float32)
        codes = np.clip(np.rint((blocks - low[..., None]) / step[..., None]), 0, 15)
        zero = -low / step
        rounded = np.clip(np.rint(zero), 0, 15)
        correction = np.zeros((n, extra, block_size), np.float32)
        # w = d (q - zero) = d (q - rounded) - d (zero - rounded), the last term times a block's sum: its mean * size
        correction.reshape(n, -1)[:, :count] = -step * (zero - rounded) * block_size
        parts = [_blocks_nbits(correction, bits)]
        left = correction - (parts[0][0] - parts[0][2][..., None]) * parts[0][1][..., None]
        parts.append(_blocks_nbits(left, bits))
        replace_with_nbits(graph, node, np.concatenate([codes, *(p[0] for p in parts)], 1).astype(np.uint8),
                           np.concatenate([step, *(p[1] for p in parts)], 1),
                           np.concatenate([rounded, *(p[2] for p in parts)], 1).astype(np.uint8), bits, block_size)
        fused = next(x for x in graph.node if x.name == f"{name}_Q{bits}")
        fused.input[0] = pooled[(activation, k)]
        next(a for a in fused.attribute if a.name == "K").i = k + 2 * extra * block_size


def _blocks_nbits(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks [..., block] as MatMulNBits' asymmetric codes, scales and zero points (0 always a level)."""
    low, high = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
    top = 2 ** bits - 1
    step = np.where(high > low, (high - low) / top, 1).astype(np.float32)
    zero = np.clip(np.rint(-low / step), 0, top)
    return np.clip(np.rint(blocks / step[..., None] + zero[..., None]), 0, top), step, zero


@dataclass(frozen=True)
class ExactRows:
    """What _rescore_top_logits reads: the LM head's activation, and its fp32 weight as rows [vocab,
    hidden] under `name`: the embedding table when the head is tied to it (no new bytes), else
    `tensor`, a transposed copy to add (vocab x hidden x 4 bytes on disk)."""

    activation: str
    name: str
    vocab: int
    hidden: int
    tensor: Any = None


def _rows_to_rescore(proto: Any, top: int, excluded: list[str]) -> tuple[ExactRows | None, str]:
    """The rows _rescore_top_logits will read, or None, and what the report says of it."""
    if not top:
        return None, "off (exact_top_logits: 0)"
    head = lm_head(proto)
    if head is None:
        return None, ("off: no weight MatMul writes the logits (a bias, soft-capping or scaling follows the "
                      "LM head)")
    if head in excluded:
        return None, "off: the LM head is kept in fp32"
    rows = _exact_rows(proto, head)
    source = ("the tied embedding table" if rows.tensor is None
              else f"a copy of the head's fp32 weight ({rows.vocab * rows.hidden * 4 / 2**20:.0f} MiB)")
    return rows, f"the top {min(top, rows.vocab)} logits recomputed in fp32 from {source}"


def _exact_rows(proto: Any, head: str) -> ExactRows:
    """The LM head's activation and fp32 rows: the embedding table if it holds the same numbers."""
    from onnx import numpy_helper

    weight = _weight_of(proto, head)
    activation = next(n for n in proto.graph.node if n.name == head).input[0]
    inits = {i.name: i for i in proto.graph.initializer}
    for node in proto.graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" and node.input else None
        if table is not None and tuple(table.dims) == weight.shape[::-1]:
            if np.array_equal(numpy_helper.to_array(table), weight.T):
                return ExactRows(activation, table.name, *weight.shape[::-1])
    name = f"{head}_exact_rows"
    copy = numpy_helper.from_array(np.ascontiguousarray(weight.T), name)
    return ExactRows(activation, name, *weight.shape[::-1], copy)


def _rescore_top_logits(model: Any, rows: ExactRows, top: int) -> None:
    """The quantized LM head's `top` highest logits recomputed exactly, from the fp32 weight rows.

        h ──LM head (int8/int4)──> approx ──TopK──> index ──────────────────────────────────┐
        │                            │              └──Gather(rows)──┐                       │
        └──Unsqueeze────────────────────────────────────────────MatMul──Squeeze──ScatterElements(approx)──> logits

    Why: what a user sees of the head's error is the order of the top candidates (greedy tokens,
    top-k sampling), and that is where the error goes once the weights are exact (a head on its GGUF
    Q8_0 grid: then all of it is the fast kernels' int8 activations). `top` rows cost `top` x hidden
    weights read a step against vocab x hidden for an fp32 head, and a `top` x hidden activation per
    position (`logits: all` prefills hold one per prompt token). The logits below the top stay the
    quantized head's. Each row's result depends on that row alone: batch invariance holds.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    if rows.tensor is not None:
        graph.initializer.append(rows.tensor)
    logits_writer(graph).output[0] = "logits_quantized"
    graph.initializer.extend([numpy_helper.from_array(np.array([min(top, rows.vocab)], np.int64), "exact_top_k"),
                              numpy_helper.from_array(np.array([-1], np.int64), "exact_top_axis")])
    graph.node.extend([
        helper.make_node("TopK", ["logits_quantized", "exact_top_k"], ["exact_top_values", "exact_top_index"],
                         name="exact_top_k", axis=-1),
        helper.make_node("Gather", [rows.name, "exact_top_index"], ["exact_top_rows"], name="exact_top_rows", axis=0),
        helper.make_node("Unsqueeze", [rows.activation, "exact_top_axis"], ["exact_top_hidden"],
                         name="exact_top_hidden"),
        helper.make_node("MatMul", ["exact_top_rows", "exact_top_hidden"], ["exact_top_dot"], name="exact_top_dot"),
        helper.make_node("Squeeze", ["exact_top_dot", "exact_top_axis"], ["exact_top_logits"],
                         name="exact_top_logits"),
        helper.make_node("ScatterElements", ["logits_quantized", "exact_top_index", "exact_top_logits"], ["logits"],
                         name="exact_top_scatter", axis=-1),
    ])


QUANTIZERS: dict[tuple[str, str | None], Callable[..., Made]] = {
    ("fp32", "int8-dynamic"): _weight_blocks(bits=8),
    ("fp32", "int4"): _weight_blocks(bits=4),
    ("fp32", "int8-static"): _qdq_static,
    ("fp16", None): _fp16,
    ("fp16", "int4"): _int4_then_fp16,
    ("bf16", None): _fp16,  # the fp16 graph in bfloat16 (compiler/bf16.py)
    ("bf16", "int4"): _int4_then_fp16,
}


# -- helpers ---------------------------------------------------------------------------------------

def _quantize_experts(model: Any, bits: int, block_size: int) -> str | None:
    """Each mixture-of-experts layer's MoE node (compiler/moe.py) -> ONNX Runtime's QMoE, its experts'
    weights in symmetric blocks of `bits` along K (the op's default zero point, 2^(bits-1)), with
    accuracy_level 4 as the MatMulNBits weights have. A note for the report; None without experts."""
    from onnx import helper, numpy_helper

    from .optimize import _names_read

    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    converted, kept, replaced = 0, 0, set()
    for index, node in enumerate(list(graph.node)):
        if node.op_type != "MoE" or node.domain != "com.microsoft":
            continue
        fc1, fc2 = (numpy_helper.to_array(initializers[node.input[i]]) for i in (2, 4))
        if fc1.shape[2] % block_size or fc2.shape[2] % block_size:  # the op's blocks divide both sizes
            kept += 1
            continue
        inputs = [node.input[0], node.input[1]]
        biases = [node.input[i] if len(node.input) > i else "" for i in (3, 5)]  # MoE's fc1 and fc2 biases
        for name, weight, bias in ((node.input[2], fc1, biases[0]), (node.input[4], fc2, biases[1])):
            codes, scales = _expert_blocks(weight, bits, block_size)
            graph.initializer.extend([numpy_helper.from_array(codes, f"{name}.q{bits}"),
                                      numpy_helper.from_array(scales, f"{name}.scales")])
            inputs += [f"{name}.q{bits}", f"{name}.scales", bias]
        while not inputs[-1]:
            inputs.pop()
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        # weights_prepacked 0: the raw [experts, N, K * bits / 8] codes written here, not a provider's layout
        quantized = helper.make_node("QMoE", inputs, list(node.output), name=node.name, domain="com.microsoft",
                                     expert_weight_bits=bits, block_size=block_size, accuracy_level=4,
                                     weights_prepacked=0, **attributes)
        graph.node.remove(node)
        graph.node.insert(index, quantized)
        replaced |= {node.input[2], node.input[4]}
        converted += 1
    if not converted and not kept:
        return None
    read = _names_read(graph) | {output.name for output in graph.output}
    for tensor in [t for t in graph.initializer if t.name in replaced - read]:  # the experts' fp32 weights
        graph.initializer.remove(tensor)
    note = (f"{converted} MoE layers as QMoE, {bits}-bit experts in symmetric blocks of {block_size}, rounded to "
            "the nearest level (exclude, rounding: gptq and smoothing apply to the MatMul weights only)")
    return note + (f"; {kept} kept fp32 (sizes not divisible by the block)" if kept else "")


def _expert_blocks(weight: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[experts, N, K] fp32 -> QMoE's raw codes [experts, N, K * bits / 8] (4-bit pairs low nibble first)
    and scales [experts, N, K / block_size]: symmetric about 2^(bits-1)."""
    experts, rows, columns = weight.shape
    codes, scales = _symmetric_codes(weight.reshape(experts, rows, columns // block_size, block_size), bits)
    codes = codes.reshape(experts, rows, columns)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(codes), scales


def untie_transposed_weights(proto: Any, base_dir: str = "") -> None:
    """MatMul(x, Transpose(W)) with W an initializer -> MatMul(x, W^T) with W^T stored.

    A tied LM head reads the embedding table through a Transpose; MatMulNBits and QDQ weight
    quantization need the weight as an initializer. The embedding itself stays fp32 for the Gather.
    For a proto loaded without its external data, `base_dir` is where W's is read from (W's alone).
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
        weight = numpy_helper.to_array(inits[node.input[0]], base_dir)
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
        from runtime.backends.base import expand

        stream = [t for p in prompts for t in p]
        prompts = [stream[i:i + CALIBRATION_CHUNK] for i in range(0, len(stream) - CALIBRATION_CHUNK + 1,
                                                                   CALIBRATION_CHUNK)]

        interface = Interface.of(source.interface)
        shared = interface.shared_buffers
        names = expand(interface.past, interface.layers)
        kv = (interface.kv_heads, interface.head_dim)
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
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

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
