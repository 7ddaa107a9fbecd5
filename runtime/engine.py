"""The step-level engine: requests join and leave a running batch between steps (continuous batching).

    add_request ──> waiting ──admit (free rows, prefill token budget)──> prefill batch
                                                                            │ first tokens
    step(): one forward pass, either                                        v
      prefill  the admitted prompts (a long one in pieces)       join: free rows (copied in, or
                                                                 prefilled there in place)
      decode   one token for every running row                   running batch, a row per sequence
    a finished or aborted sequence frees its row at once; events say what each step produced

Why this layout. Kiln's graphs take one dense KV cache, [batch, kv_heads, slots, head_dim], with one
slot count for all rows and an attention mask, and a step appends every row's new slot in the same
column. So rows are kept right-aligned (left padding): each row's newest slot is the last column.
Two designs fit that, and this engine takes from both:
- TGI (causal_lm.py) concatenates a newly prefilled batch with the running one (`concatenate`, the
  narrower padded on the left) and filters finished rows out (`filter`), dropping columns that are
  padding in every row. Each join and each leave copies the whole cache. Measured on SmolLM2 at
  batch 32, a copy costs about as much as a decode step, and under load some request joins or
  leaves almost every step.
- llama.cpp's server keeps a fixed set of slots, each with its own cache; a request takes a free
  slot and only its own tokens are written.
Here a finished row becomes a free row (its mask all zero; nothing is copied), and a joining
sequence's prefilled slots are copied into a free row, right-aligned: only its own slots move, as
in a llama.cpp slot. Where the backend stores rows from slot 0 of shared buffers (limits.rows_in_place)
and the prompts run in one step, one row each, they are prefilled straight into free rows side by
side and nothing moves at all; the first group of a burst starts a batch with rows for the requests
waiting behind it. Measured on SmolLM2 int8, a burst of 32 prompts prefilled in three groups: the
time outside the graph 100 -> 33 ms, the whole generate call 5% faster, the first tokens 8% sooner.
The whole cache is copied, TGI's way, only when the batch needs more rows than
it has (growing by the rows the waiting requests will take too: a burst that prefills over several
steps grows the batch once, not at each step), when a prompt wider than the batch needs columns in
front that shared buffers have no room for, when free rows would cost more decode work than one
copy (compaction), or when columns that are padding in every row are dropped (a quarter of the
width, or shared buffers out of room: in place, without new memory).

Prefill goes first, so a new request waits at most one step for its first token, but no more than
`max_prefill_tokens` prompt tokens run between two decode steps: a burst of long prompts cannot
stall the running requests for long. A prompt longer than that budget is fed in pieces of it where
the backend allows (Limits.chunked_prefill). A bulk call (generate, kiln batch: `prefill_first`)
prefills every waiting prompt that fits before it decodes: a decode step between a burst's prefill
groups serves no one's latency, and its rows then need a step the others have already run (SmolLM2
int8 at batch 32: 35 forward passes instead of 34, one more 25 ms step).

Invariant (tested): whatever shares the batch, a greedy request gets the tokens it gets alone, and
a seeded one draws the same tokens (each sequence has its own random generator).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends.base import Backend
from .beam import BeamSearch
from .sampling import SamplingParams, next_token, token_logprobs
from .tokenizer import IncrementalDecoder, Tokenizer

Prompt = str | list[int] | list[dict[str, str]]
DEFAULT_PARAMS = SamplingParams()
MIN_GROWTH = 64  # shared buffers grow by at least this many slots, and by half their width
# Free rows are compacted away only after this many steps without a join: under load a finished
# request's client sends its next one within milliseconds, and compacting, then growing the batch
# again, would copy the whole cache twice for nothing.
QUIET_STEPS = 16


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


@dataclass
class _Sequence:
    request: Request
    index: int
    rng: np.random.Generator | None  # None for greedy: drawing OS entropy for it costs more than its step
    decoder: IncrementalDecoder
    result: Result
    text: str = ""  # decoded so far, cut at a stop string
    emitted: int = 0  # characters of text already in events
    token: int = 0  # the newest token: fed to the model at the next decode step
    beams: BeamSearch | None = None  # a beam of this search; index is its place among the request's beams

    @property
    def params(self) -> SamplingParams:
        return self.request.params


@dataclass
class _Batch:
    """Rows right-aligned in the cache's `length` columns: row i holds its `lengths[i]` real slots
    in the last columns; a free row (None) has length 0."""

    cache: Any
    rows: list[_Sequence | None]
    lengths: np.ndarray

    @property
    def width(self) -> int:
        return self.cache.length

    @property
    def live(self) -> np.ndarray:
        return np.array([row is not None for row in self.rows])

    def free_rows(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row is None]


@dataclass
class _Prefill:
    """Admitted requests whose prompts are being fed, left-padded into one matrix of ids."""

    requests: list[Request]
    ids: np.ndarray
    batch: _Batch  # its cache None until its first step where the prompts may go into the running batch
    fed: int = 0  # columns of ids already run
    first_row: int | None = None  # prefilled into the running batch's rows from this one on, in place


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """ids and attention mask with every prompt's last token in the last column (0 marks a pad)."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):], mask[i, width - len(prompt):] = prompt, 1
    return ids, mask


