"""Accuracy of a variant against the fp32 reference graph, and the recipe's gates over it.

Both graphs run under ONNX Runtime through the runtime's own backend, so what is measured is what
ships. Two kinds of input:

- the held-out text (compiler/data/heldout.txt by default), teacher-forced: perplexity of both, its
  relative change, top-1 agreement and logit errors at every position;
- the validation prompts: the reference's greedy continuation of N tokens, then the variant
  teacher-forced over it (top-1 agreement, logit errors) and decoding greedily on its own (exact
  match rate and the first position where it parts from the reference).

The metric functions take numpy arrays only, so an A/B comparison against eager torch can use them
unchanged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.generator import left_padded

TEXT_ROW_TOKENS = 256  # the held-out text is scored as rows of this many tokens, decoded side by side
MAX_TEXT_TOKENS = 1024


# -- metrics on arrays ----------------------------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


# Metrics walk a row's positions in blocks of this many: a row's vocabulary-sized temporaries at
# once (log-softmax, differences) would be several copies of the row (50 MB each at 256 x 49k).
POSITION_BLOCK = 64


def perplexity(logits: Iterable[np.ndarray], targets: Sequence[Sequence[int]]) -> float:
    """exp(mean negative log-likelihood); logits[i][t] predicts targets[i][t]."""
    nll = []
    for lg, tg in zip(logits, targets, strict=True):
        tg = np.asarray(tg, np.int64)
        for start in range(0, len(tg), POSITION_BLOCK):
            block = tg[start:start + POSITION_BLOCK]
            nll.append(-log_softmax(lg[start:start + len(block)])[np.arange(len(block)), block])
    return float(np.exp(np.concatenate(nll).mean()))


def agreement(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray]) -> dict[str, float]:
    # Row by row: the rows' logits side by side would be a third and fourth copy of them all.
    agree = positions = 0
    worst, total = 0.0, 0.0
    for ref, out in zip(reference, candidate, strict=True):
        for start in range(0, len(ref), POSITION_BLOCK):
            r, o = ref[start:start + POSITION_BLOCK], out[start:start + POSITION_BLOCK]
            error = np.abs(o - r)
            agree += int((r.argmax(-1) == o.argmax(-1)).sum())
            worst, total = max(worst, float(error.max())), total + float(error.sum(dtype=np.float64))
        positions += len(ref)
    return {"top1_agreement": agree / positions, "max_logit_error": worst,
            "mean_logit_error": total / (positions * reference[0].shape[-1])}


def kl_divergence(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """KL(reference || candidate) of the next-token distributions, per position: [..., vocab] -> [...]."""
    # float64, a block of rows at a time: near-equal fp32 distributions differ by less than fp32 rounding.
    ref, out = reference.reshape(-1, reference.shape[-1]), candidate.reshape(-1, candidate.shape[-1])
    kl = np.empty(len(ref))
    for start in range(0, len(ref), 64):
        log_ref = log_softmax(ref[start:start + 64].astype(np.float64))
        log_out = log_softmax(out[start:start + 64].astype(np.float64))
        kl[start:start + 64] = (np.exp(log_ref) * (log_ref - log_out)).sum(-1)
    return np.maximum(kl, 0.0).reshape(reference.shape[:-1])


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


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


def teacher_forced(backend: Any, rows: Sequence[list[int]], pad_id: int, last: int | None = None,
                   into: Path | None = None) -> Sequence[np.ndarray]:
    """Logits at every position of every row, [len(row), vocab], one decode step per column; with
    `last`, at each row's last `last` positions only (rows are at least that long). A backend that
    scores a whole row in one forward pass (`forward_row`: eager torch) does that instead, a row at a
    time: the reference's logits, without a step per column. With `into` (a file), the logits are
    written there as they come and read back a row at a time (RowsOnDisk): the process never holds
    more than one step's, or one row's."""
    if into:
        into.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(backend, "forward_row"):
        scored = (backend.forward_row(row, last) for row in rows)
        return RowsOnDisk.written(scored, into) if into else list(scored)
    ids, mask = left_padded(rows, pad_id)
    width = ids.shape[1]
    kept = width if last is None else last
    cache = backend.new_cache(len(rows), width)
    stacked = None  # [rows, kept, vocab], written step by step: one copy of the logits, not two
    written: tuple[int, np.dtype] | None = None  # with `into`: the file's vocab and dtype
    with open(into, "wb") if into else contextlib.nullcontext() as sink:
        for t in range(width):
            positions = np.clip(mask[:, :t + 1].sum(-1, keepdims=True) - 1, 0, None)
            logits, cache = backend.run(ids[:, t:t + 1], mask[:, :t + 1], positions, cache)
            if t < width - kept:
                continue
            column = t - (width - kept)
            if sink:  # the same [rows, kept, vocab] layout, in the file
                step = np.ascontiguousarray(logits[:, -1])
                for i, row_logits in enumerate(step):
                    sink.seek((i * kept + column) * row_logits.nbytes)
                    sink.write(row_logits.data)
                written = step.shape[-1], step.dtype
                continue
            if stacked is None:
                stacked = np.empty((len(rows), kept, logits.shape[-1]), logits.dtype)
            stacked[:, column] = logits[:, -1]
    firsts = [0 if last is not None else width - len(row) for row in rows]
    if written:
        vocab, dtype = written
        size = vocab * dtype.itemsize
        return RowsOnDisk(into, [((i * kept + first) * size, (kept - first, vocab), dtype)
                                 for i, first in enumerate(firsts)])
    return [stacked[i, first:] for i, first in enumerate(firsts)]


def greedy(backend: Any, prompts: Sequence[list[int]], new_tokens: int,
           pad_id: int) -> tuple[list[list[int]], np.ndarray]:
    """new_tokens greedy tokens per prompt (EOS ignored, so every row has the same length), and the
    prefill's logits at each prompt's last position."""
    ids, mask = left_padded(prompts, pad_id)
    cache = backend.new_cache(len(prompts), ids.shape[1] + new_tokens)
    logits, cache = backend.run(ids, mask, np.clip(mask.cumsum(-1) - 1, 0, None), cache)
    prefill = logits[:, -1].copy()
    tokens = []
    for _ in range(new_tokens):
        step = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        tokens.append(step[:, 0])
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        logits, cache = backend.run(step, mask, mask.sum(-1, keepdims=True) - 1, cache)
    return np.stack(tokens, axis=1).tolist(), prefill


@dataclass
class Run:
    """What one side computed on the inputs; the reference's continuations are the ones both sides score."""

    text_logits: Sequence[np.ndarray]  # teacher-forced over each held-out row, [len(row), vocab]
    continuations: list[list[int]]  # its own greedy tokens per prompt
    prefill_logits: np.ndarray  # [prompts, vocab]: the prefill's logits at each prompt's last position
    continuation_logits: Sequence[np.ndarray]  # teacher-forced over the reference's continuation, [new_tokens, vocab]
    greedy_seconds: float  # the batched greedy run, prefill included


