"""The OpenAI API's shapes: requests validated by pydantic (a wrong field is an error naming it),
SamplingParams from a request, and response bodies and stream chunks from engine results.

One schema and one code path for every front-end that speaks the API (`kiln serve` today, `kiln
batch`'s OpenAI Batch lines next), so an answer is the same however it was asked for.

Sampling defaults: a field the request leaves out takes the artifact's generation_config.json value
(temperature, top_p, top_k, min_p, repetition_penalty), as vLLM does, else the OpenAI API's default
(temperature 1). max_tokens left out means "up to the context", as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .engine import Result, TokenLogprob
from .manifest import Variant
from .sampling import MAX_LOGPROBS, SamplingParams
from .structured import GUIDED_FIELDS, OutputFormat

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FORMAT_FIELDS = ("response_format", *GUIDED_FIELDS)


class ApiError(Exception):
    """An error the API returns as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    # OpenAI's strict mode asks for exactly the schema; constrained decoding always gives exactly that.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as the API allows
    # Beam search, as vLLM takes it: use_beam_search with n beams, all n returned (best_of beams when
    # given, the best n returned); or num_beams, transformers' name for the width.
    use_beam_search: bool = False
    num_beams: int | None = Field(None, ge=1)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # Structured outputs (runtime/structured.py): OpenAI's response_format, or vLLM's guided_* names.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def refuse_unsupported(self) -> None:
        """Fields Kiln does not implement are refused when they would change the answer, never ignored."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported; use repetition_penalty", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "logit_bias")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def output_format(self) -> OutputFormat | None:
        """The one format the request asks for, or None for free text; ApiError (400) for two at once."""
        named = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            named.append("response_format")
        if len(named) > 1:
            raise ApiError(400, f"give one output format, not {' and '.join(named)}", named[1])
        if not named:
            return None
        if named[0] in GUIDED_FIELDS:
            return OutputFormat.of_field(named[0], getattr(self, named[0]))
        if response_format.type == "json_object":
            return OutputFormat.json_object()
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs json_schema.schema", "response_format")
        return OutputFormat.json_schema(spec.json_schema)

    def beam_width(self) -> int:
        if self.num_beams is not None:
            return self.num_beams
        return max(getattr(self, "best_of", None) or self.n, self.n) if self.use_beam_search else 1

    def top_logprobs_wanted(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self, prompt_tokens: int, max_context: int, defaults: dict[str, Any]) -> SamplingParams:
        """Raises ApiError (400) when the prompt and max_tokens do not fit the context."""
        max_tokens = self.requested_max_tokens()
        if prompt_tokens >= max_context:
            raise ApiError(400, f"This model's maximum context length is {max_context} tokens; the prompt has "
                                f"{prompt_tokens} tokens. Shorten the prompt.", "messages" if
                           isinstance(self, ChatCompletionRequest) else "prompt", "context_length_exceeded")
        if max_tokens is not None and prompt_tokens + max_tokens > max_context:
            field = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) else "max_tokens"
            raise ApiError(400, f"This model's maximum context length is {max_context} tokens. However, you "
                                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                                f"{max_tokens} for the completion). Reduce the prompt or {field}.", field,
                           "context_length_exceeded")
        beams = self.beam_width()
        # The artifact's sampling defaults are for sampling: a beam search takes only what it is given.
        defaults = defaults if beams == 1 else {"temperature": 0.0}
        chosen = {name: getattr(self, name) if getattr(self, name) is not None else defaults.get(name)
                  for name in GENERATION_DEFAULTS}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=max_tokens or max_context - prompt_tokens,
            temperature=1.0 if chosen["temperature"] is None else chosen["temperature"],
            top_k=max(0, chosen["top_k"] or 0), top_p=1.0 if chosen["top_p"] is None else chosen["top_p"],
            min_p=chosen["min_p"] or 0.0,
            repetition_penalty=1.0 if chosen["repetition_penalty"] is None else chosen["repetition_penalty"],
            seed=self.seed, stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=self.top_logprobs_wanted(), n=self.n,
            num_beams=beams, length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            output_format=self.output_format())


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.best_of not in (None, 1, self.n) and not (self.use_beam_search and self.best_of > self.n):
            raise ApiError(400, "best_of other than n is only supported with use_beam_search", "best_of")

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ApiError(400, "prompt must not be empty", "prompt")
        return prompts

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    type: str
    text: str | None = None


# The roles OpenAI's chat API takes; any other is a 400 there, and here.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        if self.role not in CHAT_ROLES:
            raise ApiError(400, f"Invalid value {self.role!r} for a message's role: it must be one of "
                           f"{', '.join(CHAT_ROLES)}", "messages")
        if isinstance(self.content, list):
            if any(part.type != "text" for part in self.content):
                raise ApiError(400, "only text content parts are supported", "messages")
            return {"role": self.role, "content": "".join(part.text or "" for part in self.content)}
        return {"role": self.role, "content": self.content or ""}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ------------------------------------------------------------------------------------

def with_defaults(defaults: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A request's fields over a job's defaults; a request that asks for an output format of its own
    drops the default's (whatever its field's name), instead of asking for two."""
    if any(fields.get(name) is not None for name in FORMAT_FIELDS):
        defaults = {key: value for key, value in defaults.items() if key not in FORMAT_FIELDS}
    return {**defaults, **fields}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_prompt_tokens(results: dict[int, Result], prompts: int) -> int:
    """The prefix cache's tokens of a request's prompts, each counted once (as prompt_tokens counts them)
    however many choices it has: choice i is prompt i // n's."""
    n = max(1, len(results) // max(1, prompts))
    return sum(result.cached_tokens for index, result in results.items() if index % n == 0)


def envelope(kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"], response_id: str,
             model: str, choices: list[dict[str, Any]], created: int | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": response_id, "object": kind, "created": created or int(time.time()), "model": model,
            "choices": choices, **extra}


def completion_logprobs(tokenizer: Any, logprobs: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy completions form: parallel lists of tokens, their logprobs, top alternatives, offsets."""
    tokens = [tokenizer.token_text(t.token_id) for t in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": [{tokenizer.token_text(i): lp for i, lp in t.top} for t in logprobs],
            "text_offset": offsets}


def chat_logprobs(tokenizer: Any, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": tokenizer.token_text(token), "logprob": logprob, "bytes": tokenizer.token_bytes(token)}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in logprobs], "refusal": None}


def completion_choice(index: int, result: Result, tokenizer: Any) -> dict[str, Any]:
    logprobs = completion_logprobs(tokenizer, result.logprobs) if result.logprobs is not None else None
    return {"index": index, "text": result.text, "logprobs": logprobs,
            "finish_reason": FINISH_REASONS[result.finish_reason]}


def chat_choice(index: int, result: Result, tokenizer: Any) -> dict[str, Any]:
    logprobs = chat_logprobs(tokenizer, result.logprobs) if result.logprobs is not None else None
    return {"index": index, "message": {"role": "assistant", "content": result.text, "refusal": None},
            "logprobs": logprobs, "finish_reason": FINISH_REASONS[result.finish_reason]}


def request_prompts(request: CompletionRequest | ChatCompletionRequest) -> tuple[list[Any], str]:
    """What the engine encodes for a request (a chat is one prompt), and the field that holds it."""
    if isinstance(request, ChatCompletionRequest):
        return [[m.as_template_input() for m in request.messages]], "messages"
    return request.prompts(), "prompt"


def response_body(chat: bool, model: str, results: dict[int, Result], prompts: list[list[int]], tokenizer: Any,
                  fingerprint: str, response_id: str | None = None) -> dict[str, Any]:
    """The whole (not streamed) answer to a request, from its results by choice index."""
    build = chat_choice if chat else completion_choice
    choices = [build(index, results[index], tokenizer) for index in sorted(results)]
    completion_tokens = sum(r.generated_tokens for r in results.values())
    used = usage(sum(map(len, prompts)), completion_tokens, cached_prompt_tokens(results, len(prompts)))
    return envelope("chat.completion" if chat else "text_completion",
                    response_id or new_id("chatcmpl" if chat else "cmpl"), model, choices,
                    usage=used, system_fingerprint=fingerprint)


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """pydantic's errors as one ApiError (400, as OpenAI's API and vLLM answer a bad value, where
    FastAPI would say 422): the first three, each with the field it is about."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A union field (prompt, stop, content) reports each alternative; its own name is what matters.
    location = [part for part in location if part not in ("str", "int", "bool")
                and not part.startswith(("list[", "dict[", "literal["))] or location
    param = ".".join(location) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:3])
    return ApiError(400, message, param, "invalid_value")


def fingerprint(entry: Variant) -> str:
    """system_fingerprint: which variant answered, so an A/B of variants can be told apart."""
    return f"kiln-{entry.name}"
