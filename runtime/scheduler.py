"""The scheduler, the engine's first part: which requests run, in which rows of which cache.

It holds the waiting queue, the prefill group being fed, and the running batch, and decides:
    admit        waiting requests into a prefill group: free rows, first come first served, within the
                 prefill token budget and the KV slots in flight
    prefill_due  whether the next step prefills (the budget between decode steps) or decodes
    chunk        how many prompt columns the next prefill step feeds
    join         a prefilled group's rows into the running batch (copied into free rows, or taken where
                 they were prefilled in place)
    make_room    before a step: padding columns dropped, shared buffers grown
    compact      free rows dropped when decoding them would cost more than one copy
The layout and why it is so are in engine.py's opening comment. The scheduler moves KV rows through
the backend's keep_rows / write_rows / view_rows and never runs the model.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends.base import Backend
from .outputs import Request, SequenceState
from .prefix_cache import MIN_REUSE_BLOCKS, PrefixCache, block_keys

MIN_GROWTH = 64  # shared buffers grow by at least this many slots, and by half their width
# Free rows are compacted away only after this many steps without a join: under load a finished
# request's client sends its next one within milliseconds, and compacting, then growing the batch
# again, would copy the whole cache twice for nothing.
QUIET_STEPS = 16


@dataclass
class Batch:
    """Rows right-aligned in the cache's `length` columns: row i holds its `lengths[i]` real slots
    in the last columns; a free row (None) has length 0."""

    cache: Any
    rows: list[SequenceState | None]
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
class PrefillGroup:
    """Admitted requests whose prompts are being fed, left-padded into one matrix of ids."""

    requests: list[Request]
    ids: np.ndarray
    batch: Batch  # its cache None until its first step where the prompts may go into the running batch
    fed: int = 0  # columns of ids already run
    first_row: int | None = None  # prefilled into the running batch's rows from this one on, in place
    aborted: set[Hashable] = field(default_factory=set)  # ids of requests aborted while their prompts run


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """ids and attention mask with every prompt's last token in the last column (0 marks a pad)."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):], mask[i, width - len(prompt):] = prompt, 1
    return ids, mask


class Scheduler:
    def __init__(self, backend: Backend, max_context: int, max_batch_size: int, max_prefill_tokens: int,
                 prefill_first: bool, pad_id: int) -> None:
        self.backend, self.max_context, self.pad_id = backend, max_context, pad_id
        limits = backend.limits
        self.max_batch_size = min(max_batch_size, limits.max_batch_size or max_batch_size)
        self.max_width = limits.max_context  # an engine's profiles bound the mask's width too
        self.chunked_prefill = limits.chunked_prefill
        self.rows_in_place = limits.rows_in_place
        self.max_prefill_tokens = max_prefill_tokens
        # True for a bulk call (generate, kiln batch): every waiting prompt that fits is prefilled before
        # the next decode step, since no one watches a running request's tokens arrive and a decode step
        # of part of the batch is a step the rest must run again later. False for a server: at most
        # max_prefill_tokens prompt tokens run between two decode steps.
        self.prefill_first = prefill_first
        # KV slots the running sequences may grow to, at most (kiln serve sets it from the memory plan):
        # a request waits while admitting it could take the cache past it. None: rows are the only bound.
        self.max_tokens_in_flight: int | None = None
        # Prompt prefixes' KV kept in blocks (prefix_cache.py); None: off, or a backend that cannot copy slots.
        self.prefix_cache: PrefixCache | None = None
        self.waiting: deque[Request] = deque()
        self.prefill: PrefillGroup | None = None
        self.running: Batch | None = None
        self.steps_since_join = 0
        self.prefilled_since_decode = 0

    def live_rows(self) -> int:
        batch = self.running  # read once (stats() calls this from other threads)
        return 0 if batch is None else sum(row is not None for row in batch.rows)

    def free(self, row: int) -> None:
        self.running.rows[row] = None
        self.running.lengths[row] = 0

    def clear(self) -> list[Request]:
        """Empty the scheduler: the requests it had not started (waiting, or in the prefill group)."""
        requests = list(self.waiting) + (self.prefill.requests if self.prefill else [])
        self.waiting, self.prefill, self.running = deque(), None, None
        return requests

    # -- admission -------------------------------------------------------------------------------

    def prefill_due(self) -> bool:
        if self.prefill is None and not self.admit():
            return False
        return self.live_rows() == 0 or self.prefill_first or self.prefilled_since_decode < self.max_prefill_tokens

    def admit(self) -> bool:
        """Move waiting requests into a new prefill group: as many rows as are free, first come first
        served, within the prefill token budget (counted with padding), at least one request. A request
        whose prompt begins with blocks the prefix cache holds is a group of its own, fed from there."""
        room = self.max_batch_size - self.live_rows()
        reserved = self._reserved()
        group, rows, width = [], 0, 0
        for request in self.waiting:
            wider = max(width, len(request.prompt))
            if rows + request.params.rows > room or (group and (len(group) + 1) * wider > self.max_prefill_tokens):
                break
            if group and self._prefix_waits(request, group):
                break
            reserved += request.params.rows * self._reach(request)
            if (group or self.live_rows()) and self.max_tokens_in_flight is not None \
                    and reserved > self.max_tokens_in_flight:
                break
            group.append(request)
            rows, width = rows + request.params.rows, wider
            if self._cached_blocks(request) >= MIN_REUSE_BLOCKS:
                break
        if not group:
            return False
        now = time.perf_counter()
        for request in group:
            request.admitted = now
        ids, _ = left_padded([r.prompt for r in group], self.pad_id)
        if self.prefix_cache is not None:
            cached = [self.prefix_cache.take(r.prefix_keys, len(r.prompt), use=len(group) == 1) for r in group]
            if cached[0] is not None:
                return self._admit_cached(group[0], ids, cached[0])
        cache = None  # chosen at its first step (prefill_cache)
        if not self._fills_in_place(group, width):
            cache = self.backend.new_cache(len(group), self._capacity(width))
        elif self.running is None:  # a batch with rows for the requests waiting behind these too
            total = rows + self._waiting_rows(rows, sum(self._reach(r) for r in group), skip=len(group))
            self.running = Batch(self.backend.new_cache(total, self._capacity(width)), [None] * total,
                                 np.zeros(total, np.int64))
        for _ in group:  # only now: had the cache failed, they would still be waiting (and be failed there)
            self.waiting.popleft()
        self.prefill = PrefillGroup(group, ids, Batch(cache, [None] * len(group), np.zeros(len(group), np.int64)))
        return True

    def _cached_blocks(self, request: Request) -> int:
        """The prompt's first blocks the prefix cache holds and would give it (0 where it is off)."""
        if self.prefix_cache is None:
            return 0
        if request.prefix_keys is None:
            request.prefix_keys = block_keys(request.prompt, self.prefix_cache.block_tokens)
        return self.prefix_cache.usable(request.prefix_keys, len(request.prompt))

    def _prefix_waits(self, request: Request, group: list[Request]) -> bool:
        """Whether a request is better left for a later group: it has MIN_REUSE_BLOCKS cached blocks or
        more (it runs alone, from them), or it begins with that many blocks of a prompt in this group,
        which it will find cached then (a burst with one system prompt: the first is prefilled, the rest
        reuse it)."""
        if self.prefix_cache is None:
            return False
        if self._cached_blocks(request) >= MIN_REUSE_BLOCKS:
            return True
        last = MIN_REUSE_BLOCKS - 1  # keys chain their prefix: equal there, equal in every block before
        if (len(request.prompt) - 1) // self.prefix_cache.block_tokens <= last:
            return False
        return any(len(member.prefix_keys) > last and member.prefix_keys[last] == request.prefix_keys[last]
                   for member in group)

    def _admit_cached(self, request: Request, ids: np.ndarray, slots: list[np.ndarray]) -> bool:
        """The request's prefill group, fed from its cached prefix on: a cache of its own holds the
        prefix's slots, as if those prompt columns had run."""
        fed = slots[0].shape[1]
        cache = self.backend.cache_of([slots], self._capacity(len(request.prompt)))
        request.cached_tokens = fed
        self.waiting.popleft()
        self.prefill = PrefillGroup([request], ids, Batch(cache, [None], np.array([fed], np.int64)), fed=fed)
        return True

    def remember(self, prefill: PrefillGroup) -> None:
        """Keep the blocks of the group's prompts in the prefix cache, now that their KV is complete."""
        if self.prefix_cache is None:
            return
        cache = prefill.batch.cache
        for row, request in enumerate(prefill.requests):
            if request.id in prefill.aborted or not request.prefix_keys:
                continue
            length = int(prefill.batch.lengths[row])
            self.prefix_cache.keep(request.prefix_keys, lambda start, stop, row=row, length=length:
                                   self.backend.slots_of(cache, row, length, start, stop))

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
            self.chunk(len(group), width, 0) == width

    def _waiting_rows(self, joining: int, reach: int, skip: int = 0) -> int:
        """The rows the waiting requests after the first `skip` take when admitted, first come first
        served, as far as the batch's rows and the KV slots in flight allow with `joining` rows more
        running, which may grow to `reach` slots."""
        room = self.max_batch_size - self.live_rows() - joining
        rows, reserved = 0, self._reserved() + reach
        for request in itertools.islice(self.waiting, skip, None):
            reserved += request.params.rows * self._reach(request)
            if rows + request.params.rows > room or (
                    self.max_tokens_in_flight is not None and reserved > self.max_tokens_in_flight):
                break
            rows += request.params.rows
        return rows

    # -- prefill ---------------------------------------------------------------------------------

    def chunk(self, rows: int, width: int, fed: int) -> int:
        """The prompt columns the next prefill step runs."""
        chunkable = self.chunked_prefill == "any" or (self.chunked_prefill == "one-row" and rows == 1)
        return min(width - fed, self.max_prefill_tokens) if chunkable else width - fed

    def prefill_cache(self, prefill: PrefillGroup) -> Any:
        """Free rows side by side in the running batch, where it has them and room past the prompts'
        width: the prompts are written there and the join copies nothing (a burst of 32 of SmolLM2's
        prompts, prefilled in three groups, copied 150 MB of cache). Else a cache of their own."""
        rows, width = prefill.ids.shape
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

    # -- rows and columns ------------------------------------------------------------------------

    def _capacity(self, width: int) -> int:
        """Slots for shared buffers that must hold `width`: room to grow, but never past the max context
        (no row needs more; columns of padding are dropped first), so the memory plan's bound holds."""
        return max(width, min(width + max(MIN_GROWTH, width // 2), self.max_context))

    def join(self, prefilled: Batch, sequences: list[SequenceState], sources: list[int],
             first_row: int | None = None) -> None:
        """Copy the prefilled rows `sources` into free rows of the running batch, one per sequence (a
        forked prompt's row is copied once per sequence), or where they were prefilled in place, from
        `first_row` on, take them as they are."""
        lengths = prefilled.lengths[sources]
        self.steps_since_join = 0
        running = self.running
        if first_row is not None:
            front = max(0, prefilled.width - running.width)
            if front:  # wider prompts: the width callers see grows, in buffers with room for it (no copy)
                running.cache = self.backend.keep_rows(running.cache, range(len(running.rows)), front,
                                                       running.cache.capacity)
            for source, sequence, length in zip(sources, sequences, lengths, strict=True):
                running.rows[first_row + source], running.lengths[first_row + source] = sequence, length
            return
        if self.live_rows() == 0:
            cache = self.backend.keep_rows(prefilled.cache, sources, 0, self._capacity(prefilled.width))
            self.running = Batch(cache, list(sequences), lengths.copy())
            return
        free = running.free_rows()
        missing = max(0, len(sequences) - len(free))
        if missing:  # rows for the requests waiting behind these too: one copy of the cache, not one per join
            wanted = self.live_rows() + len(sequences) + \
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

    def make_room(self, batch: Batch, slots: int) -> None:
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

    def compact(self) -> None:
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
        self.steps_since_join += 1
        if not free or self.waiting or self.prefill is not None or self.steps_since_join < QUIET_STEPS:
            return
        steps_left = max(batch.rows[i].params.max_new_tokens - batch.rows[i].result.generated_tokens for i in live)
        if free * steps_left > len(batch.rows):
            padding = batch.width - int(batch.lengths[live].max())
            batch.cache = self.backend.keep_rows(batch.cache, live, -padding, batch.cache.capacity)
            batch.rows, batch.lengths = [batch.rows[i] for i in live], batch.lengths[live]
