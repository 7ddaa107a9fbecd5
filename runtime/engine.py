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

The engine is three parts and the loop that drives them (as vLLM's v1 engine splits it):
    scheduler.py  the waiting queue, admission and the prefill budget, rows and columns of the cache
    executor.py   one forward pass: its inputs and the backend call
    outputs.py    sampling, logprobs, stop tokens and strings, detokenization, beams -> events
This module holds the loop (step), the requests' way in (add_request, abort) and their checks.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Hashable

import numpy as np

from .backends.base import Backend
from .beam import BeamSearch
from .executor import StepExecutor, right_aligned_mask
from .outputs import (
    Event,
    OutputProcessor,
    Request,
    RequestError,
    Result,
    TokenLogprob,
    describe,
    reported,
)
from .prefix_cache import PrefixCache
from .sampling import SamplingParams
from .scheduler import PrefillGroup, Scheduler, left_padded
from .structured import Constraints
from .tokenizer import Tokenizer

__all__ = ["DEFAULT_PARAMS", "Engine", "Event", "Prompt", "Request", "RequestError", "Result", "TokenLogprob",
           "left_padded", "right_aligned_mask"]

Prompt = str | list[int] | list[dict[str, str]]
DEFAULT_PARAMS = SamplingParams()


def _scheduler_field(name: str) -> property:
    """An engine setting or state that lives in its scheduler (callers tune the budget on the engine)."""
    return property(lambda self: getattr(self.scheduler, name),
                    lambda self, value: setattr(self.scheduler, name, value))


class Engine:
    max_batch_size = _scheduler_field("max_batch_size")
    max_prefill_tokens = _scheduler_field("max_prefill_tokens")
    prefill_first = _scheduler_field("prefill_first")
    max_tokens_in_flight = _scheduler_field("max_tokens_in_flight")
    waiting = _scheduler_field("waiting")
    prefill = _scheduler_field("prefill")
    running = _scheduler_field("running")

    def __init__(self, backend: Backend, tokenizer: Tokenizer, eos_ids: set[int], max_context: int,
                 max_batch_size: int = 32, max_prefill_tokens: int = 512, pad_id: int | None = None,
                 prefill_first: bool = False, prefix_cache_bytes: int = 0) -> None:
        """prefix_cache_bytes: the prefix cache's budget (prefix_cache.py); 0, or a backend whose slots stay
        on its device, turns it off."""
        self.backend, self.tokenizer = backend, tokenizer
        limits = backend.limits
        self.max_context = min(max_context, limits.max_context or max_context)
        self.max_prompt = min(limits.max_prompt or self.max_context - 1, self.max_context - 1)
        self.eos_ids = set(eos_ids)
        self.pad_id = min(self.eos_ids, default=0) if pad_id is None else pad_id  # any valid id: pads are masked
        self.scheduler = Scheduler(backend, self.max_context, max_batch_size, max_prefill_tokens, prefill_first,
                                   self.pad_id)
        if prefix_cache_bytes > 0 and limits.host_slots:
            self.scheduler.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.executor = StepExecutor(backend, self.pad_id)
        self.constraints = Constraints(tokenizer, backend.vocab_size, self.eos_ids)
        self.outputs = OutputProcessor(tokenizer, self.eos_ids, self.max_context, self.constraints)
        self._lock = threading.Lock()  # add_request and abort may come from other threads than step
        self._inbox: list[Request] = []
        self._aborts: set[Hashable] = set()
        self._ids = itertools.count()

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
        if params.output_format is not None:
            problem = self.constraints.problem(params.output_format)
            if problem:
                raise RequestError(problem)
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
        return pending or bool(self.waiting) or self.prefill is not None or self.scheduler.live_rows() > 0

    def stats(self) -> dict[str, int]:
        """For metrics: sequences running, requests waiting, rows in the batch, KV slots used and held."""
        batch, prefill = self.running, self.prefill  # read once: the engine thread may replace them meanwhile
        rows = len(batch.rows) if batch else 0
        with self._lock:
            inbox = len(self._inbox)
        prefilling = sum(r.params.rows for r in prefill.requests) if prefill else 0
        slots = (batch.cache.capacity or batch.width) if batch else 0
        prefix = self.scheduler.prefix_cache
        return {"running": self.scheduler.live_rows() + prefilling, "waiting": len(self.waiting) + inbox,
                "batch_rows": rows, "kv_slots_used": int(batch.lengths.sum()) if batch else 0,
                "kv_slots_allocated": rows * slots, **(prefix.stats() if prefix else {})}

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One forward pass (a prefill or a decode step) and the events it produced."""
        events = self._take_new()
        try:
            events += self._forward()
            self.scheduler.compact()
        except Exception as exc:  # noqa: BLE001 - outside any one forward pass: fail all in flight, start clean
            events += self.fail_all(describe(exc))
        return events

    def _forward(self) -> list[Event]:
        if self.scheduler.prefill_due():
            group = self.prefill.requests
            try:
                return self._prefill_step()
            except Exception as exc:  # noqa: BLE001 - a failed forward pass fails its requests, not the engine
                self.prefill = None
                return [self.outputs.failed(self.outputs.new_sequence(r, i), describe(exc)) for r in group
                        for i in range(r.params.n)]
        if self.scheduler.live_rows():
            try:
                return self._decode_step()
            except Exception as exc:  # noqa: BLE001
                events = [self.outputs.failed(row, describe(exc)) for row in reported(self.running.rows)]
                self.running = None
                return events
        return []

    def fail_all(self, message: str) -> list[Event]:
        """End every request in flight with an error event; the engine is empty afterwards."""
        running = self.running
        requests = self.scheduler.clear()
        events = [self.outputs.failed(self.outputs.new_sequence(r, i), message) for r in requests
                  for i in range(r.params.n)]
        if running is not None:
            events += [self.outputs.failed(row, message) for row in reported(running.rows)]
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
            events += [self.outputs.ended(self.outputs.new_sequence(request, i), "abort")
                       for i in range(request.params.n)]
        if self.prefill is not None:  # left in the prefill group, dropped when its prompt is done
            self.prefill.aborted |= {r.id for r in self.prefill.requests if r.id in aborts}
        if self.running is not None:
            for i, row in enumerate(self.running.rows):
                if row is not None and row.request.id in aborts:
                    events += [self.outputs.ended(row, "abort")] if reported([row]) else []
                    self.scheduler.free(i)
        return events

    def _prefill_step(self) -> list[Event]:
        prefill = self.prefill
        rows, width = prefill.ids.shape
        if prefill.batch.cache is None:
            prefill.batch.cache = self.scheduler.prefill_cache(prefill)
        size = self.scheduler.chunk(rows, width, prefill.fed)
        logits = self.executor.prefill(prefill, size)
        self.scheduler.prefilled_since_decode += rows * size
        if prefill.fed < width:
            return []
        self.prefill = None
        self.scheduler.remember(prefill)
        return self._first_tokens(prefill, logits)

    def _first_tokens(self, prefill: PrefillGroup, logits: np.ndarray) -> list[Event]:
        """Each request's n sequences pick their first tokens from its prompt's logits; those that go on
        join the running batch."""
        events, joining, sources = [], [], []
        for row, request in enumerate(prefill.requests):
            if request.id in prefill.aborted:
                events += [self.outputs.ended(self.outputs.new_sequence(request, i), "abort")
                           for i in range(request.params.n)]
                continue
            if request.params.num_beams > 1:
                beams, ended = self.outputs.start_beams(request, logits[row])
                events += ended
                joining += beams
                sources += [row] * len(beams)
                continue
            for index in range(request.params.n):
                sequence = self.outputs.new_sequence(request, index)
                event = self.outputs.next_event(sequence, logits[row])
                events.append(event)
                if event.finish_reason is None:
                    joining.append(sequence)
                    sources.append(row)
        if joining:
            self.scheduler.join(prefill.batch, joining, sources, prefill.first_row)
        return events

    def _decode_step(self) -> list[Event]:
        batch = self.running
        self.scheduler.make_room(batch, 1)
        masks = self.outputs.start_masks(batch.rows)  # computed while the forward pass runs
        logits = self.executor.decode(batch)
        self.outputs.take_masks(masks)
        self.scheduler.prefilled_since_decode = 0
        events, searches = [], {}
        for i, row in enumerate(batch.rows):
            if row is None:
                continue
            if row.beams is not None:  # advanced together with the other beams of its request, below
                searches.setdefault(row.beams, [0] * row.beams.beams)[row.index] = i
                continue
            event = self.outputs.next_event(row, logits[i])
            events.append(event)
            if event.finish_reason is not None:
                self.scheduler.free(i)
        for search, rows in searches.items():
            events += self._step_beams(search, rows, logits)
        return events

    def _step_beams(self, search: BeamSearch, rows: list[int], logits: np.ndarray) -> list[Event]:
        """One step of a search whose beams are these rows (by beam index): the next beams, then each moved
        beam's row takes its parent's KV (one gather within the running cache)."""
        batch = self.running
        beams = [batch.rows[i] for i in rows]
        try:
            moved, events = self.outputs.step_beams(search, beams, logits[rows])
            if moved:
                batch.cache = self.backend.write_rows(batch.cache, [rows[k] for k, _ in moved], batch.cache,
                                                      [rows[parent] for _, parent in moved])
        except Exception as exc:  # noqa: BLE001 - one request's failure ends that request alone
            events = [self.outputs.failed(beam, describe(exc)) for beam in reported(beams)]
        if events is None:
            return []
        for i in rows:
            self.scheduler.free(i)
        return events
