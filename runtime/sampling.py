"""Choosing the next token on numpy: greedy, or sampling through the logits processors transformers
applies, in its order: repetition penalty, temperature, top-k, top-p, min-p.

Each sequence has its own numpy Generator seeded from its request's seed, so a seeded request draws
the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .structured import OutputFormat

MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list, as the OpenAI API allows


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # for benchmarks: always generate max_new_tokens
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # end the sequence like EOS does
    min_tokens: int = 0  # neither EOS, a stop token nor a stop string ends a sequence before this many
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the k most likely
    n: int = 1  # sequences per prompt, forked from one prefill (with beams: the best n beams)
    num_beams: int = 1  # > 1: beam search (runtime/beam.py), as transformers' generate(num_beams=...)
    length_penalty: float = 1.0  # beam scores are sum of log-probs / length ** length_penalty
    early_stopping: bool | str = False  # beam search: True, False or "never", as transformers takes it
    output_format: OutputFormat | None = None  # structured output (runtime/structured.py); None: free text

    def problem(self) -> str | None:
        """What is wrong with these values, in one line, or None."""
        checks = (
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (all(self.stop), "stop strings must not be empty"),
            (0 <= self.min_tokens <= self.max_new_tokens,
             f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.num_beams >= 1, f"num_beams must be >= 1, got {self.num_beams}"),
            (self.early_stopping in (True, False, "never"),
             f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}"),
        )
        return next((message for ok, message in checks if not ok), None) or self._beam_problem()

    def _beam_problem(self) -> str | None:
        if self.num_beams == 1:
            return None
        checks = (
            (self.n <= self.num_beams, f"n ({self.n}) must be <= num_beams ({self.num_beams}): the best n beams "
                                       "are returned"),
            (self.greedy, "beam search is deterministic: set temperature to 0 (or leave it out)"),
            (not self.stop, "stop strings are not supported with beam search; use stop_token_ids"),
            (self.logprobs is None, "logprobs are not supported with beam search"),
            (self.repetition_penalty == 1.0, "repetition_penalty is not supported with beam search"),
            (self.output_format is None, "structured outputs (response_format, guided_*) are not supported with "
                                         "beam search"),
        )
        return next((message for ok, message in checks if not ok), None)

    @property
    def rows(self) -> int:
        """Batch rows the request takes: one per beam, or one per sequence."""
        return self.num_beams if self.num_beams > 1 else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply to the logits first: the batch's argmax is this row's token."""
        return self.greedy and self.repetition_penalty == 1.0 and self.min_tokens == 0 and self.output_format is None


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """transformers' RepetitionPenaltyLogitsProcessor: divide positive, multiply negative scores."""
    if penalty == 1.0 or seen.size == 0:
        return logits
    logits = logits.copy()
    scores = logits[seen]
    logits[seen] = np.where(scores > 0, scores / penalty, scores * penalty)
    return logits


def filtered_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled token is drawn from, after temperature, top-k, top-p and min-p."""
    scores = logits.astype(np.float64)
    # Shift before dividing: a tiny temperature then sends the others to -inf, never inf - inf = NaN.
    scores = (scores - scores.max()) / params.temperature
    if 0 < params.top_k < scores.size:
        kth = np.partition(scores, -params.top_k)[-params.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = _softmax(scores)
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop = cumulative - probs[order] >= params.top_p
        probs[order[drop]] = 0.0
    if params.min_p > 0.0:
        probs = np.where(probs < params.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


def next_token(logits: np.ndarray, history: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, np.unique(history), params.repetition_penalty)
    if params.greedy:
        return int(np.argmax(logits))
    probs = filtered_probabilities(logits, params)
    return int(rng.choice(probs.size, p=probs))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    scores = logits.astype(np.float64)
    shifted = scores - scores.max()
    return shifted - np.log(np.exp(shifted).sum())


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under the model's distribution for this position, and the
    `top` most likely tokens with theirs, most likely first."""
    logprobs = log_softmax(logits)
    best: list[tuple[int, float]] = []
    if top:
        candidates = np.argpartition(-logprobs, top - 1)[:top]
        best = [(int(i), float(logprobs[i])) for i in candidates[np.argsort(-logprobs[candidates], kind="stable")]]
    return float(logprobs[token]), best


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum()
