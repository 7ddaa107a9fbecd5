# ruff: noqa: E501  (a data table copied from onnx-tensorrt; long restriction lines kept whole)
"""ONNX -> TensorRT (onnx-tensorrt parser) operator/dtype support table.

Source
------
Repository : https://github.com/onnx/onnx-tensorrt
Path       : docs/operators.md
Commit     : fa5aa9f61e7781d2ca8f5351d42c1f19525a6124
             (newest stored version found; it matches the "TensorRT 10.15 GA
             Release - 2026-2-2" entry in docs/Changelog.md)
Table for  : TensorRT 10.15, "operators in the inclusive range of opset 9 to
             opset 24".

Header notes in that file (paraphrased):
  * Data types TensorRT accepts from ONNX: DOUBLE, FLOAT32, FLOAT16, BFLOAT16,
    FP8, FP4, INT32, INT64, INT8, INT4, UINT8, BOOL.
  * DOUBLE has only limited support: TensorRT tries to cast it down to FLOAT and
    clamps values to +-FLT_MAX. No operator row lists DOUBLE.
  * INT8, INT4, FP8 and FP4 are "quantized types": you can use them only
    through quantization (Q/DQ) from a higher-precision float type.
  * UINT8 is allowed only for network input/output tensors.

How this module was built
-------------------------
* SUPPORTED_OPS has only the rows whose "Supported" column is "Y" (158 rows).
  Rows marked "N" are left out. The dtype lists are copied as the table gives
  them; the table already uses the short names. The one fix is a stray trailing
  comma in the Selu row. "FP4" appears in the table for Constant,
  ConstantOfShape and DequantizeLinear, so it is kept as a short name too.
* All ops are in the default ai.onnx domain. The table has no rows for custom
  or TensorRT-specific domains.
* NOTES repeats, one line per op, the "Restrictions" column for ops that an
  LLM decoder graph is likely to use. "(none stated)" means the table gives no
  restriction for that op. Text in [brackets] is NOT in the table; it comes from
  the parser source or the changelog, as marked.
  "[source: ...]" means QuantDequantLinearHelper() in onnx-tensorrt
  onnxOpImporters.cpp (a recent 10.x version whose commit was not pinned; it has
  the FP4/MX custom-op paths).
"""

from __future__ import annotations

TRT_VERSION = "10.15"
TABLE_SOURCE = "onnx/onnx-tensorrt docs/operators.md @ fa5aa9f6 (TensorRT 10.15)"
OPSET_RANGE = (9, 24)
SOURCE = {
    "repo": "onnx/onnx-tensorrt",
    "path": "docs/operators.md",
    "commit": "fa5aa9f61e7781d2ca8f5351d42c1f19525a6124",
    "tensorrt_version": TRT_VERSION,
}

# Short dtype names used in SUPPORTED_OPS.
DTYPES = frozenset({
    "FP32", "FP16", "BF16", "INT32", "INT64", "INT8", "INT4",
    "FP8", "FP4", "BOOL", "UINT8", "DOUBLE",
})

