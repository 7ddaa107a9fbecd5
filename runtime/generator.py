"""generate() and stream() over a list of prompts: thin loops over the step-level Engine (engine.py).

    prompts ─> token ids (a bad one gets its error result) ─> engine.add_request, shortest first
            ─> engine.step() until it has no work ─> events ─> results in prompt order

Shortest first because the engine admits in arrival order: prompts of similar length then share a
prefill, so less compute goes to padding.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .artifact import Artifact
from .device import providers_for
from .engine import DEFAULT_PARAMS, Engine, Event, Prompt, RequestError, Result, left_padded
from .memory import MIB, free_host_memory
from .model import Model, open_model
from .prefix_cache import default_budget
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = ["Event", "Generator", "Params", "Prompt", "Result", "left_padded"]

Params = SamplingParams | Sequence[SamplingParams]  # one for all requests, or one per request


class Generator:
    def __init__(self, artifact: Artifact, backend: Any, tokenizer: Tokenizer, max_batch_size: int = 32,
                 max_prefill_tokens: int = 512, prefill_first: bool = True, prefix_cache_mib: float | None = None
                 ) -> None:
        """prefill_first: the engine's policy for bulk calls (Engine.prefill_first); a server passes False.
        prefix_cache_mib: the prefix cache's budget (runtime/prefix_cache.py); None: its default, 0: off."""
        self.artifact, self.backend, self.tokenizer = artifact, backend, tokenizer
        max_context = artifact.manifest.model.max_context
        self.engine = Engine(backend, tokenizer, eos_ids(artifact), max_context, max_batch_size, max_prefill_tokens,
                             prefill_first=prefill_first,
                             prefix_cache_bytes=prefix_cache_bytes(backend, prefix_cache_mib, max_batch_size,
                                                                   max_context))

    @classmethod
    def load(cls, artifact_dir: str | Path, variant: str | None = None, providers: list[Any] | None = None,
             threads: int | None = None, max_batch_size: int = 32, verify: bool = True,
             max_prefill_tokens: int = 512, device: str | None = None, prefix_cache_mib: float | None = None
             ) -> Generator:
        """`device`: cpu, cuda, cuda:N or auto (runtime/device.py); else `providers`, ONNX Runtime's, as given."""
        model = open_model(artifact_dir, variant, providers_for(device, providers), threads, verify, max_batch_size,
                           max_prefill_tokens)
        return cls.of(model, max_batch_size, max_prefill_tokens, prefix_cache_mib=prefix_cache_mib)

    @classmethod
    def of(cls, model: Model, max_batch_size: int = 32, max_prefill_tokens: int = 512,
           prefill_first: bool = True, prefix_cache_mib: float | None = None) -> Generator:
        """A generator over a model opened by runtime/model.py."""
        return cls(model.artifact, model.backend, model.tokenizer, max_batch_size, max_prefill_tokens, prefill_first,
                   prefix_cache_mib)

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def max_batch_size(self) -> int:
        return self.engine.max_batch_size

    @property
    def eos_ids(self) -> set[int]:
        return self.engine.eos_ids

    @property
    def pad_id(self) -> int:
        return self.engine.pad_id

    def encode(self, prompt: Prompt) -> list[int]:
        return self.engine.encode(prompt)

    def generate(self, prompts: Sequence[Prompt], params: Params = DEFAULT_PARAMS) -> list[Result]:
        """One result per prompt; for n > 1 the first sequence's, the others in its `alternatives`."""
        results: list[Result | None] = [None] * len(prompts)
        others: dict[int, dict[int, Result]] = {}
        for event in self.stream(prompts, params):
            if event.result is None:
                continue
            if event.sequence == 0:
                results[event.index] = event.result
            else:
                others.setdefault(event.index, {})[event.sequence] = event.result
        for index, alternatives in others.items():
            results[index].alternatives = [alternatives[k] for k in sorted(alternatives)]
        return results

    def stream(self, prompts: Sequence[Prompt], params: Params = DEFAULT_PARAMS) -> Iterator[Event]:
        """Events as the engine produces them; a refused prompt's error event comes first."""
        per_request = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        accepted = []
        for index, (prompt, p) in enumerate(zip(prompts, per_request, strict=True)):
            try:
                accepted.append((self.engine.checked_prompt(prompt, p), p, index))
            except RequestError as exc:
                yield Event(index, None, "", "error", Result(error=str(exc), finish_reason="error"))
        for ids, p, index in sorted(accepted, key=lambda request: len(request[0])):
            self.engine.add_request(ids, p, request_id=index)
        try:
            while self.engine.has_work():
                yield from self.engine.step()
        finally:  # a caller that stops reading leaves nothing behind for the next call
            for _, _, index in accepted:
                self.engine.abort(index)
            while self.engine.has_work():
                self.engine.step()

    def warmup(self) -> None:
        """A prefill and a decode step, so the first real request pays for neither."""
        self.generate([[self.pad_id] * 4], SamplingParams(max_new_tokens=2, ignore_eos=True))
        prefix = self.engine.scheduler.prefix_cache
        if prefix is not None:  # not a request: the counters are the requests'
            prefix.queries = prefix.hits = 0


def prefix_cache_bytes(backend: Any, mib: float | None, max_batch_size: int, max_context: int) -> int:
    if mib is not None:
        return int(mib * MIB)
    return default_budget(backend, max_batch_size, max_context, free_host_memory())


def eos_ids(artifact: Artifact) -> set[int]:
    """The manifest's EOS ids and generation_config.json's (chat models often add the turn's end)."""
    eos = artifact.generation_config.get("eos_token_id")
    return set(artifact.manifest.model.eos_token_ids) | ({eos} if isinstance(eos, int) else set(eos or []))
