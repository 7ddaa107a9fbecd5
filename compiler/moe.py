"""Mixture-of-experts layers exported as ONNX Runtime's fused MoE op, registered with transformers'
ExpertsInterface.

transformers' own experts loop over the experts a batch hit (`nonzero` over the router's top-k), a
data-dependent loop torch.onnx cannot translate. Its `batched_mm` form exports, but gathers a whole
weight matrix per token and expert. Here the experts of a layer are one torch op, `kiln::moe_experts`,
that the export translates to one `com.microsoft.MoE` node: ONNX Runtime's kernel runs each token
through its k experts only.

The routing stays the family's own (softmax or sigmoid, renormalized or not, PhiMoE's sparse mixer),
traced as transformers computes it. The MoE op routes by itself (softmax, top-k, optionally
renormalized), so it is given routing logits that reproduce the family's weights w exactly:

    logits = log(w) at the k chosen experts, -inf elsewhere  ->  softmax = w / sum(w)
    output = MoE(x, logits, k) * sum(w)

The gate and up projections are interleaved row by row ([g0, u0, g1, u1, ...]: the layout ONNX Runtime's
CPU kernel takes, `swiglu_fusion=1`) in the weights themselves before the export.
"""

from __future__ import annotations

from typing import Any

NAME = "kiln_moe"
INTERLEAVED = "_kiln_interleaved"  # set on an experts module whose gate_up_proj rows are interleaved


def _check(module: Any) -> str | None:
    """Why these experts cannot be the MoE op (None: they can): ONNX Runtime's CPU kernel computes
    SwiGLU experts without biases, stored [experts, out, in]."""
    import torch
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(module, "has_gate", False) or not hasattr(module, "gate_up_proj"):
        return "experts without a gate projection"
    if getattr(module, "has_bias", False):
        return "experts with biases"
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        return "experts stored transposed or interleaved"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    if type(module)._apply_gate is not _default_apply_gate:
        return "a gate function of its own"
    if not isinstance(getattr(module, "act_fn", None), torch.nn.SiLU | SiLUActivation):
        return f"a {type(getattr(module, 'act_fn', None)).__name__} gate (the MoE op's SwiGLU takes SiLU)"
    return None


def experts_modules(model: Any) -> list[Any]:
    """The model's experts modules: transformers' @use_experts_implementation classes, which its
    __init__ gives these attributes."""
    return [m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]


def why_not_exportable(model: Any) -> str | None:
    reasons = {reason for reason in map(_check, experts_modules(model)) if reason}
    return "; ".join(sorted(reasons)) or None


