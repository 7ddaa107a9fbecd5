"""Output processing, the engine's third part: from a row's logits to the request's events.

    logits row ─> the output format's mask (structured.py) ─> pick (greedy, or the sampler with
              min_tokens' bans) ─> token ─> the format's matcher takes it
              ─> logprobs, stop tokens and eos, incremental detokenization, stop strings, length
              ─> Event (text that can no longer turn into a stop string; the result on the last one)

A beam search steps its K rows together (runtime/beam.py); this module starts it on a prompt's logits,
steps it, and turns its best hypotheses into the request's n results. Moving beams' KV rows is the
engine's (it owns the cache); nothing here touches the backend.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .beam import BeamSearch
from .sampling import SamplingParams, next_token, token_logprobs
from .structured import Constraints
from .tokenizer import IncrementalDecoder, Tokenizer


class RequestError(ValueError):
    """A request that cannot be run, in one line (an empty prompt, a prompt past the context, ...)."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position and their logprobs


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # eos | stop | length | abort | error
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)
    generated_tokens: int = 0
    error: str | None = None
    time_to_first_token_s: float | None = None
    total_s: float = 0.0
    queue_s: float | None = None  # from arrival until its prefill started
    logprobs: list[TokenLogprob] | None = None
    alternatives: list[Result] = field(default_factory=list)  # Generator: sequences 2..n of an n > 1 request
    score: float | None = None  # beam search: sum of log-probs / length ** length_penalty


@dataclass(frozen=True)
class Event:
    """What one step did for one sequence: its new token, the text that completed (may be empty),
    and on its last event the finish reason and the whole result."""

    request_id: Any
    token_id: int | None  # None for a request refused or aborted before its first token
    text: str
    finish_reason: str | None
    result: Result | None = None
    sequence: int = 0  # which of the request's n sequences
    logprob: TokenLogprob | None = None

    @property
    def index(self) -> Any:
        """Generator's name for the request id: the prompt's index."""
        return self.request_id


@dataclass
class Request:
    id: Hashable
    prompt: list[int]
    params: SamplingParams
    arrival: float
    admitted: float | None = None  # when its prefill started
    prefix_keys: list[bytes] | None = None  # its prompt's block keys, where a prefix cache is on
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass
class SequenceState:
    """One of a request's sequences while it runs: a row of the running batch."""

    request: Request
    index: int
    rng: np.random.Generator | None  # None for greedy: drawing OS entropy for it costs more than its step
    decoder: IncrementalDecoder
    result: Result
    text: str = ""  # decoded so far, cut at a stop string
    emitted: int = 0  # characters of text already in events
    token: int = 0  # the newest token: fed to the model at the next decode step
    beams: BeamSearch | None = None  # a beam of this search; index is its place among the request's beams
    matcher: Any = None  # llguidance's state of the output format, made at the first pick
    allowed: np.ndarray | None = None  # the format's mask for the next pick, computed beside the forward pass

    @property
    def params(self) -> SamplingParams:
        return self.request.params


def reported(rows: list[SequenceState | None]) -> list[SequenceState]:
    """The rows whose end is reported: every sequence, but only n of a beam search's K beams (a request
    answers with sequences 0..n-1)."""
    return [row for row in rows if row is not None and row.index < row.params.n]


def describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_ids: set[int], max_context: int, constraints: Constraints) -> None:
        self.tokenizer, self.eos_ids, self.max_context = tokenizer, eos_ids, max_context
        self.constraints = constraints

    def new_sequence(self, request: Request, index: int) -> SequenceState:
        seed = request.params.seed
        seed = None if seed is None else seed % 2**64  # any integer the API allows, negative ones too
        rng = None if request.params.greedy else np.random.default_rng(seed if index == 0 or seed is None
                                                                        else [seed, index])
        result = Result(prompt_tokens=len(request.prompt), cached_tokens=request.cached_tokens,
                        logprobs=[] if request.params.logprobs is not None else None,
                        queue_s=(request.admitted or request.arrival) - request.arrival)
        return SequenceState(request, index, rng, IncrementalDecoder(self.tokenizer, request.prompt), result)

    def next_event(self, sequence: SequenceState, logits: np.ndarray) -> Event:
        """The sequence's next token from its row's logits, and what it completes; a failure ends that
        sequence alone."""
        try:
            return self._advance(sequence, self._pick(sequence, logits), logits)
        except Exception as exc:  # noqa: BLE001 - one request's failure ends that request alone
            return self.failed(sequence, describe(exc))

    def _pick(self, sequence: SequenceState, logits: np.ndarray) -> int:
        params, result = sequence.params, sequence.result
        if params.output_format is not None:
            logits = self._constrained(sequence, logits)
        if params.plain_greedy:
            return int(np.argmax(logits))
        if result.generated_tokens < params.min_tokens:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_ids))
            kept = logits.copy()
            kept[banned] = -np.inf
            # An output format that can only end here outranks min_tokens: it would otherwise leave no token.
            logits = kept if np.isfinite(kept).any() else logits
        # The history matters only to the repetition penalty; skip building it otherwise.
        history = np.asarray(sequence.request.prompt + result.token_ids, np.int64) \
            if params.repetition_penalty != 1.0 else np.empty(0, np.int64)
        return next_token(logits, history, params, sequence.rng)

    def _constrained(self, sequence: SequenceState, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the output format does not allow next at -inf."""
        if sequence.matcher is None:
            sequence.matcher = self.constraints.matcher(sequence.params.output_format)
        allowed, sequence.allowed = sequence.allowed, None
        if allowed is None:
            begun = time.perf_counter()
            allowed = self.constraints.allowed(sequence.matcher)
            self.constraints.wait_s += time.perf_counter() - begun
        self.constraints.masks += 1
        if not allowed.any():
            raise ValueError(f"the output format allows no token here ({sequence.matcher.get_error() or 'no error'})")
        return np.where(allowed, logits, -np.inf)

    def start_masks(self, rows: list[SequenceState | None]) -> tuple[list[SequenceState], Any] | None:
        """Start computing the format masks of the rows that have one (on the constraint thread), so they
        are ready when the forward pass that runs meanwhile returns its logits; take_masks collects them."""
        constrained = [row for row in rows if row is not None and row.matcher is not None]
        if not constrained:
            return None
        return constrained, self.constraints.start([row.matcher for row in constrained])

    def take_masks(self, pending: tuple[list[SequenceState], Any] | None) -> None:
        if pending is not None:
            rows, masks = pending
            begun = time.perf_counter()
            try:
                computed = masks.result()
            except Exception:  # noqa: BLE001 - each row computes its own at its pick, and fails alone
                return
            for row, allowed in zip(rows, computed, strict=True):
                row.allowed = allowed
            self.constraints.wait_s += time.perf_counter() - begun

    def _advance(self, sequence: SequenceState, token: int, logits: np.ndarray) -> Event:
        params, result = sequence.params, sequence.result
        if result.time_to_first_token_s is None:
            result.time_to_first_token_s = time.perf_counter() - sequence.request.arrival
        result.token_ids.append(token)
        result.generated_tokens += 1
        logprob = None
        if params.logprobs is not None:
            logprob = TokenLogprob(token, *token_logprobs(logits, token, params.logprobs))
            result.logprobs.append(logprob)
        sequence.token = token
        matcher = sequence.matcher
        if matcher is not None and not matcher.consume_token(token):
            raise ValueError(f"the output format refused token {token}: {matcher.get_error()}")
        may_stop = result.generated_tokens >= params.min_tokens
        finish = None
        if may_stop and token in params.stop_token_ids:
            finish = "stop"
        elif may_stop and token in self.eos_ids and not params.ignore_eos:
            finish = "eos"
        elif matcher is not None and matcher.is_stopped():  # the format is complete and nothing may follow
            finish = "stop"
        new_text = sequence.decoder.add(token)
        sequence.text += new_text
        cut = finish is None and may_stop and bool(params.stop) and self._cut_at_stop(sequence, len(new_text))
        if cut:
            finish = "stop"
        elif finish is None and (result.generated_tokens >= params.max_new_tokens
                                 or len(sequence.request.prompt) + result.generated_tokens >= self.max_context):
            finish = "length"
        if finish is not None and not cut:
            sequence.text += sequence.decoder.flush()  # a character left incomplete at the end
        return self._emit(sequence, token, finish, logprob)

    @staticmethod
    def _cut_at_stop(sequence: SequenceState, new_chars: int) -> bool:
        """Look for stop strings only where the new text could complete one, and cut the text there."""
        longest = max(len(s) for s in sequence.params.stop)
        start = max(0, len(sequence.text) - new_chars - longest + 1)
        found = [i for i in (sequence.text.find(s, start) for s in sequence.params.stop) if i >= 0]
        if not found:
            return False
        sequence.text = sequence.text[:min(found)]
        return True

    @staticmethod
    def _emit(sequence: SequenceState, token: int | None, finish: str | None,
              logprob: TokenLogprob | None = None) -> Event:
        # While running, hold back what could still turn out to start a stop string.
        stops = sequence.params.stop
        held = 0 if finish or not stops else max(len(s) for s in stops) - 1
        stable = max(sequence.emitted, len(sequence.text) - held)
        text, sequence.emitted = sequence.text[sequence.emitted:stable], stable
        result = None
        if finish is not None:
            result = sequence.result
            result.text, result.finish_reason = sequence.text, finish
            result.total_s = time.perf_counter() - sequence.request.arrival
        return Event(sequence.request.id, token, text, finish, result, sequence.index, logprob)

    def ended(self, sequence: SequenceState, reason: str) -> Event:
        return self._emit(sequence, None, reason)

    def failed(self, sequence: SequenceState, message: str) -> Event:
        sequence.result.error = message
        return self._emit(sequence, None, "error")

    # -- beam search: a request's K beams are K rows of the running batch ---------------------------

    def start_beams(self, request: Request, logits: np.ndarray) -> tuple[list[SequenceState], list[Event]]:
        """The first step of a beam search, on its prompt's logits: its K beams, to join the batch as K
        copies of the prompt's row, or no beams and the request's events where it is done at once."""
        params = request.params
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        search = BeamSearch(params.num_beams, frozenset(eos), min(params.max_new_tokens,
                            self.max_context - len(request.prompt)), params.length_penalty, params.early_stopping,
                            params.min_tokens)
        beams = [self.new_sequence(request, k) for k in range(params.num_beams)]
        try:
            _, tokens = search.step(np.repeat(logits[None], params.num_beams, axis=0))
        except Exception as exc:  # noqa: BLE001 - one request's failure ends that request alone
            return [], [self.failed(beam, describe(exc)) for beam in reported(beams)]
        if search.done:
            return [], self._beam_results(search, beams)
        for beam, token in zip(beams, tokens, strict=True):
            beam.beams, beam.token, beam.result.generated_tokens = search, token, 1
        return beams, []

    def step_beams(self, search: BeamSearch, beams: list[SequenceState], logits: np.ndarray
                   ) -> tuple[list[tuple[int, int]], list[Event] | None]:
        """One step of a search on its beams' logits (by beam index): the beams whose row must take their
        parent's, as (beam, parent), and None while it goes on, or the request's events once it is done."""
        parents, tokens = search.step(logits)
        if search.done:
            return [], self._beam_results(search, beams)
        for beam, token in zip(beams, tokens, strict=True):
            beam.token, beam.result.generated_tokens = token, beam.result.generated_tokens + 1
        return [(k, parent) for k, parent in enumerate(parents) if parent != k], None

    def _beam_results(self, search: BeamSearch, beams: list[SequenceState]) -> list[Event]:
        """The request's n best hypotheses, best first, as its sequences 0..n-1."""
        events = []
        for rank, (beam, hypothesis) in enumerate(zip(beams, search.best(beams[0].params.n), strict=False)):
            result = beam.result
            result.token_ids, result.generated_tokens, result.score = hypothesis.tokens, len(hypothesis.tokens), \
                hypothesis.score
            if result.time_to_first_token_s is None:
                result.time_to_first_token_s = time.perf_counter() - beam.request.arrival
            beam.index, beam.text = rank, "".join(beam.decoder.add(t) for t in hypothesis.tokens)
            beam.text += beam.decoder.flush()
            events.append(self._emit(beam, hypothesis.tokens[-1], hypothesis.finish_reason))
        return events
