"""Export validation: the ONNX graph under ONNX Runtime against the eager torch model, at several shapes.

Each case is a step the runtime will really take: a prefill (past = 0) or a step on top of a real
KV cache, which eager torch builds by prefilling a random prefix first, so the cache holds values of
realistic size. Rows are left-padded as the runtime pads them. Only real (unpadded) positions are
compared: what a model computes at a pad position is masked out of every later step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .eager import REFERENCE_ATTENTION
from .errors import ExportMismatch
from .export import INPUTS, _make_wrapper, kv_names
from .families import Shapes, shapes_of
from .graph import OnnxArtifact
from .load import Checkpoint

# fp32 tolerance, relative to the largest |logit| (resp. |KV value|) of the reference.
# ONNX Runtime and torch run the same fp32 arithmetic in different kernel orders (MLAS vs oneDNN
# GEMM blocking, fused vs unfused softmax); each of L layers adds rounding of order sqrt(K) * 2^-24
# relative for a K-long dot product. For K up to 8192 and 40 layers that stays near 1e-5; measured
# errors here are 1e-6 (tiny models) to 3e-6 (SmolLM2, 30 layers). A real export bug (wrong rotary
# position, mask, cache order) moves logits by 1e-2 or more relative, so 1e-4 separates the two
# with room on both sides.
RELATIVE_TOLERANCE = 1e-4



@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seq: int
    past: int
    pads: tuple[int, ...]  # left padding per row, counted over the whole past + seq window


CASES = (
    Case("prefill, batch 1", 1, 7, 0, (0,)),
    Case("prefill, batch 3, left-padded", 3, 9, 0, (0, 3, 6)),
    Case("decode, batch 1, past 20", 1, 1, 20, (0,)),
    Case("decode, batch 3, left-padded, past 12", 3, 1, 12, (0, 2, 7)),
    Case("chunk of 4, batch 3, left-padded, past 8", 3, 4, 8, (0, 1, 5)),
)


@dataclass(frozen=True)
class EagerCase:
    """One case as eager torch ran it: the graph's feed and torch's outputs (logits, present KV)."""

    case: Case
    feed: dict[str, np.ndarray]
    reference: list[np.ndarray]
    mask: np.ndarray


def eager_cases(checkpoint: Checkpoint, logits: str, seed: int = 0) -> list[EagerCase]:
    """Every case through eager torch, recorded before the export (which is the model's last use) for
    the graph to be checked against later. Small: batch 3, 21 tokens at most."""
    checkpoint.model.set_attn_implementation(REFERENCE_ATTENTION)
    shapes = shapes_of(checkpoint.config)
    wrapper = _make_wrapper(checkpoint.model, shapes.layers, logits)
    rng = np.random.default_rng(seed)
    return [_eager_case(case, wrapper, shapes, rng) for case in CASES]


def validate_export(eager: list[EagerCase], exported: OnnxArtifact,
                    on_case: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every case under ONNX Runtime against eager's outputs; return the metrics for the manifest, or
    raise ExportMismatch with them."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(exported.model_path), providers=["CPUExecutionProvider"])
    results = []
    for run in eager:
        results.append({"case": run.case.name, **_compare(run.reference, session.run(None, run.feed), run.mask)})
        if on_case:
            on_case(run.case.name)
    del session
    summary = {
        "tolerance_relative": RELATIVE_TOLERANCE,
        "max_abs_logit_error": max(r["max_abs_logit_error"] for r in results),
        "max_rel_logit_error": max(r["max_rel_logit_error"] for r in results),
        "max_abs_kv_error": max(r["max_abs_kv_error"] for r in results),
        "max_rel_kv_error": max(r["max_rel_kv_error"] for r in results),
        "top1_agreement": min(r["top1_agreement"] for r in results),
        "cases": results,
    }
    worst = max(summary["max_rel_logit_error"], summary["max_rel_kv_error"])
    if not worst <= RELATIVE_TOLERANCE:  # also catches NaN
        bad = max(results, key=lambda r: max(r["max_rel_logit_error"], r["max_rel_kv_error"]))
        raise ExportMismatch(
            f"ONNX Runtime disagrees with eager torch beyond the fp32 tolerance {RELATIVE_TOLERANCE:g} "
            f"in case '{bad['case']}': logits max abs {bad['max_abs_logit_error']:.3g} "
            f"(relative {bad['max_rel_logit_error']:.3g}), present KV max abs {bad['max_abs_kv_error']:.3g} "
            f"(relative {bad['max_rel_kv_error']:.3g})"
        )
    return summary


def _eager_case(case: Case, wrapper: Any, shapes: Shapes, rng: np.random.Generator) -> EagerCase:
    import torch

    total = case.past + case.seq
    ids = torch.from_numpy(rng.integers(0, shapes.vocab_size, (case.batch, total)))
    mask = torch.ones(case.batch, total, dtype=torch.int64)
    for row, pad in enumerate(case.pads):
        mask[row, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    past = _eager_prefix_cache(wrapper, ids, mask, positions, case.past, shapes)
    step = (ids[:, case.past:], mask, positions[:, case.past:])
    with torch.no_grad():
        reference = [t.numpy() for t in wrapper(*step, *past)]
    feed = dict(zip(INPUTS, (t.numpy() for t in step), strict=True))
    feed.update(zip(kv_names(shapes.layers, "past_key_values"), (t.numpy() for t in past), strict=True))
    return EagerCase(case, feed, reference, mask.numpy())


def _eager_prefix_cache(wrapper: Any, ids: Any, mask: Any, positions: Any, past: int, shapes: Any) -> list:
    import torch

    if past == 0:
        return [torch.zeros(ids.shape[0], shapes.kv_heads, 0, shapes.head_dim) for _ in range(2 * shapes.layers)]
    empty = _eager_prefix_cache(wrapper, ids, mask, positions, 0, shapes)
    with torch.no_grad():
        out = wrapper(ids[:, :past], mask[:, :past], positions[:, :past], *empty)
    return list(out[1:])


def _compare(reference: list, actual: list, mask: np.ndarray) -> dict:
    ref_logits, out_logits = reference[0], actual[0]
    real_rows = mask[:, -ref_logits.shape[1]:].astype(bool)  # which logits positions are real tokens
    logit_err = np.abs(out_logits - ref_logits)[real_rows]
    kv_real = mask.astype(bool)[:, None, :, None]  # broadcast over heads and head_dim
    kv_pairs = list(zip(reference[1:], actual[1:], strict=True))
    kv_err = max(float(np.abs(o - r).max(where=kv_real, initial=0.0)) for r, o in kv_pairs)
    kv_scale = max(float(np.abs(r).max(where=kv_real, initial=0.0)) for r in reference[1:])
    logit_scale = float(np.abs(ref_logits[real_rows]).max())
    agree = np.argmax(out_logits, -1)[real_rows] == np.argmax(ref_logits, -1)[real_rows]
    return {
        "max_abs_logit_error": float(logit_err.max()),
        "max_rel_logit_error": float(logit_err.max()) / max(logit_scale, 1e-12),
        "max_abs_kv_error": kv_err,
        "max_rel_kv_error": kv_err / max(kv_scale, 1e-12),
        "top1_agreement": float(agree.mean()),
    }