# op type (ai.onnx domain) -> dtypes the table lists as supported.
SUPPORTED_OPS: dict[str, frozenset[str]] = {
    'Abs': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Acos': frozenset({'FP32', 'FP16', 'BF16'}),
    'Acosh': frozenset({'FP32', 'FP16', 'BF16'}),
    'Add': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'And': frozenset({'BOOL'}),
    'ArgMax': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ArgMin': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Asin': frozenset({'FP32', 'FP16', 'BF16'}),
    'Asinh': frozenset({'FP32', 'FP16', 'BF16'}),
    'Atan': frozenset({'FP32', 'FP16', 'BF16'}),
    'Atanh': frozenset({'FP32', 'FP16', 'BF16'}),
    'Attention': frozenset({'FP32', 'FP16', 'BF16', 'INT8', 'FP8'}),
    'AveragePool': frozenset({'FP32', 'FP16', 'BF16'}),
    'BatchNormalization': frozenset({'FP32', 'FP16', 'BF16'}),
    'BlackmanWindow': frozenset({'FP32', 'FP16'}),
    'Cast': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'UINT8', 'BOOL'}),
    'CastLike': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'UINT8', 'BOOL'}),
    'Ceil': frozenset({'FP32', 'FP16', 'BF16'}),
    'Celu': frozenset({'FP32', 'FP16', 'BF16'}),
    'Clip': frozenset({'FP32', 'FP16', 'BF16'}),
    'Concat': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Constant': frozenset({'FP32', 'FP16', 'BF16', 'FP8', 'FP4', 'INT4', 'INT32', 'INT64', 'BOOL'}),
    'ConstantOfShape': frozenset({'FP32', 'FP16', 'BF16', 'FP8', 'FP4', 'INT4', 'INT32', 'INT64', 'BOOL'}),
    'Conv': frozenset({'FP32', 'FP16', 'BF16'}),
    'ConvTranspose': frozenset({'FP32', 'FP16', 'BF16'}),
    'Cos': frozenset({'FP32', 'FP16', 'BF16'}),
    'Cosh': frozenset({'FP32', 'FP16', 'BF16'}),
    'CumSum': frozenset({'FP32', 'FP16', 'BF16'}),
    'DeformConv': frozenset({'FP32', 'FP16'}),
    'DepthToSpace': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'DequantizeLinear': frozenset({'INT8', 'FP8', 'FP4', 'INT4'}),
    'Div': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Dropout': frozenset({'FP32', 'FP16', 'BF16'}),
    'Einsum': frozenset({'FP32', 'FP16', 'BF16'}),
    'Elu': frozenset({'FP32', 'FP16', 'BF16'}),
    'Equal': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Erf': frozenset({'FP32', 'FP16', 'BF16'}),
    'Exp': frozenset({'FP32', 'FP16', 'BF16'}),
    'Expand': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'EyeLike': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Flatten': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Floor': frozenset({'FP32', 'FP16', 'BF16'}),
    'Gather': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'GatherElements': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'GatherND': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Gelu': frozenset({'FP32', 'FP16', 'BF16', 'INT8', 'INT32', 'INT64'}),
    'Gemm': frozenset({'FP32', 'FP16', 'BF16'}),
    'GlobalAveragePool': frozenset({'FP32', 'FP16', 'BF16'}),
    'GlobalLpPool': frozenset({'FP32', 'FP16', 'BF16'}),
    'GlobalMaxPool': frozenset({'FP32', 'FP16', 'BF16'}),
    'Greater': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'GreaterOrEqual': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'GridSample': frozenset({'FP32', 'FP16'}),
    'GroupNormalization': frozenset({'FP32', 'FP16', 'BF16'}),
    'GRU': frozenset({'FP32', 'FP16', 'BF16'}),
    'HammingWindow': frozenset({'FP32', 'FP16'}),
    'HannWindow': frozenset({'FP32', 'FP16'}),
    'HardSigmoid': frozenset({'FP32', 'FP16', 'BF16'}),
    'HardSwish': frozenset({'FP32', 'FP16', 'BF16'}),
    'Hardmax': frozenset({'FP32', 'FP16', 'BF16'}),
    'Identity': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'If': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'ImageScaler': frozenset({'FP32', 'FP16', 'BF16'}),
    'InstanceNormalization': frozenset({'FP32', 'FP16', 'BF16'}),
    'IsInf': frozenset({'FP32', 'FP16', 'BF16'}),
    'IsNaN': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'LayerNormalization': frozenset({'FP32', 'FP16', 'BF16'}),
    'LeakyRelu': frozenset({'FP32', 'FP16', 'BF16'}),
    'Less': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'LessOrEqual': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Log': frozenset({'FP32', 'FP16', 'BF16'}),
    'LogSoftmax': frozenset({'FP32', 'FP16', 'BF16'}),
    'Loop': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'LRN': frozenset({'FP32', 'FP16', 'BF16'}),
    'LSTM': frozenset({'FP32', 'FP16', 'BF16'}),
    'LpNormalization': frozenset({'FP32', 'FP16', 'BF16'}),
    'LpPool': frozenset({'FP32', 'FP16', 'BF16'}),
    'MatMul': frozenset({'FP32', 'FP16', 'BF16'}),
    'Max': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'MaxPool': frozenset({'FP32', 'FP16', 'BF16'}),
    'Mean': frozenset({'FP32', 'FP16', 'BF16', 'FP8', 'INT32', 'INT64'}),
    'MeanVarianceNormalization': frozenset({'FP32', 'FP16', 'BF16'}),
    'Min': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Mish': frozenset({'FP32', 'FP16'}),
    'Mod': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Mul': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Neg': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'NonMaxSuppression': frozenset({'FP32', 'FP16'}),
    'NonZero': frozenset({'FP32', 'FP16'}),
    'Not': frozenset({'BOOL'}),
    'OneHot': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Or': frozenset({'BOOL'}),
    'Pad': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ParametricSoftplus': frozenset({'FP32', 'FP16', 'BF16'}),
    'Pow': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'PRelu': frozenset({'FP32', 'FP16', 'BF16'}),
    'QuantizeLinear': frozenset({'FP32', 'FP16', 'BF16'}),
    'RandomNormal': frozenset({'FP32', 'FP16', 'BF16'}),
    'RandomNormalLike': frozenset({'FP32', 'FP16', 'BF16'}),
    'RandomUniform': frozenset({'FP32', 'FP16', 'BF16'}),
    'RandomUniformLike': frozenset({'FP32', 'FP16', 'BF16'}),
    'Range': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Reciprocal': frozenset({'FP32', 'FP16', 'BF16'}),
    'ReduceL1': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ReduceL2': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ReduceLogSum': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ReduceLogSumExp': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ReduceMax': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ReduceMean': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ReduceMin': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ReduceProd': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ReduceSum': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ReduceSumSquare': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Relu': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Reshape': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Resize': frozenset({'FP32', 'FP16', 'BF16'}),
    'ReverseSequence': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'RMSNormalization': frozenset({'FP32', 'FP16', 'BF16'}),
    'RNN': frozenset({'FP32', 'FP16', 'BF16'}),
    'RoiAlign': frozenset({'FP32', 'FP16'}),
    'RotaryEmbedding': frozenset({'FP32', 'FP16', 'BF16'}),
    'Round': frozenset({'FP32', 'FP16', 'BF16'}),
    'STFT': frozenset({'FP32'}),
    'ScaledTanh': frozenset({'FP32', 'FP16', 'BF16'}),
    'Scan': frozenset({'FP32', 'FP16', 'BF16'}),
    'Scatter': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ScatterElements': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'ScatterND': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Selu': frozenset({'FP32', 'FP16', 'BF16'}),
    'Shape': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Shrink': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Sigmoid': frozenset({'FP32', 'FP16', 'BF16'}),
    'Sign': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Sin': frozenset({'FP32', 'FP16', 'BF16'}),
    'Sinh': frozenset({'FP32', 'FP16', 'BF16'}),
    'Size': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Slice': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Softmax': frozenset({'FP32', 'FP16', 'BF16'}),
    'Softplus': frozenset({'FP32', 'FP16', 'BF16'}),
    'Softsign': frozenset({'FP32', 'FP16', 'BF16'}),
    'SpaceToDepth': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Split': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Sqrt': frozenset({'FP32', 'FP16', 'BF16'}),
    'Squeeze': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Sub': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Sum': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Tan': frozenset({'FP32', 'FP16', 'BF16'}),
    'Tanh': frozenset({'FP32', 'FP16', 'BF16'}),
    'TensorScatter': frozenset({'FP32', 'FP16', 'BF16', 'INT32'}),
    'ThresholdedRelu': frozenset({'FP32', 'FP16', 'BF16'}),
    'Tile': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'TopK': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64'}),
    'Transpose': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Trilu': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Unsqueeze': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Upsample': frozenset({'FP32', 'FP16', 'BF16'}),
    'Where': frozenset({'FP32', 'FP16', 'BF16', 'INT32', 'INT64', 'BOOL'}),
    'Xor': frozenset({'BOOL'}),
}

