"""Beam search for one request, on numpy, step for step as transformers' `generate(num_beams=K,
do_sample=False)` does it (generation/utils.py `_beam_search`, transformers 5), so the tokens and
`sequences_scores` are the same:

    each step, from the K running beams' logits [K, vocab]:
      log_softmax (fp32) + each beam's running sum -> the best 2K (K x (EOS ids + 1)) of K x vocab
      a candidate that ends in EOS, or reaches the last step, is finished: only those ranked in the
        first K compete for the K finished slots, scored sum / generated_length ** length_penalty
      the best K candidates that did not finish are the next running beams (their parents' cache rows
        are copied into the beams' rows by the engine)
    the request is done when no running beam can beat the worst finished one (early_stopping False:
    with the length generated so far; "never": with the most it may still generate), all K slots are
    full (early_stopping True), or the last step was taken.

Exact ties go to the lower flat index (beam, then token) first, as torch.topk on CPU orders the small
cases tested. It promises no order: it selects with std::partial_sort (where k * 64 <= the candidates, as
in a search's steps) or std::nth_element, comparing scores alone, neither stable. So where two candidates'
fp32 scores are equal at the edge of a selection, transformers may keep the other one: the tiny Qwen3-MoE
met two sums of -42.566895 as the 5th and 6th of 12 candidates, and its best beams parted there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NEG = np.float32(-1e9)  # transformers' "impossible" score: -1e9 + any log-prob rounds to -1e9 in fp32


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # generated, the EOS that ended it included
    score: float  # sum of log-probs / len(tokens) ** length_penalty
    finish_reason: str  # eos | length


def log_softmax32(logits: np.ndarray) -> np.ndarray:
    scores = logits.astype(np.float32)
    shifted = scores - scores.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' indices, largest first, ties to the lower index (module doc)."""
    if k >= scores.size:
        return np.argsort(-scores, kind="stable")
    kth = np.partition(scores, scores.size - k)[scores.size - k]
    candidates = np.flatnonzero(scores >= kth)  # all of the k, plus any tied with the k-th
    return candidates[np.argsort(-scores[candidates], kind="stable")][:k]


@dataclass(eq=False)  # one search is one request: compared and hashed by identity
class BeamSearch:
    beams: int
    eos_ids: frozenset[int]
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers takes it
    min_new_tokens: int = 0
    running: list[list[int]] = field(init=False)
    running_scores: np.ndarray = field(init=False)
    finished: list[list[int] | None] = field(init=False)
    finished_scores: np.ndarray = field(init=False)
    slot_full: np.ndarray = field(init=False)
    generated: int = 0
    improvable: bool = True
    done: bool = False

    def __post_init__(self) -> None:
        k = self.beams
        self.running = [[] for _ in range(k)]
        # Beams 1..K-1 start impossible, so the first step does not pick K copies of one token.
        self.running_scores = np.array([0.0] + [NEG] * (k - 1), np.float32)
        self.finished, self.finished_scores = [None] * k, np.full(k, NEG, np.float32)
        self.slot_full = np.zeros(k, bool)

    def step(self, logits: np.ndarray) -> tuple[list[int], list[int]]:
        """Advance on the running beams' logits [K, vocab]: returns, for each beam of the next step, the
        beam it continues (its parent, whose cache row it takes) and the token it feeds next."""
        k, vocab = logits.shape
        logprobs = log_softmax32(logits)
        if self.generated < self.min_new_tokens and self.eos_ids:
            logprobs[:, sorted(self.eos_ids)] = -np.inf
        total = (logprobs + self.running_scores[:, None]).reshape(-1)
        picked = top_indices(total, max(2, 1 + len(self.eos_ids)) * k)
        scores, parents, tokens = total[picked], picked // vocab, picked % vocab
        last = self.generated + 1 >= self.max_new_tokens
        ends = np.array([last or int(t) in self.eos_ids for t in tokens])
        candidates = [self.running[p] + [int(t)] for p, t in zip(parents, tokens, strict=True)]
        self._finish(candidates, scores, ends)
        going = top_indices((scores + ends.astype(np.float32) * NEG).astype(np.float32), k)
        self.running = [candidates[i] for i in going]
        self.running_scores = (scores + ends.astype(np.float32) * NEG).astype(np.float32)[going]
        self.generated += 1
        self._check_done(ends.all())
        return [int(parents[i]) for i in going], [int(tokens[i]) for i in going]

    def _finish(self, candidates: list[list[int]], scores: np.ndarray, ends: np.ndarray) -> None:
        """Candidates that ended, among the best K, take finished slots from worse ones."""
        k = self.beams
        normalized = (scores / np.float32((self.generated + 1) ** self.length_penalty)).astype(np.float32)
        if not self.improvable or (self.early_stopping is True and self.slot_full.all()):
            normalized = normalized + NEG
        can_finish = ends & (np.arange(len(ends)) < k)
        normalized = (normalized + (~can_finish).astype(np.float32) * NEG).astype(np.float32)
        merged = np.concatenate([self.finished_scores, normalized])
        keep = top_indices(merged, k)
        pool = self.finished + candidates
        self.finished = [pool[i] for i in keep]
        self.finished_scores = merged[keep]
        self.slot_full = np.concatenate([self.slot_full, can_finish])[keep]

    def _check_done(self, all_ended: bool) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_length = self.max_new_tokens
        else:
            best_length = self.generated
        best_possible = self.running_scores[0] / np.float32(best_length ** self.length_penalty)
        worst = self.finished_scores.min() if self.slot_full.all() else NEG
        self.improvable = self.improvable and bool(best_possible > worst)
        full = self.early_stopping is True and self.slot_full.all()
        self.done = not self.improvable or full or all_ended

    def best(self, count: int) -> list[Hypothesis]:
        """The `count` best finished hypotheses, best first."""
        return [Hypothesis(tokens, float(score), "eos" if tokens and tokens[-1] in self.eos_ids else "length")
                for tokens, score in zip(self.finished[:count], self.finished_scores[:count], strict=True)]