def right_aligned_mask(width: int, lengths: np.ndarray) -> np.ndarray:
    """[rows, width] attention mask whose row i is 1 in its last lengths[i] columns."""
    return (np.arange(width)[None, :] >= width - lengths[:, None]).astype(np.int64)


class Engine:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, eos_ids: set[int], max_context: int,
                 max_batch_size: int = 32, max_prefill_tokens: int = 512, pad_id: int | None = None,
                 prefill_first: bool = False) -> None:
        self.backend, self.tokenizer = backend, tokenizer
        limits = backend.limits
        self.max_batch_size = min(max_batch_size, limits.max_batch_size or max_batch_size)
        self.max_context = min(max_context, limits.max_context or max_context)
        self.max_prompt = min(limits.max_prompt or self.max_context - 1, self.max_context - 1)
        self.max_width = limits.max_context  # an engine's profiles bound the mask's width too
        self.chunked_prefill = limits.chunked_prefill
        self.rows_in_place = limits.rows_in_place
        self.max_prefill_tokens = max_prefill_tokens
        # True for a bulk call (generate, kiln batch): every waiting prompt that fits is prefilled before
        # the next decode step, since no one watches a running request's tokens arrive and a decode step
        # of part of the batch is a step the rest must run again later. False for a server: at most
        # max_prefill_tokens prompt tokens run between two decode steps.
        self.prefill_first = prefill_first
        self.eos_ids = set(eos_ids)
        self.pad_id = min(self.eos_ids, default=0) if pad_id is None else pad_id  # any valid id: pads are masked
        self._lock = threading.Lock()  # add_request and abort may come from other threads than step
        self._inbox: list[Request] = []
        self._aborts: set[Hashable] = set()
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.prefill: _Prefill | None = None
        self.running: _Batch | None = None
        self._aborted_in_prefill: set[Hashable] = set()
        self._steps_since_join = 0
        self._prefilled_since_decode = 0
        # KV slots the running sequences may grow to, at most (kiln serve sets it from the memory plan):
        # a request waits while admitting it could take the cache past it. None: rows are the only bound.
        self.max_tokens_in_flight: int | None = None

    # -- requests in ---------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.apply_chat_template(list(prompt))
        return [int(t) for t in prompt]

    def checked_prompt(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or RequestError saying what is wrong with the request."""
        problem = params.problem()
        if problem:
            raise RequestError(problem)
        if params.rows > self.max_batch_size:
            what = "num_beams" if params.num_beams > 1 else "n"
            raise RequestError(f"{what} is {params.rows}; this engine runs at most {self.max_batch_size} sequences "
                               "at once")
        try:
            ids = self.encode(prompt) if prompt else []
        except ValueError as exc:  # a chat template's own check
            raise RequestError(str(exc)) from None
        if not ids:
            raise RequestError("empty prompt")
        if len(ids) >= self.max_context:
            raise RequestError(f"prompt has {len(ids)} tokens; this artifact's max context is {self.max_context}")
        if len(ids) > self.max_prompt:
            raise RequestError(f"prompt has {len(ids)} tokens; this engine's prefill profile takes at most "
                               f"{self.max_prompt}")
        vocab = self.backend.vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            raise RequestError(f"token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams = DEFAULT_PARAMS,
                    request_id: Hashable | None = None) -> Hashable:
        """Queue a request; it joins the running batch at a coming step. Raises RequestError."""
        ids = self.checked_prompt(prompt, params)
        request = Request(next(self._ids) if request_id is None else request_id, ids, params, time.perf_counter())
        with self._lock:
            self._inbox.append(request)
        return request.id

    def abort(self, request_id: Hashable) -> None:
        """Stop a request; its rows are freed at the next step, which reports it with finish reason abort."""
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        return pending or bool(self.waiting) or self.prefill is not None or self._live_rows() > 0

    def stats(self) -> dict[str, int]:
        """For metrics: sequences running, requests waiting, rows in the batch, KV slots used and held."""
        batch, prefill = self.running, self.prefill  # read once: the engine thread may replace them meanwhile
        rows = len(batch.rows) if batch else 0
        with self._lock:
            inbox = len(self._inbox)
        prefilling = sum(r.params.rows for r in prefill.requests) if prefill else 0
        slots = (batch.cache.capacity or batch.width) if batch else 0
        return {"running": self._live_rows() + prefilling, "waiting": len(self.waiting) + inbox,
                "batch_rows": rows, "kv_slots_used": int(batch.lengths.sum()) if batch else 0,
                "kv_slots_allocated": rows * slots}

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One forward pass (a prefill or a decode step) and the events it produced."""
        events = self._take_new()
        try:
            events += self._forward()
            self._compact()
        except Exception as exc:  # noqa: BLE001 - outside any one forward pass: fail all in flight, start clean
            events += self.fail_all(_describe(exc))
        return events

    def _forward(self) -> list[Event]:
        if self._prefill_due():
            group = self.prefill.requests
            try:
                return self._prefill_step()
            except Exception as exc:  # noqa: BLE001 - a failed forward pass fails its requests, not the engine
                self.prefill = None
                return [self._failed(self._new_sequence(r, i), _describe(exc)) for r in group
                        for i in range(r.params.n)]
        if self._live_rows():
            try:
                return self._decode_step()
            except Exception as exc:  # noqa: BLE001
                events = [self._failed(row, _describe(exc)) for row in _reported(self.running.rows)]
                self.running = None
                return events
        return []

    def fail_all(self, message: str) -> list[Event]:
        """End every request in flight with an error event; the engine is empty afterwards."""
        requests = list(self.waiting) + (self.prefill.requests if self.prefill else [])
        events = [self._failed(self._new_sequence(r, i), message) for r in requests for i in range(r.params.n)]
        if self.running is not None:
            events += [self._failed(row, message) for row in _reported(self.running.rows)]
        self.waiting, self.prefill, self.running = deque(), None, None
        return events

    def _take_new(self) -> list[Event]:
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox, aborts, self._aborts = [], self._aborts, set()
        if not aborts:
            return []
        events = []
        for request in [r for r in self.waiting if r.id in aborts]:
            self.waiting.remove(request)
            events += [self._ended(self._new_sequence(request, i), "abort") for i in range(request.params.n)]
        if self.prefill is not None:  # left in the prefill batch, dropped when its prompt is done
            self._aborted_in_prefill |= {r.id for r in self.prefill.requests if r.id in aborts}
        if self.running is not None:
            for i, row in enumerate(self.running.rows):
                if row is not None and row.request.id in aborts:
                    events += [self._ended(row, "abort")] if _reported([row]) else []
                    self._free(i)
        return events

    def _prefill_due(self) -> bool:
        if self.prefill is None and not self._admit():
            return False
        return self._live_rows() == 0 or self.prefill_first or self._prefilled_since_decode < self.max_prefill_tokens

    def _admit(self) -> bool:
        """Move waiting requests into a new prefill batch: as many rows as are free, first come first
        served, within the prefill token budget (counted with padding), at least one request."""
        room = self.max_batch_size - self._live_rows()
        reserved = self._reserved()
        group, rows, width = [], 0, 0
        for request in self.waiting:
            wider = max(width, len(request.prompt))
            if rows + request.params.rows > room or (group and (len(group) + 1) * wider > self.max_prefill_tokens):
                break
            reserved += request.params.rows * self._reach(request)
            if (group or self._live_rows()) and self.max_tokens_in_flight is not None \
                    and reserved > self.max_tokens_in_flight:
                break
            group.append(request)
            rows, width = rows + request.params.rows, wider
        if not group:
            return False
        now = time.perf_counter()
        for request in group:
            request.admitted = now
        ids, _ = left_padded([r.prompt for r in group], self.pad_id)
        cache = None  # chosen at its first step (_prefill_cache)
        if not self._fills_in_place(group, width):
            cache = self.backend.new_cache(len(group), self._capacity(width))
        elif self.running is None:  # a batch with rows for the requests waiting behind these too
            total = rows + self._waiting_rows(rows, sum(self._reach(r) for r in group), skip=len(group))
            self.running = _Batch(self.backend.new_cache(total, self._capacity(width)), [None] * total,
                                  np.zeros(total, np.int64))
        for _ in group:  # only now: had the cache failed, they would still be waiting (and be failed there)
            self.waiting.popleft()
        self.prefill = _Prefill(group, ids, _Batch(cache, [None] * len(group), np.zeros(len(group), np.int64)))
        self._aborted_in_prefill = set()
        return True

    def _reach(self, request: Request) -> int:
        """The most KV slots one of the request's sequences can come to hold."""
        return min(len(request.prompt) + request.params.max_new_tokens, self.max_context)

    def _reserved(self) -> int:
        batch = self.running
        return 0 if batch is None else sum(self._reach(row.request) for row in batch.rows if row is not None)

    def _fills_in_place(self, group: list[Request], width: int) -> bool:
        """Whether the group's prompts may run straight into free rows of the running batch: a backend
        whose rows run apart, a row a request (no forks to copy at the join), and one step (a prompt fed
        in pieces meets decode steps, which may move the batch to new memory)."""
        return self.rows_in_place and all(r.params.rows == 1 for r in group) and \
            self._chunk(len(group), width, 0) == width

    def _chunk(self, rows: int, width: int, fed: int) -> int:
        """The prompt columns the next prefill step runs."""
        chunkable = self.chunked_prefill == "any" or (self.chunked_prefill == "one-row" and rows == 1)
        return min(width - fed, self.max_prefill_tokens) if chunkable else width - fed

    def _prefill_cache(self, prefill: _Prefill, rows: int, width: int) -> Any:
        """Free rows side by side in the running batch, where it has them and room past the prompts'
        width: the prompts are written there and the join copies nothing (a burst of 32 of SmolLM2's
        prompts, prefilled in three groups, copied 150 MB of cache). Else a cache of their own."""
        batch, run = self.running, 0
        if batch is not None and (batch.cache.capacity or 0) > max(width, batch.width):
            for i, row in enumerate(batch.rows):
                run = run + 1 if row is None else 0
                if run == rows:
                    view = self.backend.view_rows(batch.cache, i + 1 - rows, rows)
                    if view is not None:
                        prefill.first_row = i + 1 - rows
                        return view
                    break
        return self.backend.new_cache(rows, self._capacity(width))

    def _prefill_step(self) -> list[Event]:
        prefill = self.prefill
        rows, width = prefill.ids.shape
        if prefill.batch.cache is None:
            prefill.batch.cache = self._prefill_cache(prefill, rows, width)
        size = self._chunk(rows, width, prefill.fed)
        start, end = prefill.fed, prefill.fed + size
        prompt_lengths = np.array([len(r.prompt) for r in prefill.requests], np.int64)
        lengths = np.clip(end - (width - prompt_lengths), 0, prompt_lengths)
        positions = np.clip(lengths[:, None] - size + np.arange(size)[None, :], 0, None)
        logits, prefill.batch.cache = self.backend.run(prefill.ids[:, start:end], right_aligned_mask(end, lengths),
                                                       positions, prefill.batch.cache)
        prefill.fed, prefill.batch.lengths = end, lengths
        self._prefilled_since_decode += rows * size
        if end < width:
            return []
        self.prefill = None
        return self._first_tokens(prefill, logits[:, -1])

    def _first_tokens(self, prefill: _Prefill, logits: np.ndarray) -> list[Event]:
        """Each request's n sequences pick their first tokens from its prompt's logits; those that go on
        join the running batch."""
        events, joining, sources = [], [], []
        for row, request in enumerate(prefill.requests):
            if request.id in self._aborted_in_prefill:
                events += [self._ended(self._new_sequence(request, i), "abort") for i in range(request.params.n)]
                continue
            if request.params.num_beams > 1:
                events += self._start_beams(request, logits[row], row, joining, sources)
                continue
            for index in range(request.params.n):
                sequence = self._new_sequence(request, index)
                event = self._advance_guarded(sequence, logits, row)
                events.append(event)
                if event.finish_reason is None:
                    joining.append(sequence)
                    sources.append(row)
        if joining:
            self._join(prefill.batch, joining, sources, prefill.first_row)
        return events

    def _decode_step(self) -> list[Event]:
        batch = self.running
        self._make_room(batch, 1)
        live = batch.live
        feed = np.where(live, batch.lengths + 1, 1)  # a free row attends to its own pad: no empty softmax
        tokens = np.array([[row.token if row is not None else self.pad_id] for row in batch.rows], np.int64)
        positions = np.where(live, batch.lengths, 0)[:, None]
        logits, batch.cache = self.backend.run(tokens, right_aligned_mask(batch.width + 1, feed), positions,
                                               batch.cache)
        batch.lengths = np.where(live, batch.lengths + 1, 0)
        self._prefilled_since_decode = 0
        logits = logits[:, -1]
        events, searches = [], {}
        for i, row in enumerate(batch.rows):
            if row is None:
                continue
            if row.beams is not None:  # advanced together with the other beams of its request, below
                searches.setdefault(row.beams, [0] * row.beams.beams)[row.index] = i
                continue
            event = self._advance_guarded(row, logits, i)
            events.append(event)
            if event.finish_reason is not None:
                self._free(i)
        for search, rows in searches.items():
            events += self._advance_beams(search, rows, logits)
        return events

    # -- beam search: a request's K beams are K rows; after each step their parents' rows are copied in

    def _start_beams(self, request: Request, logits: np.ndarray, row: int, joining: list[_Sequence],
                     sources: list[int]) -> list[Event]:
        """The first step of a beam search, on its prompt's logits; its K beams join as K copies of the
        prompt's row (so no reordering yet), or it is done at once."""
        params = request.params
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        search = BeamSearch(params.num_beams, frozenset(eos), min(params.max_new_tokens,
                            self.max_context - len(request.prompt)), params.length_penalty, params.early_stopping,
                            params.min_tokens)
        beams = [self._new_sequence(request, k) for k in range(params.num_beams)]
        try:
            _, tokens = search.step(np.repeat(logits[None], params.num_beams, axis=0))
        except Exception as exc:  # noqa: BLE001 - one request's failure ends that request alone
            return [self._failed(beam, _describe(exc)) for beam in _reported(beams)]
        if search.done:
            return self._beam_results(search, beams)
        for beam, token in zip(beams, tokens, strict=True):
            beam.beams, beam.token, beam.result.generated_tokens = search, token, 1
        joining += beams
        sources += [row] * params.num_beams
        return []

    def _advance_beams(self, search: BeamSearch, rows: list[int], logits: np.ndarray) -> list[Event]:
        """One step of a search whose beams are these rows (by beam index): pick the next beams, then copy
        each moved beam's parent row into its row (one gather within the running cache)."""
        batch = self.running
        beams = [batch.rows[i] for i in rows]
        try:
            parents, tokens = search.step(logits[rows])
            moved = [k for k, parent in enumerate(parents) if parent != k]
            if moved and not search.done:
                batch.cache = self.backend.write_rows(batch.cache, [rows[k] for k in moved], batch.cache,
                                                      [rows[parents[k]] for k in moved])
        except Exception as exc:  # noqa: BLE001 - one request's failure ends that request alone
            events = [self._failed(beam, _describe(exc)) for beam in _reported(beams)]
        else:
            if not search.done:
                for beam, token in zip(beams, tokens, strict=True):
                    beam.token, beam.result.generated_tokens = token, beam.result.generated_tokens + 1
                return []
            events = self._beam_results(search, beams)
        for i in rows:
            self._free(i)
        return events

    def _beam_results(self, search: BeamSearch, beams: list[_Sequence]) -> list[Event]:
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

    # -- tokens -----------------------------------------------------------------------------------

    def _new_sequence(self, request: Request, index: int) -> _Sequence:
        seed = request.params.seed
        seed = None if seed is None else seed % 2**64  # any integer the API allows, negative ones too
        rng = None if request.params.greedy else np.random.default_rng(seed if index == 0 or seed is None
                                                                        else [seed, index])
        result = Result(prompt_tokens=len(request.prompt), logprobs=[] if request.params.logprobs is not None
                        else None, queue_s=(request.admitted or request.arrival) - request.arrival)
        return _Sequence(request, index, rng, IncrementalDecoder(self.tokenizer, request.prompt), result)

    def _advance_guarded(self, sequence: _Sequence, logits: np.ndarray, row: int) -> Event:
        try:
            return self._advance(sequence, self._pick(sequence, logits[row]), logits[row])
        except Exception as exc:  # noqa: BLE001 - one request's failure ends that request alone
            return self._failed(sequence, _describe(exc))

    def _pick(self, sequence: _Sequence, logits: np.ndarray) -> int:
        params, result = sequence.params, sequence.result
        if params.plain_greedy:
            return int(np.argmax(logits))
        if result.generated_tokens < params.min_tokens:
            logits = logits.copy()
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_ids))
            logits[banned] = -np.inf
        # The history matters only to the repetition penalty; skip building it otherwise.
        history = np.asarray(sequence.request.prompt + result.token_ids, np.int64) \
            if params.repetition_penalty != 1.0 else np.empty(0, np.int64)
        return next_token(logits, history, params, sequence.rng)

    def _advance(self, sequence: _Sequence, token: int, logits: np.ndarray) -> Event:
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
        may_stop = result.generated_tokens >= params.min_tokens
        finish = None
        if may_stop and token in params.stop_token_ids:
            finish = "stop"
        elif may_stop and token in self.eos_ids and not params.ignore_eos:
            finish = "eos"
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

    def _cut_at_stop(self, sequence: _Sequence, new_chars: int) -> bool:
        """Look for stop strings only where the new text could complete one, and cut the text there."""
        longest = max(len(s) for s in sequence.params.stop)
        start = max(0, len(sequence.text) - new_chars - longest + 1)
        found = [i for i in (sequence.text.find(s, start) for s in sequence.params.stop) if i >= 0]
        if not found:
            return False
        sequence.text = sequence.text[:min(found)]
        return True

    def _emit(self, sequence: _Sequence, token: int | None, finish: str | None,
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

    def _ended(self, sequence: _Sequence, reason: str) -> Event:
        return self._emit(sequence, None, reason)

    def _failed(self, sequence: _Sequence, message: str) -> Event:
        sequence.result.error = message
        return self._emit(sequence, None, "error")

    # -- rows and columns ------------------------------------------------------------------------

    def _live_rows(self) -> int:
        batch = self.running  # read once (stats() calls this from other threads)
        return 0 if batch is None else sum(row is not None for row in batch.rows)

    def _free(self, row: int) -> None:
        self.running.rows[row] = None
        self.running.lengths[row] = 0

    def _capacity(self, width: int) -> int:
        """Slots for shared buffers that must hold `width`: room to grow, but never past the max context
        (no row needs more; columns of padding are dropped first), so the memory plan's bound holds."""
        return max(width, min(width + max(MIN_GROWTH, width // 2), self.max_context))

    def _join(self, prefilled: _Batch, sequences: list[_Sequence], sources: list[int],
              first_row: int | None = None) -> None:
        """Copy the prefilled rows `sources` into free rows of the running batch, one per sequence (a
        forked prompt's row is copied once per sequence), or where they were prefilled in place, from
        `first_row` on, take them as they are."""
        lengths = prefilled.lengths[sources]
        self._steps_since_join = 0
        running = self.running
        if first_row is not None:
            front = max(0, prefilled.width - running.width)
            if front:  # wider prompts: the width callers see grows, in buffers with room for it (no copy)
                running.cache = self.backend.keep_rows(running.cache, range(len(running.rows)), front,
                                                       running.cache.capacity)
            for source, sequence, length in zip(sources, sequences, lengths, strict=True):
                running.rows[first_row + source], running.lengths[first_row + source] = sequence, length
            return
        if self._live_rows() == 0:
            cache = self.backend.keep_rows(prefilled.cache, sources, 0, self._capacity(prefilled.width))
            self.running = _Batch(cache, list(sequences), lengths.copy())
            return
        free = running.free_rows()
        missing = max(0, len(sequences) - len(free))
        if missing:  # rows for the requests waiting behind these too: one copy of the cache, not one per join
            wanted = self._live_rows() + len(sequences) + \
                self._waiting_rows(len(sequences), sum(self._reach(s.request) for s in sequences))
            missing = max(missing, min(wanted, self.max_batch_size) - len(running.rows))
        front = max(0, prefilled.width - running.width)
        if missing or front:  # the one case a join copies the running cache: more rows, or wider
            order = list(range(len(running.rows))) + [-1] * missing
            width = running.width + front
            capacity = running.cache.capacity
            if missing or capacity is None or capacity <= width:  # copied anyway, or short: room to grow
                capacity = max(capacity or 0, self._capacity(width))
            running.cache = self.backend.keep_rows(running.cache, order, front, capacity)
            running.rows += [None] * missing
            running.lengths = np.concatenate([running.lengths, np.zeros(missing, np.int64)])
            free = running.free_rows()
        targets = free[:len(sequences)]
        running.cache = self.backend.write_rows(running.cache, targets, prefilled.cache, sources)
        for target, sequence, length in zip(targets, sequences, lengths, strict=True):
            running.rows[target], running.lengths[target] = sequence, length

    def _waiting_rows(self, joining: int, reach: int, skip: int = 0) -> int:
        """The rows the waiting requests after the first `skip` take when admitted, first come first
        served, as far as the batch's rows and the KV slots in flight allow with `joining` rows more
        running, which may grow to `reach` slots."""
        room = self.max_batch_size - self._live_rows() - joining
        rows, reserved = 0, self._reserved() + reach
        for request in itertools.islice(self.waiting, skip, None):
            reserved += request.params.rows * self._reach(request)
            if rows + request.params.rows > room or (
                    self.max_tokens_in_flight is not None and reserved > self.max_tokens_in_flight):
                break
            rows += request.params.rows
        return rows

    def _make_room(self, batch: _Batch, slots: int) -> None:
        """Before a step that adds `slots` columns: drop the columns that are padding in every row when
        they are a quarter of the width or room is short, and grow shared buffers that are still short."""
        width, capacity = batch.width, batch.cache.capacity
        padding = width - int(batch.lengths.max())
        short = (capacity is not None and width + slots > capacity) or \
            (self.max_width is not None and width + slots > self.max_width)
        if padding and (short or padding >= max(1, width // 4)):
            rows = list(range(len(batch.rows)))
            batch.cache = self.backend.keep_rows(batch.cache, rows, -padding, capacity)
            width -= padding
        if capacity is not None and width + slots > capacity:
            rows = list(range(len(batch.rows)))
            batch.cache = self.backend.keep_rows(batch.cache, rows, 0, self._capacity(width + slots))

    def _compact(self) -> None:
        """Drop free rows when decoding them until the batch ends would cost more than one copy of the
        cache (about one decode step of the whole batch), nobody is waiting to take them, and nobody
        has joined for QUIET_STEPS steps."""
        batch = self.running
        if batch is None:
            return
        live = [i for i, row in enumerate(batch.rows) if row is not None]
        if not live:
            self.running = None  # idle: let the cache go
            return
        free = len(batch.rows) - len(live)
        self._steps_since_join += 1
        if not free or self.waiting or self.prefill is not None or self._steps_since_join < QUIET_STEPS:
            return
        steps_left = max(batch.rows[i].params.max_new_tokens - batch.rows[i].result.generated_tokens for i in live)
        if free * steps_left > len(batch.rows):
            padding = batch.width - int(batch.lengths[live].max())
            batch.cache = self.backend.keep_rows(batch.cache, live, -padding, batch.cache.capacity)
            batch.rows, batch.lengths = [batch.rows[i] for i in live], batch.lengths[live]


def _reported(rows: list[_Sequence | None]) -> list[_Sequence]:
    """The rows whose end is reported: every sequence, but only n of a beam search's K beams (a request
    answers with sequences 0..n-1)."""
    return [row for row in rows if row is not None and row.index < row.params.n]


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"
