"""Accuracy of a variant against the fp32 reference graph, and the recipe's gates over it.

Both graphs run under ONNX Runtime through the runtime's own backend, so what is measured is what
ships. Two kinds of input:

- the held-out text (recipes/data/heldout.txt by default), teacher-forced: perplexity of both, its
  relative change, top-1 agreement and logit errors at every position;
- the validation prompts: the reference's greedy continuation of N tokens, then the variant
  teacher-forced over it (top-1 agreement, logit errors) and decoding greedily on its own (exact
  match rate and the first position where it parts from the reference).

The metric functions take numpy arrays only, so an A/B comparison against eager torch can use them
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.generator import left_padded

TEXT_ROW_TOKENS = 256  # the held-out text is scored as rows of this many tokens, decoded side by side
MAX_TEXT_TOKENS = 1024


# -- metrics on arrays ----------------------------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def perplexity(logits: Sequence[np.ndarray], targets: Sequence[Sequence[int]]) -> float:
    """exp(mean negative log-likelihood); logits[i][t] predicts targets[i][t]."""
    nll = [-log_softmax(lg)[np.arange(len(tg)), tg] for lg, tg in zip(logits, targets, strict=True)]
    return float(np.exp(np.concatenate(nll).mean()))


def agreement(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray]) -> dict[str, float]:
    ref, out = np.concatenate(reference), np.concatenate(candidate)
    error = np.abs(out - ref)
    return {"top1_agreement": float((ref.argmax(-1) == out.argmax(-1)).mean()),
            "max_logit_error": float(error.max()), "mean_logit_error": float(error.mean())}


def greedy_match(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> dict[str, Any]:
    firsts = [next((i for i, (a, b) in enumerate(zip(r, c, strict=True)) if a != b), None)
              for r, c in zip(reference, candidate, strict=True)]
    return {"greedy_match": float(np.mean([f is None for f in firsts])),
            "first_divergence": [f for f in firsts]}


# -- running a graph ------------------------------------------------------------------------------

@dataclass
class Inputs:
    text_rows: list[list[int]]  # held-out text, cut into rows
    prompts: list[list[int]]
    new_tokens: int
    pad_id: int


def teacher_forced(backend: Any, rows: Sequence[list[int]], pad_id: int) -> list[np.ndarray]:
    """Logits at every position of every row, [len(row), vocab], one decode step per column."""
    ids, mask = left_padded(rows, pad_id)
    width = ids.shape[1]
    cache = backend.new_cache(len(rows), width)
    steps = []
    for t in range(width):
        positions = np.clip(mask[:, :t + 1].sum(-1, keepdims=True) - 1, 0, None)
        logits, cache = backend.run(ids[:, t:t + 1], mask[:, :t + 1], positions, cache)
        steps.append(logits[:, -1])
    stacked = np.stack(steps, axis=1)  # [rows, width, vocab]
    return [stacked[i, width - len(row):] for i, row in enumerate(rows)]


def greedy(backend: Any, prompts: Sequence[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    """new_tokens greedy tokens per prompt, EOS ignored, so every row has the same length."""
    ids, mask = left_padded(prompts, pad_id)
    cache = backend.new_cache(len(prompts), ids.shape[1] + new_tokens)
    logits, cache = backend.run(ids, mask, np.clip(mask.cumsum(-1) - 1, 0, None), cache)
    tokens = []
    for _ in range(new_tokens):
        step = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        tokens.append(step[:, 0])
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        logits, cache = backend.run(step, mask, mask.sum(-1, keepdims=True) - 1, cache)
    return np.stack(tokens, axis=1).tolist()


@dataclass
class Reference:
    text_logits: list[np.ndarray]
    continuations: list[list[int]]
    prompt_logits: list[np.ndarray]  # teacher-forced over prompt + continuation, continuation positions only


def reference_run(backend: Any, inputs: Inputs) -> Reference:
    continuations = greedy(backend, inputs.prompts, inputs.new_tokens, inputs.pad_id)
    return Reference(teacher_forced(backend, inputs.text_rows, inputs.pad_id), continuations,
                     _continuation_logits(backend, inputs, continuations))


def _continuation_logits(backend: Any, inputs: Inputs, continuations: list[list[int]]) -> list[np.ndarray]:
    rows = [p + c for p, c in zip(inputs.prompts, continuations, strict=True)]
    logits = teacher_forced(backend, rows, inputs.pad_id)
    # Position len(prompt) - 1 predicts the first new token; the last position predicts nothing we keep.
    return [lg[len(p) - 1:-1] for lg, p in zip(logits, inputs.prompts, strict=True)]


def measure(backend: Any, inputs: Inputs, reference: Reference) -> dict[str, Any]:
    """Every metric of the variant behind `backend` against the reference run."""
    text_logits = teacher_forced(backend, inputs.text_rows, inputs.pad_id)
    targets = [row[1:] for row in inputs.text_rows]
    ppl_ref = perplexity([lg[:-1] for lg in reference.text_logits], targets)
    ppl = perplexity([lg[:-1] for lg in text_logits], targets)
    prompt_logits = _continuation_logits(backend, inputs, reference.continuations)
    text = agreement(reference.text_logits, text_logits)
    prompts = agreement(reference.prompt_logits, prompt_logits)
    matches = greedy_match(reference.continuations,
                           greedy(backend, inputs.prompts, inputs.new_tokens, inputs.pad_id))
    return {
        "perplexity_reference": ppl_ref, "perplexity": ppl, "perplexity_change": ppl / ppl_ref - 1,
        "perplexity_change_abs": abs(ppl / ppl_ref - 1),
        "top1_agreement": min(text["top1_agreement"], prompts["top1_agreement"]),
        "top1_agreement_text": text["top1_agreement"], "top1_agreement_prompts": prompts["top1_agreement"],
        "max_logit_error": max(text["max_logit_error"], prompts["max_logit_error"]),
        "mean_logit_error": float(np.mean([text["mean_logit_error"], prompts["mean_logit_error"]])),
        **matches,
        "text_tokens": sum(len(r) for r in inputs.text_rows), "prompts": len(inputs.prompts),
        "new_tokens": inputs.new_tokens,
    }


# -- gates ----------------------------------------------------------------------------------------

# gate name -> (metric, how the metric must compare with the threshold)
GATES = {
    "top1_agreement": ("top1_agreement", ">="),
    "greedy_match": ("greedy_match", ">="),
    "perplexity_change": ("perplexity_change_abs", "<="),  # relative, either direction
    "max_logit_error": ("max_logit_error", "<="),
}


def failed_gates(metrics: dict[str, Any], gates: dict[str, float]) -> list[str]:
    """One line per gate the metrics miss, e.g. `top1_agreement 0.953 < 0.98`."""
    failures = []
    for gate, threshold in gates.items():
        metric, relation = GATES[gate]
        value = metrics[metric]
        holds = value >= threshold if relation == ">=" else value <= threshold
        if not holds:  # NaN fails too
            failures.append(f"{gate} {value:.4g} {'<' if relation == '>=' else '>'} {threshold:g}")
    return failures


def text_rows(ids: list[int]) -> list[list[int]]:
    ids = ids[:MAX_TEXT_TOKENS]
    return [ids[i:i + TEXT_ROW_TOKENS] for i in range(0, len(ids), TEXT_ROW_TOKENS) if len(ids[i:]) > 1]
