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

That holds for weights w >= 0, which every router Kiln has met gives (softmax or sigmoid scores,
renormalized or not); a router with learned signed scales would need `export.experts: dense`, and the
validation against eager is what would catch one.

The weights are put in the op's layout in place before the export: [experts, out, in], the gate and up
rows interleaved ([g0, u0, g1, u1, ...]: what ONNX Runtime's CPU kernel takes, `swiglu_fusion=1`).
The op's SwiGLU, G * sigmoid(alpha * G) * (L + beta) with G and L optionally clamped, covers SiLU-gated
experts (alpha 1, beta 0) and GPT-OSS's clamped one (1.702, 1, 7); which one a module computes is
checked on its own gate function, numerically, not read from its class name.
"""

from __future__ import annotations

from typing import Any

NAME = "kiln_moe"
OP_LAYOUT = "_kiln_op_layout"  # set on an experts module whose weights are already in the op's layout


def gate_parameters(module: Any) -> tuple[float, float, float | None] | None:
    """The (alpha, beta, limit) of the MoE op's SwiGLU that the module's gate function computes, found by
    running it on its own layout (concatenated or interleaved halves) with values large enough to reach a
    clamp; None where it is no such SwiGLU (a GELU gate, say)."""
    import torch

    candidates = [(1.0, 0.0, None)]
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if isinstance(alpha, int | float) and isinstance(limit, int | float):
        candidates.append((float(alpha), 1.0, float(limit)))
    generator = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(4, 16, generator=generator) * 10 for _ in range(2))
    packed = torch.cat([gate, up], -1) if module.is_concatenated else torch.stack([gate, up], -1).reshape(4, 32)
    with torch.no_grad():
        got = module._apply_gate(packed)
    for alpha, beta, limit in candidates:
        clamped_gate = gate if limit is None else gate.clamp(max=limit)
        clamped_up = up if limit is None else up.clamp(-limit, limit)
        if torch.allclose(got, clamped_gate * torch.sigmoid(alpha * clamped_gate) * (clamped_up + beta), atol=1e-5):
            return alpha, beta, limit
    return None


def _check(module: Any) -> str | None:
    """Why these experts cannot be the MoE op (None: they can)."""
    if not module.has_gate:
        return "experts without a gate projection"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    if gate_parameters(module) is None:
        return "a gate that is not a SwiGLU, clamped or not"
    return None


def experts_modules(model: Any) -> list[Any]:
    """The model's experts modules: transformers' @use_experts_implementation classes, which its
    __init__ gives these attributes."""
    return [m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]


def why_not_exportable(model: Any) -> str | None:
    reasons = {reason for reason in map(_check, experts_modules(model)) if reason}
    return "; ".join(sorted(reasons)) or None


def interleave(gate_up: Any) -> Any:
    """[experts, 2 * inter, ...] as [gate | up] -> [g0, u0, g1, u1, ...] along dimension 1."""
    experts, rows, *rest = gate_up.shape
    return gate_up.reshape(experts, 2, rows // 2, *rest).transpose(1, 2).reshape(gate_up.shape)


def op_layout(module: Any) -> tuple[Any, Any, Any, Any]:
    """The module's fc1 [experts, 2 * inter, hidden] (gate and up interleaved), fc2 [experts, hidden,
    inter] and their biases (or None), as the MoE op takes them."""
    fc1, fc2 = module.gate_up_proj, module.down_proj
    bias1 = module.gate_up_proj_bias if module.has_bias else None
    bias2 = module.down_proj_bias if module.has_bias else None
    if getattr(module, OP_LAYOUT, False):
        return fc1, fc2, bias1, bias2
    if module.is_transposed:  # stored [experts, in, out]
        fc1, fc2 = fc1.transpose(1, 2), fc2.transpose(1, 2)
    if module.is_concatenated:
        fc1 = interleave(fc1)
        bias1 = None if bias1 is None else interleave(bias1)
    return fc1, fc2, bias1, bias2


def prepare_for_export(model: Any) -> int:
    """Put each experts module's weights in the op's layout in place and route its forward through
    `kiln::moe_experts`; the number of experts modules."""
    import torch

    modules = experts_modules(model)
    if modules:
        register()
    for module in modules:
        if not getattr(module, OP_LAYOUT, False):
            laid_out = op_layout(module)
            with torch.no_grad():
                for name, tensor in zip(("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"),
                                        laid_out, strict=True):
                    if tensor is not None:
                        getattr(module, name).data = tensor.detach().contiguous()
            module._kiln_gate = gate_parameters(module)
            setattr(module, OP_LAYOUT, True)
        module.config._experts_implementation = NAME
    return len(modules)


def moe_experts_reference(x: Any, top_k_index: Any, top_k_weights: Any, fc1: Any, fc2: Any, fc1_bias: Any,
                          fc2_bias: Any, alpha: float, beta: float, limit: float | None) -> Any:
    """What the MoE op computes, in torch: each token through its chosen experts (the op's layout),
    weighted and summed. For the eager path and the fake tensor's shape."""
    import torch

    projected = torch.einsum("tkoh,th->tko", fc1[top_k_index], x)
    if fc1_bias is not None:
        projected = projected + fc1_bias[top_k_index]
    gate, up = projected[..., 0::2], projected[..., 1::2]
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    hidden = gate * torch.sigmoid(alpha * gate) * (up + beta)
    out = torch.einsum("tkhi,tki->tkh", fc2[top_k_index], hidden)
    if fc2_bias is not None:
        out = out + fc2_bias[top_k_index]
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
                tensor("fc1_experts_bias", True), tensor("fc2_experts_weights"), tensor("fc2_experts_bias", True)],
        outputs=[tensor("output")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
        attributes=[attribute("k", kinds.INT, ""), attribute("activation_type", kinds.STRING, ""),
                    attribute("swiglu_fusion", kinds.INT, ""), attribute("activation_alpha", kinds.FLOAT, ""),
                    attribute("activation_beta", kinds.FLOAT, ""), attribute("swiglu_limit", kinds.FLOAT, ""),
                    attribute("normalize_routing_weights", kinds.INT, "")])