def interleave(gate_up: Any) -> Any:
    """[experts, 2 * inter, hidden] as [gate | up] -> [g0, u0, g1, u1, ...] along the rows."""
    experts, rows, hidden = gate_up.shape
    return gate_up.reshape(experts, 2, rows // 2, hidden).transpose(1, 2).reshape(experts, rows, hidden)


def prepare_for_export(model: Any) -> int:
    """Interleave each experts module's gate and up rows in place (what the MoE op reads) and route its
    forward through `kiln::moe_experts`; the number of experts modules."""
    import torch

    modules = experts_modules(model)
    if modules:
        register()
    for module in modules:
        if not getattr(module, INTERLEAVED, False):
            with torch.no_grad():
                module.gate_up_proj.data = interleave(module.gate_up_proj.data).contiguous()
            setattr(module, INTERLEAVED, True)
        module.config._experts_implementation = NAME
    return len(modules)


def moe_experts_reference(x: Any, top_k_index: Any, top_k_weights: Any, fc1: Any, fc2: Any) -> Any:
    """What the MoE op computes, in torch: each token through its chosen experts (fc1 interleaved),
    weighted and summed. Dense over the experts, for the eager path and the fake tensor's shape."""
    import torch

    selected_fc1 = fc1[top_k_index]  # [tokens, k, 2 * inter, hidden]
    projected = torch.einsum("tkoh,th->tko", selected_fc1, x)
    gate, up = projected[..., 0::2], projected[..., 1::2]
    hidden = torch.nn.functional.silu(gate) * up
    out = torch.einsum("tkhi,tki->tkh", fc2[top_k_index], hidden)
    return (out * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)


def _moe_schema() -> Any:
    """ONNX Runtime's MoE contrib op as an ONNX schema (ONNX's registry holds none of com.microsoft's ops,
    and the exporter builds nodes from a schema): the inputs and attributes this translation uses."""
    from onnx.defs import OpSchema

    def tensor(name: str, optional: bool = False) -> Any:
        option = OpSchema.FormalParameterOption.Optional if optional else OpSchema.FormalParameterOption.Single
        return OpSchema.FormalParameter(name, "T", param_option=option)

    attribute = OpSchema.Attribute
    kinds = OpSchema.AttrType
    return OpSchema(
        "MoE", "com.microsoft", 1,
        inputs=[tensor("input"), tensor("router_probs"), tensor("fc1_experts_weights"),
                tensor("fc1_experts_bias", True), tensor("fc2_experts_weights")],
        outputs=[tensor("output")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
        attributes=[attribute("k", kinds.INT, ""), attribute("activation_type", kinds.STRING, ""),
                    attribute("swiglu_fusion", kinds.INT, ""), attribute("activation_alpha", kinds.FLOAT, ""),
                    attribute("activation_beta", kinds.FLOAT, ""),
                    attribute("normalize_routing_weights", kinds.INT, "")])


SCHEMA = "(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor fc1, Tensor fc2, int k) -> Tensor"
_registered = False


def register() -> str:
    """The torch op, its ONNX translation's table entry (translation_table) and the experts function."""
    global _registered
    if _registered:
        return NAME
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    @torch.library.custom_op("kiln::moe_experts", mutates_args=(), schema=SCHEMA)
    def moe_experts(x, top_k_index, top_k_weights, fc1, fc2, k):
        return moe_experts_reference(x, top_k_index, top_k_weights, fc1, fc2)

    @moe_experts.register_fake
    def _(x, top_k_index, top_k_weights, fc1, fc2, k):
        return torch.empty_like(x)

    def experts_forward(module: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        fc1 = module.gate_up_proj if getattr(module, INTERLEAVED, False) else interleave(module.gate_up_proj)
        out = torch.ops.kiln.moe_experts(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype),
                                         fc1, module.down_proj, top_k_index.shape[-1])
        return out.to(hidden_states.dtype)

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
    _registered = True
    return NAME


def translation_table(dense: bool = False) -> dict[Any, Any]:
    """torch.onnx's custom translation of `kiln::moe_experts`: one com.microsoft.MoE node, or with
    `dense`, every expert over every token in standard ONNX ops (the unfused form)."""
    import torch
    from onnxscript import opset18 as op
    from onnxscript import values

    register()
    moe_op = values.Op(values.Opset("com.microsoft", 1), "MoE", _moe_schema())

    def routing(top_k_index, top_k_weights, x, fc1, fill: float, values_at_k):
        """[tokens, experts]: values_at_k at each token's chosen experts, `fill` elsewhere."""
        tokens, experts = op.Shape(x, start=0, end=1), op.Shape(fc1, start=0, end=1)
        blank = op.Expand(op.Constant(value_float=fill), op.Concat(tokens, experts, axis=0))
        return op.ScatterElements(blank, top_k_index, values_at_k, axis=1)

    def fused(x, top_k_index, top_k_weights, fc1, fc2, k: int):
        logits = routing(top_k_index, top_k_weights, x, fc1, float("-inf"), op.Log(top_k_weights))
        routed = moe_op(x, logits, fc1, None, fc2, k=k, activation_type="swiglu", swiglu_fusion=1,
                        activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=0)
        return op.Mul(routed, op.ReduceSum(top_k_weights, op.Constant(value_ints=[1]), keepdims=1))

    def unfused(x, top_k_index, top_k_weights, fc1, fc2, k: int):
        weights = routing(top_k_index, top_k_weights, x, fc1, 0.0, top_k_weights)  # [tokens, experts]
        projected = op.Einsum(x, fc1, equation="th,eoh->eto")  # [experts, tokens, 2 * inter], interleaved
        pairs = op.Reshape(projected, op.Constant(value_ints=[0, 0, -1, 2]))
        gate, up = op.Split(pairs, axis=3, num_outputs=2)
        hidden = op.Squeeze(op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), op.Constant(value_ints=[3]))
        out = op.Einsum(hidden, fc2, equation="eti,ehi->eth")
        scale = op.Unsqueeze(op.Transpose(weights, perm=[1, 0]), op.Constant(value_ints=[2]))
        return op.ReduceSum(op.Mul(out, scale), op.Constant(value_ints=[0]), keepdims=0)

    return {torch.ops.kiln.moe_experts.default: unfused if dense else fused}
