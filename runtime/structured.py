"""Structured outputs: a request's answer held to a format (a JSON Schema, any JSON object, a regular
expression, one of some strings, a Lark or GBNF grammar) by masking, at each step, every token that
cannot continue it, before the sampler sees the logits.

    OutputFormat ─(Constraints.problem: compiled once, refused before anything runs)─> llguidance grammar
    a sequence's LLMatcher: mask for the next token ─> pick among the allowed ─> consume_token ─> ...
                            stopped (nothing can follow) ─> the sequence ends with finish reason "stop"

Why llguidance (https://github.com/guidance-ai/llguidance) rather than xgrammar or outlines-core:
- it covers every format the issue lists, a context-free grammar included (Lark, and GBNF through its
  converter); outlines-core takes regular languages only (a JSON Schema becomes one regex);
- it needs nothing installed: one abi3 wheel of Rust, no torch (xgrammar's wheel requires torch, which a
  production host must never have) and it works on numpy bitmasks;
- it computes a mask lazily over a token trie: on SmolLM2's 49,152 tokens under a JSON Schema, 69 to
  77 us a mask (bench/structured.py), where a decode step takes milliseconds. vLLM and SGLang offer it
  as a structured-output backend.
The masks of a decode step's constrained rows are computed on a thread of their own while the forward
pass runs (llguidance and ONNX Runtime both release the GIL), so they cost nearly nothing on the
step's critical path (bench/structured.py measures it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

FormatKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON written one way, as json.dumps writes it: a small model left free to place whitespace spends its
# tokens on newlines (seen on SmolLM2: `{\n"confidence": 1\n\n,\n"label": ...`). A schema's own
# "x-guidance" options (llguidance's) override these.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# vLLM's request fields for the formats (OpenAI's response_format asks for the two JSON ones).
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


@dataclass(frozen=True)
class OutputFormat:
    """What a constrained answer must be. `spec` is the schema (JSON text), the regex, the grammar
    (Lark with a `start:` rule, else GBNF), or the choices (a JSON list); empty for json_object."""

    kind: FormatKind
    spec: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> OutputFormat:
        # Never sort the keys: the properties' order is the order they are written in.
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> OutputFormat:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> OutputFormat:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> OutputFormat:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str) -> OutputFormat:
        return cls("grammar", text)

    def describe(self) -> str:
        return self.kind.replace("_", " ")

    def api_fields(self) -> dict[str, Any]:
        """The request fields that ask for this format (vLLM's names), for rows that give none."""
        if self.kind == "json_object":
            return {"response_format": {"type": "json_object"}}
        value = json.loads(self.spec) if self.kind in ("json_schema", "choice") else self.spec
        return {next(name for name, kind in GUIDED_FIELDS.items() if kind == self.kind): value}

    @classmethod
    def of_field(cls, name: str, value: Any) -> OutputFormat:
        """The format a guided_* request field asks for."""
        return getattr(cls, GUIDED_FIELDS[name])(value)


def checked_grammar(fmt: OutputFormat, tokenizer: Any = None) -> tuple[str | None, str | None]:
    """(llguidance's grammar, None), or (None, what is wrong with the format in one line); checked
    against the tokenizer's view where one is given (a command line checks before loading a model)."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_of(fmt)
    except ValueError as exc:
        return None, f"invalid {fmt.describe()}: {_one_line(str(exc))}"
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        return None, f"invalid {fmt.describe()}: {_one_line(error)}"
    return grammar, None


def format_of_options(json_schema: str | None = None, regex: str | None = None, choice: str | None = None,
                      grammar: str | None = None) -> OutputFormat | None:
    """A command line's --json-schema FILE | --regex R | --choice A,B,C | --grammar FILE, checked;
    ValueError in one line for two at once, a file that cannot be read, or a format that is invalid."""
    given = [(flag, value) for flag, value in (("--json-schema", json_schema), ("--regex", regex),
                                               ("--choice", choice), ("--grammar", grammar)) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give one output format, not {' and '.join(flag for flag, _ in given)}")
    flag, value = given[0]
    if flag == "--regex":
        fmt = OutputFormat.regex(value)
    elif flag == "--choice":
        fmt = OutputFormat.choice([option.strip() for option in value.split(",")])
    else:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{flag} {value}: cannot be read ({exc.strerror if isinstance(exc, OSError) else exc})"
                             ) from None
        fmt = OutputFormat.json_schema(text) if flag == "--json-schema" else OutputFormat.grammar(text)
    _, problem = checked_grammar(fmt)
    if problem:
        raise ValueError(f"{flag}: {problem}")
    return fmt


def grammar_of(fmt: OutputFormat) -> str:
    """llguidance's grammar for a format; ValueError saying what is wrong where the text itself is."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if fmt.kind not in KINDS:
        raise ValueError(f"unknown output format {fmt.kind!r}; one of {', '.join(KINDS)}")
    if fmt.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if fmt.kind == "json_schema":
        try:
            schema = json.loads(fmt.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if fmt.kind == "regex":
        return LLMatcher.grammar_from_regex(fmt.spec)
    if fmt.kind == "choice":
        options = json.loads(fmt.spec)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("a choice needs at least one option, each a non-empty string")
        # Each option is a Lark string literal; JSON's escaping is Lark's.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    try:  # Lark, or GBNF (llama.cpp's grammar format), converted
        return LLMatcher.grammar_from_lark(any_to_lark(fmt.spec))
    except Exception as exc:  # noqa: BLE001 - the converter's own parse errors are of several types
        raise ValueError(str(exc)) from None


def _one_line(message: str) -> str:
    """llguidance's errors span lines (a caret under the fault); the first and any `error:` line say it."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    detail = [line for line in lines[1:] if line.lower().startswith("error:")]
    return " ".join(lines[:1] + detail)


class Constraints:
    """One engine's structured-output machinery: llguidance's view of the tokenizer (built at the first
    constrained request: about 0.3 s for SmolLM2's vocabulary), each format compiled once into a matcher
    that sequences copy, and the masks computed beside the forward pass."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        # The masks span the larger of the model's and the tokenizer's vocabularies (llguidance refuses a
        # vocabulary smaller than its tokenizer's); the logits take the model's part.
        self.mask_vocab = max(vocab_size, tokenizer.vocab_size)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._unavailable: str | None = None
        self._compiled = lru_cache(maxsize=64)(self._compile)
        # What structured outputs cost: masks applied, seconds the engine's thread spent computing them or
        # waiting for the constraint thread, and seconds spent computing them on either (bench/structured.py).
        self.masks = 0
        self.wait_s = 0.0
        self.compute_s = 0.0

    def prepare(self) -> str | None:
        """Build llguidance's view of the tokenizer now (a server does it while loading); why structured
        outputs are unavailable for this model, or None."""
        with self._lock:
            if self._ll_tokenizer is None and self._unavailable is None:
                from llguidance import LLTokenizer

                try:
                    self._ll_tokenizer = LLTokenizer(self.tokenizer.json(), n_vocab=self.mask_vocab,
                                                     eos_token=self.eos_ids or None)
                except Exception as exc:  # noqa: BLE001 - a tokenizer it cannot read: no formats, the rest runs
                    self._unavailable = f"structured outputs are unavailable for this model's tokenizer: " \
                                        f"{_one_line(str(exc))}"
            return self._unavailable

    def _compile(self, fmt: OutputFormat) -> tuple[Any, str | None]:
        """(a matcher at the format's start, None), or (None, what is wrong): once per distinct format."""
        from llguidance import LLMatcher

        unavailable = self.prepare()
        if unavailable:
            return None, unavailable
        grammar, problem = checked_grammar(fmt, self._ll_tokenizer)
        if problem:
            return None, problem
        matcher = LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return None, f"invalid {fmt.describe()}: {_one_line(matcher.get_error())}"
        return matcher, None

    def problem(self, fmt: OutputFormat) -> str | None:
        """What is wrong with a format, in one line, or None."""
        return self._compiled(fmt)[1]

    def matcher(self, fmt: OutputFormat) -> Any:
        """A sequence's own matcher: a copy of the format's compiled one (about 10 us; compiling a schema
        again takes milliseconds)."""
        template, problem = self._compiled(fmt)
        if problem:
            raise ValueError(problem)
        return template.deep_copy()

    def allowed(self, matcher: Any) -> np.ndarray:
        """The tokens a matcher allows next, as a boolean row over the model's vocabulary."""
        return self.allowed_rows([matcher])[0]

    def allowed_rows(self, matchers: list[Any]) -> np.ndarray:
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        begun = time.perf_counter()
        bits = allocate_token_bitmask(len(matchers), self.mask_vocab)
        for i, matcher in enumerate(matchers):
            fill_next_token_bitmask(matcher, bits, i)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size].astype(bool)
        self.compute_s += time.perf_counter() - begun
        return allowed

    def start(self, matchers: list[Any]) -> Future:
        """The masks of these matchers, computed on the constraint thread while the caller goes on."""
        return _mask_pool().submit(self.allowed_rows, matchers)


@lru_cache(maxsize=1)
def _mask_pool() -> ThreadPoolExecutor:
    """One thread for every engine of the process (an engine runs one step at a time)."""
    return ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar")
