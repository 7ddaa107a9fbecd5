"""Fusion rules for the LayerNorm families (Phi, GPT-NeoX, Falcon, OLMo, StableLM, Starcoder2, GPT-2):
residual Add + LayerNormalization -> SkipLayerNormalization, and GELU -> com.microsoft Gelu / FastGelu.

Like the RMSNorm rules, these are the onnxscript rewriter's own (ort_fusions/skip_normalization.py,
gelu.py, erfgelu.py), matched on what the dynamo exporter emits; the fused graph is then checked
against the unfused one like every fusion.

    a ─Add b─LayerNormalization─>                       =>   SkipLayerNormalization (also returns a + b)
    x ─Mul 0.5 x (1 + Erf(x / sqrt 2))─>                =>   Gelu
    x ─0.5 x (1 + Tanh(sqrt(2/pi) (x + 0.044715 x^3)))─> =>   FastGelu
"""

from __future__ import annotations

from typing import Any

SKIP_NAME = "skip_layer_normalization"
GELU_NAME = "gelu"


def apply_skip(model: Any, shapes: Any) -> int:
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_layer_normalization

    return int(fuse_skip_layer_normalization(model))


def apply_gelu(model: Any, shapes: Any) -> int:
    from onnxscript.rewriter.ort_fusions.erfgelu import fuse_erfgelu
    from onnxscript.rewriter.ort_fusions.gelu import fuse_gelu

    return int(fuse_erfgelu(model)) + int(fuse_gelu(model))
