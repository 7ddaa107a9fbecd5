"""Fusion rules for the LayerNorm families (Phi, GPT-NeoX, Falcon, OLMo, StableLM, Starcoder2, GPT-2):
residual Add + LayerNormalization -> SkipLayerNormalization, and GELU -> com.microsoft Gelu / FastGelu.

Most are the onnxscript rewriter's own (ort_fusions/skip_normalization.py, gelu.py, erfgelu.py),
matched on what the dynamo exporter emits; two are ours, for shapes of the same math that those
rules do not match (below). The fused graph is then checked against the unfused one like every fusion.

    a ─Add b─LayerNormalization(gamma, beta)─>          =>   SkipLayerNormalization (also returns a + b)
    a ─Add b─LayerNormalization(gamma)─>                =>   SkipLayerNormalization, no beta (OLMo: ours)
    x ─Mul 0.5 x (1 + Erf(x / sqrt 2))─>                =>   Gelu
    x ─x (0.5 (1 + Tanh(sqrt(2/pi) (x + 0.044715 x^3))))─> =>  FastGelu
    x ─(0.5 x) (1 + Tanh(...))─>                        =>   FastGelu (gelu_new: Phi, GPT-2; ours)
"""

from __future__ import annotations

import functools
import math
from typing import Any

SKIP_NAME = "skip_layer_normalization"
GELU_NAME = "gelu"


def apply_skip(model: Any, shapes: Any) -> int:
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_layer_normalization

    from .rms_normalization import statistics_dropped

    count = int(fuse_skip_layer_normalization(model)) + int(_ours()["skip_without_beta"].apply_to_model(model))
    statistics_dropped(model, "SkipLayerNormalization")
    return count


def apply_gelu(model: Any, shapes: Any) -> int:
    from onnxscript.rewriter.ort_fusions.erfgelu import fuse_erfgelu
    from onnxscript.rewriter.ort_fusions.gelu import fuse_gelu

    return int(fuse_erfgelu(model)) + int(fuse_gelu(model)) + int(_ours()["gelu_new"].apply_to_model(model))


@functools.cache
def _ours() -> dict[str, Any]:
    """The two rules of ours, built on first use (onnxscript is a compiler-only dependency)."""
    from onnxscript.rewriter import _fusion_utils, pattern

    class SkipLayerNormWithoutBeta(pattern.RewriteRuleClassBase):
        """OLMo's LayerNorm has neither weight nor bias: the exporter writes LayerNormalization with a
        scale of ones and no bias input, which onnxscript's rule (it binds a beta) does not match."""

        def pattern(self, op, input, skip, gamma):
            skip_sum = op.Add(input, skip)
            normalized = op.LayerNormalization(skip_sum, gamma, axis=-1, _allow_other_attributes=True,
                                               _outputs=["layer_norm"])
            return normalized, skip_sum

        def check(self, op, input, skip, gamma, layer_norm, **_) -> Any:
            result, bindings = pattern.MatchResult(), {}
            for value, dims in ((input, ["B", "S", "D"]), (skip, ["B", "S", "D"]), (gamma, ["D"])):
                if not _fusion_utils.check_shape_bool(bindings, value, dims):
                    return result.fail(f"{value} is not of shape {dims}", value)
            if layer_norm.producer().attributes.get_int("stash_type", 1) != 1:
                return result.fail("stash_type other than 1 is not supported")
            return result

        def rewrite(self, op, input, skip, gamma, layer_norm, **_):
            epsilon = layer_norm.producer().attributes.get_float("epsilon", 1e-5)
            normalized, _mean, _inv_std, skip_sum = op.SkipLayerNormalization(
                input, skip, gamma, epsilon=epsilon, _outputs=4, _domain="com.microsoft")
            return normalized, skip_sum

    class GeluNew(pattern.RewriteRuleClassBase):
        """transformers' gelu_new (NewGELUActivation) exports as (0.5 x) * (1 + tanh(...)) with
        Pow(x, 3.0); onnxscript's tanh rule wants x * (0.5 * (1 + tanh(...))), the same function."""

        def pattern(self, op, x):
            inner = op.Add(x, op.Mul(op.Pow(x, 3.0), 0.044715))
            return op.Mul(op.Mul(x, 0.5), op.Add(op.Tanh(op.Mul(inner, math.sqrt(2.0 / math.pi))), 1.0))

        def rewrite(self, op, x):
            return op.FastGelu(x, _domain="com.microsoft")

    return {"skip_without_beta": pattern.RewriteRuleSet([SkipLayerNormWithoutBeta.rule()], commute=True),
            "gelu_new": pattern.RewriteRuleSet([GeluNew.rule()], commute=True)}