SCHEMA = ("(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor fc1, Tensor fc2, Tensor? fc1_bias, "
          "Tensor? fc2_bias, int k, float alpha, float beta, float? limit) -> Tensor")
_registered = False


def register() -> str:
    """The torch op, its ONNX translation's table entry (translation_table) and the experts function."""
    global _registered
    if _registered:
        return NAME
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    @torch.library.custom_op("kiln::moe_experts", mutates_args=(), schema=SCHEMA)
    def moe_experts(x, top_k_index, top_k_weights, fc1, fc2, fc1_bias, fc2_bias, k, alpha, beta, limit):
        return moe_experts_reference(x, top_k_index, top_k_weights, fc1, fc2, fc1_bias, fc2_bias, alpha, beta, limit)

    @moe_experts.register_fake
    def _(x, top_k_index, top_k_weights, fc1, fc2, fc1_bias, fc2_bias, k, alpha, beta, limit):
        return torch.empty_like(x)

    def experts_forward(module: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        fc1, fc2, fc1_bias, fc2_bias = op_layout(module)
        alpha, beta, limit = getattr(module, "_kiln_gate", None) or gate_parameters(module)
        out = torch.ops.kiln.moe_experts(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), fc1, fc2,
                                         fc1_bias, fc2_bias, top_k_index.shape[-1], alpha, beta, limit)
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

    def routing(top_k_index, x, fc1, fill: float, values_at_k):
        """[tokens, experts]: values_at_k at each token's chosen experts, `fill` elsewhere."""
        tokens, experts = op.Shape(x, start=0, end=1), op.Shape(fc1, start=0, end=1)
        blank = op.Expand(op.Constant(value_float=fill), op.Concat(tokens, experts, axis=0))
        return op.ScatterElements(blank, top_k_index, values_at_k, axis=1)

    def fused(x, top_k_index, top_k_weights, fc1, fc2, fc1_bias, fc2_bias, k: int, alpha: float, beta: float,
              limit: float | None):
        logits = routing(top_k_index, x, fc1, float("-inf"), op.Log(top_k_weights))
        clamp = {} if limit is None else {"swiglu_limit": limit}
        routed = moe_op(x, logits, fc1, fc1_bias, fc2, fc2_bias, k=k, activation_type="swiglu", swiglu_fusion=1,
                        activation_alpha=alpha, activation_beta=beta, normalize_routing_weights=0, **clamp)
        return op.Mul(routed, op.ReduceSum(top_k_weights, op.Constant(value_ints=[1]), keepdims=1))

    def unfused(x, top_k_index, top_k_weights, fc1, fc2, fc1_bias, fc2_bias, k: int, alpha: float, beta: float,
                limit: float | None):
        weights = routing(top_k_index, x, fc1, 0.0, top_k_weights)  # [tokens, experts]
        projected = op.Einsum(x, fc1, equation="th,eoh->eto")  # [experts, tokens, 2 * inter], interleaved
        if fc1_bias is not None:
            projected = op.Add(projected, op.Unsqueeze(fc1_bias, op.Constant(value_ints=[1])))
        pairs = op.Reshape(projected, op.Constant(value_ints=[0, 0, -1, 2]))
        gate, up = op.Split(pairs, axis=3, num_outputs=2)
        if limit is not None:
            gate = op.Min(gate, op.Constant(value_float=limit))
            up = op.Clip(up, op.Constant(value_float=-limit), op.Constant(value_float=limit))
        activated = op.Mul(op.Mul(gate, op.Sigmoid(op.Mul(gate, op.Constant(value_float=alpha)))),
                           op.Add(up, op.Constant(value_float=beta)))
        out = op.Einsum(op.Squeeze(activated, op.Constant(value_ints=[3])), fc2, equation="eti,ehi->eth")
        if fc2_bias is not None:
            out = op.Add(out, op.Unsqueeze(fc2_bias, op.Constant(value_ints=[1])))
        scale = op.Unsqueeze(op.Transpose(weights, perm=[1, 0]), op.Constant(value_ints=[2]))
        return op.ReduceSum(op.Mul(out, scale), op.Constant(value_ints=[0]), keepdims=0)

    return {torch.ops.kiln.moe_experts.default: unfused if dense else fused}
