"""Grouped-query attention written for export, registered with transformers' AttentionInterface.

transformers' eager attention repeats each KV head for its group of query heads (repeat_kv), which
in the graph is an Expand that copies the whole key and value cache of every layer at every step.
Folding the group into the query's sequence axis computes the same thing on the unrepeated cache:

    query [b, heads, s, d] ──reshape──> [b, kv, g*s, d] ─┐
    key   [b, kv, t, d] ──transpose──> [b, kv, d, t] ───MatMul──> scores [b, kv, g*s, t]
                                                            │ * scaling, + mask (broadcast over g)
                                                         Softmax (fp32)
    value [b, kv, t, d] ───────────────────────────────MatMul──> [b, kv, g*s, d]
                                                         reshape ─> [b, heads, s, d] ─> [b, s, heads, d]

Head h belongs to KV head h // g in transformers' repeat_kv, which is exactly the order the
reshape of the contiguous head axis produces. The 4-D key transpose is fused by ONNX Runtime into
FusedMatMul(transB), like eager attention's.
"""

from __future__ import annotations

from typing import Any

NAME = "kiln_grouped"
# Keyword arguments transformers passes that change nothing here (inference, no dropout; the mask
# already holds causality and the window; position information is already in query and key).
IGNORED_KWARGS = {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal",
                  "output_attentions", "cache_position", "layer_idx", "use_cache", "output_router_logits"}


def grouped_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float,
                      dropout: float = 0.0, softcap: float | None = None, sliding_window: int | None = None,
                      s_aux: Any = None, **kwargs: Any) -> tuple[Any, None]:
    """`sliding_window` is applied by the mask transformers builds for the layer; `softcap` (Gemma 2)
    as its eager attention does: scores / cap, tanh, * cap, before the mask; `s_aux` (GPT-OSS's
    attention sinks, a logit a query head) joins each row's softmax as one more column, then is dropped."""
    import torch

    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in IGNORED_KWARGS)
    if unknown:  # something this attention does not compute: refuse rather than export a wrong graph
        raise NotImplementedError(f"Kiln's grouped attention does not implement {', '.join(unknown)}")
    batch, heads, seq, head_dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    group = heads // kv_heads
    grouped_query = query.reshape(batch, kv_heads, group * seq, head_dim)
    scores = torch.matmul(grouped_query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :total].unsqueeze(2)  # [b, 1, 1, s, t], shared by the group
        scores = scores.reshape(batch, kv_heads, group, seq, total) + mask
        scores = scores.reshape(batch, kv_heads, group * seq, total)
    if s_aux is not None:
        sinks = s_aux.reshape(1, kv_heads, group, 1, 1).to(scores.dtype)
        scores = scores.reshape(batch, kv_heads, group, seq, total)
        scores = torch.cat([scores, sinks.expand(batch, kv_heads, group, seq, 1)], dim=-1)
        weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32)[..., :total]
        weights = weights.reshape(batch, kv_heads, group * seq, total).to(query.dtype)
    else:
        weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(weights, value).reshape(batch, heads, seq, head_dim)
    return output.transpose(1, 2).contiguous(), None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, grouped_attention)
    # The additive float mask that eager attention takes (an unknown name would get SDPA's boolean one).
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME
