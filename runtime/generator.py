"""Batched decoding with a KV cache over a compiled artifact.

    prompts ─> token ids ─> left-pad into a batch ─> prefill ─> [pick tokens ─> stop? ─> decode one] ...

Left padding keeps every row's newest token in the last column, so one decode step serves all rows;
the attention mask hides the pads and position ids count only real tokens. Finished rows leave the
batch (and the cache) at once, so later steps cost less.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .artifact import Artifact
from .backend import open_backend
from .sampling import SamplingParams, next_token
from .tokenizer import Tokenizer

Prompt = str | list[int] | list[dict[str, str]]
Params = SamplingParams | Sequence[SamplingParams]  # one for all requests, or one per request
DEFAULT_PARAMS = SamplingParams()


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # eos | stop | length | error
    prompt_tokens: int = 0
    generated_tokens: int = 0
    error: str | None = None
    time_to_first_token_s: float | None = None
    total_s: float = 0.0


@dataclass(frozen=True)
class Event:
    """One streamed token: which request, the token, and the text it completed (may be empty)."""

    index: int
    token_id: int | None  # None for a request refused before decoding
    text: str
    finish_reason: str | None
    result: Result | None = None  # set on the request's last event


@dataclass
class _Row:
    index: int
    prompt: list[int]
    params: SamplingParams
    rng: np.random.Generator
    result: Result
    started: float
    emitted_text: str = ""


class Generator:
    def __init__(self, artifact: Artifact, backend: Any, tokenizer: Tokenizer,
                 max_batch_size: int = 32) -> None:
        self.artifact, self.backend, self.tokenizer = artifact, backend, tokenizer
        # An engine's profiles bound batch, prompt and context below what the graph itself allows.
        self.max_batch_size = min(max_batch_size, getattr(backend, "max_batch_size", max_batch_size))
        model = artifact.manifest["model"]
        self.max_context = min(model["max_context"], getattr(backend, "max_context", model["max_context"]))
        self.max_prompt = getattr(backend, "max_prompt", self.max_context - 1)
        # An engine bounds the batch's padded width too (its decode profile), not only each row's length.
        self.max_width = getattr(backend, "max_context", None)
        self.eos_ids = set(model["eos_token_ids"]) | set(_generation_eos(artifact.tokenizer_dir))
        self.pad_id = min(self.eos_ids, default=0)  # any valid id: pads are masked out

    @classmethod
    def load(cls, artifact_dir: str | Path, variant: str | None = None, providers: list[str] | None = None,
             threads: int | None = None, max_batch_size: int = 32, verify: bool = True) -> Generator:
        artifact = Artifact.open(artifact_dir, verify=verify)
        entry = artifact.variant(variant)
        backend = open_backend(artifact.folder, entry, providers, threads, verified=verify)
        return cls(artifact, backend, Tokenizer(artifact.tokenizer_dir), max_batch_size)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.apply_chat_template(list(prompt))
        return [int(t) for t in prompt]

    def generate(self, prompts: Sequence[Prompt], params: Params = DEFAULT_PARAMS) -> list[Result]:
        rows, results = self._admit(prompts, params)
        for _ in self._run(rows):
            pass
        return results

    def stream(self, prompts: Sequence[Prompt], params: Params = DEFAULT_PARAMS) -> Iterator[Event]:
        rows, results = self._admit(prompts, params)
        for index, result in enumerate(results):
            if result.error is not None:
                yield Event(index, None, "", "error", result)
        yield from self._run(rows)

    def warmup(self) -> None:
        self.generate([[self.pad_id] * 4], SamplingParams(max_new_tokens=2))

    # -- requests -> rows ------------------------------------------------------------------------

    def _admit(self, prompts: Sequence[Prompt], params: Any) -> tuple[list[_Row], list[Result]]:
        """Turn requests into rows; a bad request gets its error result and the others go on."""
        per_request = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        results, rows = [], []
        for index, (prompt, p) in enumerate(zip(prompts, per_request, strict=True)):
            result = Result()
            results.append(result)
            try:
                ids = self._checked(prompt, p)
            except ValueError as exc:
                result.error, result.finish_reason = str(exc), "error"
                continue
            result.prompt_tokens = len(ids)
            rng = np.random.default_rng(p.seed)
            rows.append(_Row(index, ids, p, rng, result, time.perf_counter()))
        return rows, results

    def _checked(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        problem = params.problem()
        if problem:
            raise ValueError(problem)
        ids = self.encode(prompt) if prompt else []
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; this artifact's max context is {self.max_context}")
        if len(ids) > self.max_prompt:
            raise ValueError(f"prompt has {len(ids)} tokens; this engine's prefill profile takes at most "
                             f"{self.max_prompt}")
        if max(ids) >= self.backend.vocab_size or min(ids) < 0:
            raise ValueError(f"token ids must be in [0, {self.backend.vocab_size})")
        return ids

    # -- the decode loop ---------------------------------------------------------------------------

    def _run(self, rows: list[_Row]) -> Iterator[Event]:
        # Similar lengths share a batch, so less compute goes to padding.
        rows = sorted(rows, key=lambda r: len(r.prompt))
        for start in range(0, len(rows), self.max_batch_size):
            yield from self._decode_batch(rows[start:start + self.max_batch_size])

    def _decode_batch(self, rows: list[_Row]) -> Iterator[Event]:
        input_ids, mask = left_padded([r.prompt for r in rows], self.pad_id)
        positions = np.clip(mask.cumsum(-1) - 1, 0, None)
        # Slots the batch can reach: the padded prompt plus the longest allowed continuation.
        capacity = mask.shape[1] + min(max(r.params.max_new_tokens for r in rows), self.max_context)
        cache = self.backend.new_cache(len(rows), capacity)
        logits, cache = self.backend.run(input_ids, mask, positions, cache)
        while rows:
            tokens = [self._pick(row, logits[i, -1]) for i, row in enumerate(rows)]
            full = self.max_width is not None and mask.shape[1] >= self.max_width
            events = [self._advance(row, token, full) for row, token in zip(rows, tokens, strict=True)]
            yield from events
            keep = [i for i, e in enumerate(events) if e.finish_reason is None]
            if len(keep) < len(rows):
                rows, mask = [rows[i] for i in keep], mask[keep]
                cache = self.backend.keep_rows(cache, keep)
                tokens = [tokens[i] for i in keep]
            if not rows:
                break
            mask = np.concatenate([mask, np.ones((len(rows), 1), np.int64)], axis=1)
            step_ids = np.array(tokens, np.int64)[:, None]
            logits, cache = self.backend.run(step_ids, mask, mask.sum(-1, keepdims=True) - 1, cache)

    def _pick(self, row: _Row, logits: np.ndarray) -> int:
        # The history matters only to the repetition penalty; skip building it on the greedy hot path.
        history = np.asarray(row.prompt + row.result.token_ids, np.int64) if row.params.repetition_penalty != 1.0 \
            else np.empty(0, np.int64)
        return next_token(logits, history, row.params, row.rng)

    def _advance(self, row: _Row, token: int, full: bool = False) -> Event:
        result = row.result
        now = time.perf_counter()
        if result.time_to_first_token_s is None:
            result.time_to_first_token_s = now - row.started
        result.token_ids.append(token)
        result.generated_tokens = len(result.token_ids)
        text = self.tokenizer.decode(result.token_ids)
        finish = self._finish_reason(row, token, text) or ("length" if full else None)
        if finish == "stop":
            text = _cut_at_stop(text, row.params.stop)
        result.text = text
        # Hold back a trailing partial UTF-8 sequence until the next token completes it.
        stable = text if finish or not text.endswith("\ufffd") else row.emitted_text
        delta, row.emitted_text = stable[len(row.emitted_text):], stable
        if finish:
            result.finish_reason, result.total_s = finish, now - row.started
        return Event(row.index, token, delta, finish, result if finish else None)

    def _finish_reason(self, row: _Row, token: int, text: str) -> str | None:
        if token in self.eos_ids and not row.params.ignore_eos:
            return "eos"
        if row.params.stop and any(s in text for s in row.params.stop):
            return "stop"
        generated = len(row.result.token_ids)
        if generated >= row.params.max_new_tokens or len(row.prompt) + generated >= self.max_context:
            return "length"
        return None


def left_padded(prompts: Sequence[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """ids and attention mask with every prompt's last token in the last column (0 marks a pad)."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):], mask[i, width - len(prompt):] = prompt, 1
    return ids, mask


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    return text[: min(text.find(s) for s in stops if s in text)]


def _generation_eos(folder: Path) -> list[int]:
    import json

    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])