class RowsOnDisk(Sequence[np.ndarray]):
    """Arrays in a file, read back one at a time with plain reads (not mapped, so what was read
    leaves the resident set with the array). Logits are vocabulary-sized whatever the model (0.3 GiB
    at SmolLM2's 49k vocabulary over the validation text and prompts, 0.9 GiB at 152k), and the
    comparison reads them row by row, so neither side's need stay resident."""

    def __init__(self, path: Path, rows: list[tuple[int, tuple[int, ...], np.dtype]]) -> None:
        self.path, self._rows = path, rows  # (offset, shape, dtype) of each

    @classmethod
    def written(cls, rows: Iterable[np.ndarray], path: Path) -> RowsOnDisk:
        """`rows` written to `path` one after another, each as it comes."""
        table = []
        with open(path, "wb") as handle:
            for row in rows:
                row = np.ascontiguousarray(row)
                table.append((handle.tell(), row.shape, row.dtype))
                handle.write(row.data)
        return cls(path, table)

    def without_last(self) -> RowsOnDisk:
        """The same rows, each without its last position."""
        return RowsOnDisk(self.path, [(offset, (shape[0] - 1, *shape[1:]), dtype)
                                      for offset, shape, dtype in self._rows])

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]
        offset, shape, dtype = self._rows[index]
        count = int(np.prod(shape))
        return np.fromfile(self.path, dtype=dtype, count=count, offset=offset).reshape(shape)


def reference_run(backend: Any, inputs: Inputs, into: Path | None = None) -> Run:
    """The reference side's run; with `into` (a folder), its logits written there as they come."""
    text = teacher_forced(backend, inputs.text_rows, inputs.pad_id, into=_file(into, "text-logits.bin"))
    greedy(backend, inputs.prompts[:1], 1, inputs.pad_id)  # warms the decode steps up before they are timed
    continuations, prefill, seconds = _timed_greedy(backend, inputs)
    return Run(text, continuations, prefill, _continuation_logits(backend, inputs, continuations, into), seconds)