# onnx.TensorProto.DataType name -> short name used above.
ONNX_TO_TRT_DTYPE: dict[str, str] = {
    "FLOAT": "FP32",
    "FLOAT16": "FP16",
    "BFLOAT16": "BF16",
    "INT32": "INT32",
    "INT64": "INT64",
    "INT8": "INT8",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
    "DOUBLE": "DOUBLE",  # limited support: cast down to FP32 (see docstring)
    "INT4": "INT4",
    "FLOAT8E4M3FN": "FP8",
    "FLOAT4E2M1": "FP4",  # extra entry: the table lists FP4 (changelog 10.8)
}

# Restrictions the table gives for ops common in LLM decoder graphs.
NOTES: dict[str, str] = {
    "MatMul": "(none stated); FP32/FP16/BF16 only - no INT32/INT64 and no INT8/FP8 listed (low precision only via Q/DQ); MatMulInteger is N.",
    "Gemm": "(none stated); FP32/FP16/BF16 only.",
    "Gather": "(none stated); FP32/FP16/BF16/INT32/INT64/BOOL.",
    "GatherElements": "(none stated).",
    "GatherND": "(none stated).",
    "Slice": "(none stated in 10.15) [older tables said `axes` must be an initializer; changelog 10.3 added tensor `axes`].",
    "Reshape": "(none stated); FP32/FP16/BF16/INT32/INT64/BOOL.",
    "Expand": "(none stated); FP32/FP16/BF16/INT32/INT64/BOOL.",
    "Range": "(none stated); FP32/FP16/BF16/INT32/INT64.",
    "Where": "(none stated); FP32/FP16/BF16/INT32/INT64/BOOL.",
    "Softmax": "(none stated); FP32/FP16/BF16.",
    "Concat": "(none stated); FP32/FP16/BF16/INT32/INT64/BOOL.",
    "Cast": "(none stated); FP32/FP16/BF16/INT32/INT64/UINT8/BOOL (no DOUBLE/INT8/FP8 listed).",
    "CastLike": "(none stated); same dtypes as Cast.",
    "QuantizeLinear": "`y_zero_point` must be 0; input FP32/FP16/BF16 [source: output FP8/INT8/INT4/FP4 only; per-tensor, per-axis (1-D scale) and blocked (one blocked dim) scales accepted].",
    "DequantizeLinear": "`x_zero_point` must be zero; input INT8/FP8/FP4/INT4 [source: UINT8 rejected unless the DLA flag is set; same per-axis/blocked handling as Q].",
    "DynamicQuantizeLinear": "NOT supported (N); can be composed as an ONNX local function mapping to IDynamicQuantize.",
    "LayerNormalization": "Only the first output `Y` is supported.",
    "RMSNormalization": "(none stated); FP32/FP16/BF16 (new in 10.15).",
    "RotaryEmbedding": "`position_ids` must be INT64 (new in 10.15).",
    "Attention": "Q, K, V, attn_mask must be 4D; past_key/past_value/nonpad_kv_seqlen inputs and present_key/present_value/qk_matmul_output outputs unsupported; qk_matmul_output_mode and softcap unsupported; head counts come from dim 1 of Q and K/V.",
    "TensorScatter": "`past_cache` and `update` must be 4D; `axis` must be -2; no INT64 listed.",
    "Trilu": "(none stated); FP32/FP16/BF16/INT32/INT64/BOOL.",
    "ScatterND": "`reduction` other than `none` is not supported.",
    "ScatterElements": "(none stated).",
    "Shape": "(none stated); FP32/FP16/BF16/INT32/INT64/BOOL.",
    "CumSum": "`axis` must be a build-time constant; FP32/FP16/BF16 only (no INT32/INT64).",
    "Pow": "(none stated); FP32/FP16/BF16/INT32/INT64.",
    "Sqrt": "(none stated); FP32/FP16/BF16.",
    "ReduceMean": "`axes` must be an initializer (the same rule applies to every Reduce* op).",
    "ReduceSum": "`axes` must be an initializer.",
    "ReduceMax": "`axes` must be an initializer.",
    "Squeeze": "`axes` must be resolvable to a constant.",
    "Unsqueeze": "`axes` must be resolvable to a constant.",
    "TopK": "`sorted` must be 1; `K` input must be less than 3840.",
    "ArgMax": "(none stated); FP32/FP16/BF16/INT32/INT64.",
    "OneHot": "`depth` must be a build-time constant.",
    "ConstantOfShape": "(none stated); FP32/FP16/BF16/FP8/FP4/INT4/INT32/INT64/BOOL.",
    "Constant": "`sparse_value`, `value_string`, `value_strings` attributes unsupported.",
    "EyeLike": "`input` must have static dimensions.",
    "Dropout": "`is_training` must be an initializer and evaluate to False.",
    "If": "Output tensors of the two branches must have the same rank and must have different names.",
    "Loop": "Scan output length cannot be dynamic; loop-carried dependency shapes must stay the same across iterations.",
    "Einsum": "(none stated in 10.15) [changelog 10.12 added ellipsis/diagonal/broadcasting].",
    "Gelu": "(none stated); FP32/FP16/BF16/INT8/INT32/INT64.",
    "Split": "(none stated).",
    "Transpose": "(none stated).",
    "Tile": "(none stated).",
    "Mod": "(none stated); FP32/FP16/BF16/INT32/INT64.",
    "Equal": "(none stated); FP32/FP16/BF16/INT32/INT64 (no BOOL listed).",
    "Not": "BOOL only.",
    "And": "BOOL only.",
    "Or": "BOOL only.",
    "IsNaN": "(none stated).",
    "IsInf": "(none stated); FP32/FP16/BF16.",
    "NonZero": "(none stated); FP32/FP16 only.",
}


def is_supported(op_type: str, dtype: str | None = None) -> bool:
    """True if op_type is marked Y. If dtype is given (short name or an onnx
    TensorProto name), it must also be in that op's listed dtypes."""
    types = SUPPORTED_OPS.get(op_type)
    if types is None:
        return False
    if dtype is None:
        return True
    return ONNX_TO_TRT_DTYPE.get(dtype, dtype) in types


__all__ = [
    "SUPPORTED_OPS", "ONNX_TO_TRT_DTYPE", "NOTES", "TRT_VERSION",
    "OPSET_RANGE", "SOURCE", "DTYPES", "is_supported",
]