def candidate_run(backend: Any, inputs: Inputs, reference: Run, into: Path | None = None) -> Run:
    text = teacher_forced(backend, inputs.text_rows, inputs.pad_id, into=_file(into, "text-logits.bin"))
    continuations, prefill, seconds = _timed_greedy(backend, inputs)
    return Run(text, continuations, prefill, _continuation_logits(backend, inputs, reference.continuations, into),
               seconds)


def _file(folder: Path | None, name: str) -> Path | None:
    return folder / name if folder else None


def _timed_greedy(backend: Any, inputs: Inputs) -> tuple[list[list[int]], np.ndarray, float]:
    started = time.perf_counter()
    tokens, prefill = greedy(backend, inputs.prompts, inputs.new_tokens, inputs.pad_id)
    return tokens, prefill, time.perf_counter() - started


def side_by_side_seconds(backends: Sequence[Any], inputs: Inputs, repeats: int) -> list[float]:
    """Median seconds of the batched greedy run for each backend, the runs interleaved (A, B, A, B, ...)
    so that drift of a noisy machine hits every side alike."""
    seconds: list[list[float]] = [[] for _ in backends]
    for _ in range(repeats):
        for times, backend in zip(seconds, backends, strict=True):
            times.append(_timed_greedy(backend, inputs)[2])
    return [float(np.median(times)) for times in seconds]


def _continuation_logits(backend: Any, inputs: Inputs, continuations: list[list[int]],
                         into: Path | None = None) -> Sequence[np.ndarray]:
    rows = [p + c for p, c in zip(inputs.prompts, continuations, strict=True)]
    # Position len(prompt) - 1 predicts the first new token; the last position predicts nothing we keep.
    # Only those positions are kept (the prompts' own logits are over as many again), and the last is
    # dropped where each row is read: new_tokens of them.
    logits = teacher_forced(backend, rows, inputs.pad_id, last=inputs.new_tokens + 1,
                            into=_file(into, "continuation-logits.bin"))
    if isinstance(logits, RowsOnDisk):
        return logits.without_last()
    return [lg[:-1] for lg in logits]


def measure(backend: Any, inputs: Inputs, reference: Run, into: Path | None = None) -> dict[str, Any]:
    """Every metric of the model behind `backend` against the reference run; with `into` (a folder),
    the candidate's logits go there as they come (see teacher_forced), not into memory."""
    return compare_runs(reference, candidate_run(backend, inputs, reference, into), inputs)


def compare_runs(reference: Run, candidate: Run, inputs: Inputs) -> dict[str, Any]:
    """{"summary": overall metrics, "prompts": one record per prompt, "positions": per continuation position}."""
    targets = [row[1:] for row in inputs.text_rows]
    ppl_ref = perplexity((lg[:-1] for lg in reference.text_logits), targets)
    ppl = perplexity((lg[:-1] for lg in candidate.text_logits), targets)
    text = agreement(reference.text_logits, candidate.text_logits)
    prompts = agreement(reference.continuation_logits, candidate.continuation_logits)
    per_prompt = [_prompt_metrics(reference, candidate, i) for i in range(len(inputs.prompts))]
    text_kl = np.concatenate([kl_divergence(r, c) for r, c in zip(reference.text_logits, candidate.text_logits,
                                                                  strict=True)])
    prompt_kl = np.concatenate([p.pop("_kl") for p in per_prompt])
    kl_all = np.concatenate([text_kl, prompt_kl])
    generated = len(inputs.prompts) * inputs.new_tokens
    speed_ref, speed = generated / reference.greedy_seconds, generated / candidate.greedy_seconds
    summary = {
        "perplexity_reference": ppl_ref, "perplexity": ppl, "perplexity_change": ppl / ppl_ref - 1,
        "perplexity_change_abs": abs(ppl / ppl_ref - 1),
        "top1_agreement": min(text["top1_agreement"], prompts["top1_agreement"]),
        "top1_agreement_text": text["top1_agreement"], "top1_agreement_prompts": prompts["top1_agreement"],
        "max_logit_error": max(text["max_logit_error"], prompts["max_logit_error"]),
        "mean_logit_error": float(np.mean([text["mean_logit_error"], prompts["mean_logit_error"]])),
        "kl_divergence": float(kl_all.mean()), "kl_divergence_max": float(kl_all.max()),
        "prefill_max_logit_error": max(p["prefill_max_logit_error"] for p in per_prompt),
        "prefill_mean_logit_error": float(np.mean([p["prefill_mean_logit_error"] for p in per_prompt])),
        "prefill_cosine": min(p["prefill_cosine"] for p in per_prompt),
        "prefill_cosine_mean": float(np.mean([p["prefill_cosine"] for p in per_prompt])),
        "greedy_match": float(np.mean([p["greedy_match"] for p in per_prompt])),
        "tokens_per_second_reference": speed_ref, "tokens_per_second": speed,
        "tokens_per_second_ratio": speed / speed_ref,
        "text_tokens": sum(len(r) for r in inputs.text_rows), "prompts": len(inputs.prompts),
        "new_tokens": inputs.new_tokens,
    }
    return {"summary": summary, "prompts": per_prompt, "positions": _position_metrics(reference, candidate)}


def _prompt_metrics(reference: Run, candidate: Run, i: int) -> dict[str, Any]:
    ref, out = reference.continuation_logits[i], candidate.continuation_logits[i]
    first = greedy_match([reference.continuations[i]], [candidate.continuations[i]])["first_divergence"][0]
    prefill_ref, prefill = reference.prefill_logits[i], candidate.prefill_logits[i]
    kl = kl_divergence(ref, out)
    return {
        "index": i,
        "prefill_max_logit_error": float(np.abs(prefill - prefill_ref).max()),
        "prefill_mean_logit_error": float(np.abs(prefill - prefill_ref).mean()),
        "prefill_cosine": cosine(prefill_ref, prefill),
        "top1_agreement": float((ref.argmax(-1) == out.argmax(-1)).mean()),
        "kl_divergence": float(kl.mean()), "kl_divergence_max": float(kl.max()),
        "max_logit_error": float(np.abs(out - ref).max()),
        "greedy_match": first is None, "first_divergence": first,
        "reference_tokens": reference.continuations[i], "candidate_tokens": candidate.continuations[i],
        "_kl": kl,
    }


def _position_metrics(reference: Run, candidate: Run) -> dict[str, list[float]]:
    """Across prompts, at each position of the reference continuation (teacher-forced); a prompt at a
    time, not the prompts' logits stacked (two more copies of them)."""
    pairs = zip(reference.continuation_logits, candidate.continuation_logits, strict=True)  # [n, vocab] each
    agree, mean_error, max_error, kl = [], [], [], []
    for ref, out in pairs:
        error = np.abs(out - ref)
        agree.append(ref.argmax(-1) == out.argmax(-1))
        mean_error.append(error.mean(-1))
        max_error.append(error.max(-1))
        kl.append(kl_divergence(ref, out))
    diverged = np.array([[a != b for a, b in zip(r, c, strict=True)]
                         for r, c in zip(reference.continuations, candidate.continuations, strict=True)])
    return {
        "top1_agreement": np.mean(agree, axis=0).tolist(),
        "mean_logit_error": np.mean(mean_error, axis=0).tolist(),
        "max_logit_error": np.max(max_error, axis=0).tolist(),
        "kl_divergence": np.mean(kl, axis=0).tolist(),
        # share of prompts whose own greedy run has parted from the reference at or before this position
        "diverged": np.maximum.accumulate(diverged, axis=1).mean(0).tolist(),
    }


# -- gates ----------------------------------------------------------------------------------------

# gate name -> (metric, how the metric must compare with the threshold)
GATES = {
    "top1_agreement": ("top1_agreement", ">="),
    "greedy_match": ("greedy_match", ">="),
    "perplexity_change": ("perplexity_change_abs", "<="),  # relative, either direction
    "max_logit_error": ("max_logit_error", "<="),
    "kl_divergence": ("kl_divergence", "<="),  # mean over every scored position
    "prefill_cosine": ("prefill_cosine", ">="),  # the worst prompt's
    "tokens_per_second_ratio": ("tokens_per_second_ratio", ">="),  # candidate / reference, greedy batch
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


def text_rows(ids: list[int], max_context: int, most: int | None = MAX_TEXT_TOKENS) -> list[list[int]]:
    """The held-out text as rows of TEXT_ROW_TOKENS tokens (fewer if the context is shorter), at most
    `most` in all (None: all of it); a last row of one token predicts nothing and is dropped."""
    ids, width = ids[:most], min(TEXT_ROW_TOKENS, max_context)
    return [ids[i:i + width] for i in range(0, len(ids), width) if len(ids[i:]) > 1]
